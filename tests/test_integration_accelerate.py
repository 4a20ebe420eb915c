"""``shardpoint.integrations.accelerate.save_state / load_state`` with the real ``accelerate.Accelerator``.

* Under ``torchrun`` at 2 ranks (``Accelerator(cpu=True)``: DDP on gloo; the jobs are in
  tests/integration_hf_accelerate_worker.py, whose training loop calls
  ``accelerator.save_state`` / ``load_state`` on a patched Accelerator): a run stopped after step 6 of 8 and
  resumed in new processes, mid-epoch, ends with weights, optimizer state and scheduler
  bit-identical to an uninterrupted run. Model, optimizer, scheduler, a data loader, a
  ``register_for_checkpointing`` object and the random streams (the model has dropout)
  all come back. Automatic naming and ``total_limit`` hold, ``shardpoint verify`` passes,
  and a flipped byte in the newest checkpoint is named on load.
* The device meshes Accelerate builds for FSDP2 (its ``ParallelismConfig``: HSDP, context
  and tensor parallel, at 4 ranks) are accepted by ``Topology.from_mesh``, and an HSDP
  model saved with that topology loads back exactly. Accelerate itself runs FSDP only on
  accelerators (on CPU it keeps ``MULTI_CPU`` and ignores the plugin), so the meshes
  are built with Accelerate's own code and the model sharded with ``fully_shard``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import shardpoint as sp
from tests import distributed

WORKER = str(Path(__file__).with_name("integration_hf_accelerate_worker.py"))
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_worker(phase: str, out: Path, timeout: float = 240) -> None:
    done = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", WORKER, phase, str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )
    assert done.returncode == 0, f"{phase} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


def checkpoints(project: Path) -> list[str]:
    return sorted(p.name for p in (project / "checkpoints").iterdir() if p.is_dir())


def test_ddp_stop_and_resume_is_bit_identical(tmp_path):
    run_worker("runs", tmp_path)
    stopped_dir = tmp_path / "stopped"
    assert checkpoints(stopped_dir) == ["checkpoint_1", "checkpoint_2"]  # saves 0..2, total_limit=2
    # a damaged copy: one flipped byte in the newest checkpoint's largest data file
    shutil.copytree(stopped_dir, tmp_path / "corrupt", ignore=shutil.ignore_patterns(".shardpoint.lock"))
    newest = tmp_path / "corrupt" / "checkpoints" / "checkpoint_2"
    damaged = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))

    run_worker("resume", tmp_path)
    full, stopped, resumed = (
        torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("full", "stopped", "resumed")
    )
    assert (full["step"], stopped["step"], resumed["step"]) == (8, 6, 8)
    assert resumed["loaded"] == str(stopped_dir / "checkpoints" / "checkpoint_2")
    assert not all(torch.equal(v, full["model"][k]) for k, v in stopped["model"].items())  # it did stop early
    assert sorted(full["model"]) == sorted(resumed["model"])
    for key, tensor in full["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key
    state_full, state_resumed = full["optimizer"]["state"], resumed["optimizer"]["state"]
    assert sorted(state_full) == sorted(state_resumed) and state_full
    for param, values in state_full.items():
        for name, value in values.items():
            assert torch.equal(value, state_resumed[param][name]), (param, name)
    assert full["optimizer"]["param_groups"] == resumed["optimizer"]["param_groups"]
    assert full["scheduler"] == resumed["scheduler"]
    # the save counter continued from the loaded checkpoint: checkpoint_3, and total_limit still holds
    assert resumed["save_iteration"] == full["save_iteration"] == 4
    assert checkpoints(stopped_dir) == ["checkpoint_2", "checkpoint_3"]

    for rank in (0, 1):
        error = (tmp_path / f"corrupt.error{rank}").read_text()
        assert "Error" in error and damaged.name in error and "checkpoint_2" in error, error
    report = subprocess.run(
        [str(BIN / "shardpoint"), "verify", str(stopped_dir / "checkpoints"), "--all"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0 and "2 checkpoint(s) verified" in report.stdout, report.stdout + report.stderr
    # the mesh Accelerate builds for plain FSDP2 (dp_shard) reads as data parallel
    assert json.loads((tmp_path / "mesh.json").read_text()) == {"names": ["dp_shard"], "tp": 1, "pp": 1, "dp": 2}


MESHES = [
    ({"dp_replicate_size": 2, "dp_shard_size": 2}, (1, 1, 4), "dp"),
    ({"dp_shard_size": 2, "cp_size": 2}, (1, 1, 4), "dp_cp"),
    ({"dp_shard_size": 2, "tp_size": 2}, (2, 1, 2), "dp_shard"),
]


def _accelerate_meshes(rank: int, world: int, root: str) -> list:
    from accelerate.utils import ParallelismConfig
    from torch.distributed.fsdp import fully_shard

    found = []
    for sizes, _, data_dim in MESHES:
        mesh = ParallelismConfig(**sizes).build_device_mesh("cpu")
        topology = sp.Topology.from_mesh(mesh)
        found.append(
            ((topology.tp_size, topology.pp_size, topology.dp_size), topology.dp_rank, mesh[data_dim].get_local_rank())
        )
    # HSDP on Accelerate's mesh, saved and loaded with the topology read from it
    mesh = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).build_device_mesh("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    saved = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with sp.Checkpointer(root, topology=sp.Topology.from_mesh(mesh), layout="accelerate") as ckpt:
        ckpt.save(1, sp.TrainState(model=model))
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        ckpt.load(sp.TrainState(model=model))
    exact = all(torch.equal(v.full_tensor(), saved[k]) for k, v in model.state_dict().items())
    return [found, exact]


def test_accelerate_meshes_are_read_and_an_hsdp_save_loads(tmp_path):
    launch = functools.partial(distributed.launch, backend="gloo")  # DeviceMesh needs plain gloo groups
    results = launch(_accelerate_meshes, 4, str(tmp_path / "hsdp"))
    for rank, (found, exact) in enumerate(results):
        assert exact, rank
        for (sizes, expected, _), (topology, dp_rank, mesh_rank) in zip(MESHES, found):
            assert topology == expected, sizes
            assert dp_rank == mesh_rank, (sizes, rank)  # the coordinate is the one Accelerate's mesh gives
    assert (tmp_path / "hsdp" / "checkpoint_1" / "shardpoint.json").is_file()
