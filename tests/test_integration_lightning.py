"""Lightning's ``Trainer`` checkpointing through ``ShardpointCheckpointIO``: real Lightning, real processes.

The multi-process scenarios run ``tests/integration_lightning_worker.py`` under
``torchrun`` (gloo, 2 CPU ranks; one plain process for the 1-rank resume), the way a
user's script runs; see that file for what each scenario trains. ``FSDPStrategy`` needs
a GPU and is not tested (the plugin refuses it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch

from tests import distributed

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "integration_lightning_worker.py"
BIN = Path(sys.executable).parent


def run_worker(scenario: str, work: Path, ranks: int = 2, killed: bool = False) -> dict:
    """Run one worker scenario; its rank 0 results (or, for a killed run, what it saved before)."""
    launcher = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [*launcher, str(WORKER), scenario, str(work)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    output = done.stdout + done.stderr
    if killed:
        assert done.returncode != 0 and "(exitcode: 17)" in output, output[-3000:]
    else:
        assert done.returncode == 0, output[-3000:]
    return torch.load(work / f"{scenario}.pt", weights_only=True)


def assert_same(a, b, path: str = "") -> None:
    """Deep equality with bit-identical tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), f"{path}: keys {list(a)} vs {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def checkpoints(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if not p.name.startswith(".")}


def marker(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "shardpoint.json").read_text())


def verify(*directories: Path) -> list[subprocess.CompletedProcess]:
    """``shardpoint verify`` of each directory, run side by side."""
    procs = [
        subprocess.Popen([str(BIN / "shardpoint"), "verify", str(d)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for d in directories
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=120), p.stdout.read().decode(), "") for p in procs]


def test_ddp_resume_after_a_kill_is_bit_identical_verified_and_a_flipped_byte_is_named(tmp_path):
    first = run_worker("ddp-first", tmp_path, killed=True)
    # the kill came after step 5: the newest committed checkpoint is step 4's, at the paths ModelCheckpoint chose
    assert checkpoints(tmp_path / "B" / "ckpt") == {"epoch=1-step=4.ckpt", "last.ckpt"}
    assert marker(tmp_path / "B" / "ckpt" / "last.ckpt")["iteration"] == 4

    resumed = run_worker("ddp-resume", tmp_path)
    reference, result = first["A"], resumed["B"]
    assert result["global_step"] == reference["global_step"] == 6
    assert_same(result["weights"], reference["weights"], "weights")
    assert_same(result["optimizer"], reference["optimizer"], "optimizer")  # Adam moments, steps, param groups
    assert result["lr"] == reference["lr"] == 0.05 * 0.5**3  # the LR scheduler resumed too

    # save_top_k=1 of the step checkpoints: each older one was removed through the plugin
    for run in ("A", "B"):
        assert checkpoints(tmp_path / run / "ckpt") == {"epoch=2-step=6.ckpt", "last.ckpt"}
    intact = [tmp_path / "B" / "ckpt" / name for name in ("epoch=2-step=6.ckpt", "last.ckpt")]  # the resume's
    flipped = tmp_path / "B-flipped" / "ckpt" / "last.ckpt"
    *reports, damaged = verify(*intact, flipped)
    for report in reports:
        assert report.returncode == 0, report.stdout
    assert damaged.returncode == 1 and resumed["flipped"] in damaged.stdout, damaged.stdout

    # resuming from the damaged newest checkpoint fails on every rank, naming the file
    assert resumed["error"].startswith("CorruptCheckpointError"), resumed.get("error")
    assert resumed["flipped"] in resumed["error"] and str(flipped) in resumed["error"]


def test_model_parallel_fsdp2_at_2_ranks_resumes_at_1_rank_with_identical_full_state(tmp_path):
    saved = run_worker("mp-save", tmp_path)["saved"]
    assert marker(tmp_path / "M" / "ckpt" / "last.ckpt")["topology"] == {"tp": 1, "pp": 1, "dp": 2}
    loaded = run_worker("mp-resume", tmp_path, ranks=1)["loaded"]
    assert loaded["global_step"] == saved["global_step"] == 6
    assert_same(loaded["weights"], saved["weights"], "weights")
    assert_same(loaded["optimizer"], saved["optimizer"], "optimizer")

    # ModelCheckpoint(monitor="val_loss", save_top_k=2) over 3 epochs: the worst was removed through the plugin
    topk = tmp_path / "M" / "topk"
    assert len(saved["topk"]) == 2
    assert checkpoints(topk) == {Path(p).name for p in saved["topk"]}
    assert sorted(p.name for p in topk.glob(".*.latest")) == sorted(f".{Path(p).name}.latest" for p in saved["topk"])

    # inference from the sharded checkpoint, in this process, the way Lightning users load a trained model
    from tests.integration_lightning_worker import Tiny

    model = Tiny.load_from_checkpoint(tmp_path / "M" / "ckpt" / "last.ckpt")  # a directory (IsADirectoryError before)
    assert_same(model.state_dict(), saved["weights"], "weights at full size")


def _lightning_mesh_topologies(rank: int, world: int) -> list[tuple[int, int, int, int]]:
    from torch.distributed.device_mesh import init_device_mesh

    import shardpoint as sp

    found = []
    for dp, tp in ((2, 1), (1, 2)):
        # the mesh ModelParallelStrategy(dp, tp) builds (lightning.fabric's _setup_device_mesh), without
        # importing Lightning in each rank; the ModelParallelStrategy test above uses Lightning's own
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
        topo = sp.Topology.from_mesh(mesh)
        found.append((topo.dp_size, topo.tp_size, topo.dp_rank, topo.tp_rank))
    return found


def test_topology_from_the_meshes_lightning_builds():
    # DeviceMesh finds its groups by their C++ name, which the strict backend's groups lack: plain gloo
    results = distributed.launch(_lightning_mesh_topologies, 2, backend="gloo")
    assert results == [[(2, 1, r, 0), (1, 2, 0, r)] for r in range(2)]


# ------------------------------------------------------------- in this process, one device
lightning = pytest.importorskip("lightning.pytorch")


def single_device_trainer(directory: Path, max_steps: int):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from shardpoint.integrations.lightning import ShardpointCheckpointIO

    return lightning.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[ShardpointCheckpointIO()],
        max_steps=max_steps,
        callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )


def test_one_device_resumes_from_an_explicit_path(tmp_path):
    from tests.integration_lightning_worker import Tiny, data

    trainer = single_device_trainer(tmp_path, 2)
    trained = Tiny()
    trainer.fit(trained, train_dataloaders=data())
    path = tmp_path / "epoch=0-step=2.ckpt"
    assert marker(path)["iteration"] == 2

    resumed = single_device_trainer(tmp_path, 2)
    model = Tiny(lr=0.5)  # hyperparameters, weights and optimizer all come from the checkpoint
    resumed.fit(model, train_dataloaders=data(), ckpt_path=path)
    assert resumed.global_step == 2
    assert_same(model.state_dict(), trained.state_dict(), "weights")
    assert_same(resumed.optimizers[0].state_dict(), trainer.optimizers[0].state_dict(), "optimizer")


def test_load_from_checkpoint_reads_weights_and_hyperparameters(tmp_path):
    from shardpoint.errors import CheckpointNotFoundError
    from shardpoint.integrations.lightning import load_checkpoint_dict
    from tests.integration_lightning_worker import Tiny, data

    trained = Tiny(lr=0.02)
    single_device_trainer(tmp_path, 2).fit(trained, train_dataloaders=data())
    model = Tiny.load_from_checkpoint(tmp_path / "last.ckpt")
    assert model.hparams.lr == 0.02  # from the checkpoint, not Tiny's default 0.05
    assert_same(model.state_dict(), trained.state_dict(), "weights")
    checkpoint = load_checkpoint_dict(tmp_path / "last.ckpt", map_location="cpu")
    assert checkpoint["global_step"] == 2 and checkpoint["hyper_parameters"]["lr"] == 0.02
    with pytest.raises(CheckpointNotFoundError, match="no committed shardpoint checkpoint"):
        load_checkpoint_dict(tmp_path / "nothing.ckpt")


def test_a_missing_ckpt_path_is_file_not_found_as_lightning_raises_it(tmp_path):
    from tests.integration_lightning_worker import Tiny, data

    missing = tmp_path / "run" / "epoch=9-step=99.ckpt"
    with pytest.raises(FileNotFoundError, match=r"Checkpoint file not found: .*epoch=9-step=99\.ckpt"):
        single_device_trainer(tmp_path / "out", 2).fit(Tiny(), train_dataloaders=data(), ckpt_path=missing)
    assert not (tmp_path / "run").exists()  # nothing created where the user pointed


def test_a_save_outside_fit_lets_go_of_the_directory(tmp_path):
    from tests.integration_lightning_worker import Tiny, data

    first = single_device_trainer(tmp_path, 2)
    first.fit(Tiny(), train_dataloaders=data())
    first.save_checkpoint(tmp_path / "manual.ckpt")  # outside fit: nothing else would release its lock
    assert marker(tmp_path / "manual.ckpt")["iteration"] == 2
    second = single_device_trainer(tmp_path, 4)  # the same directory, the same process
    second.fit(Tiny(), train_dataloaders=data())
    assert marker(tmp_path / "last-v1.ckpt")["iteration"] == 4  # Lightning versions the name it found taken


def test_any_fsspec_url_lightning_takes_is_served(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from shardpoint.integrations.lightning import ShardpointCheckpointIO
    from tests.integration_lightning_worker import Tiny, data

    def memory_trainer(dirpath: str, max_steps: int):
        return lightning.Trainer(
            accelerator="cpu",
            devices=1,
            plugins=[ShardpointCheckpointIO()],
            max_steps=max_steps,
            callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True)],
            default_root_dir=tmp_path,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )

    root = f"memory://{tmp_path.name}/ckpt"  # Lightning's own tests use memory://
    trained = Tiny()
    memory_trainer(root, 2).fit(trained, train_dataloaders=data())
    fs = fsspec.filesystem("memory")
    assert fs.exists(f"{root}/last.ckpt/shardpoint.json") and fs.exists(f"{root}/.last.ckpt.latest")
    model = Tiny(lr=0.5)
    resumed = memory_trainer(root, 2)
    resumed.fit(model, train_dataloaders=data(), ckpt_path=f"{root}/last.ckpt")
    assert resumed.global_step == 2
    assert_same(model.state_dict(), trained.state_dict(), "weights")
    assert_same(Tiny.load_from_checkpoint(f"{root}/last.ckpt").state_dict(), trained.state_dict(), "inference")
    fs.rm(f"/{tmp_path.name}", recursive=True)


def test_a_project_switches_by_resuming_from_lightnings_own_ckpt_file(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.integration_lightning_worker import Tiny, data

    stock = lightning.Trainer(  # Lightning's default CheckpointIO: a .ckpt file
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "stock", every_n_train_steps=2)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trained = Tiny()
    stock.fit(trained, train_dataloaders=data())
    ckpt_file = tmp_path / "stock" / "epoch=0-step=2.ckpt"
    assert ckpt_file.is_file()

    switched = single_device_trainer(tmp_path / "sp", 2)
    model = Tiny(lr=0.5)
    switched.fit(model, train_dataloaders=data(), ckpt_path=ckpt_file)
    assert switched.global_step == 2  # resumed at the stock checkpoint's step: nothing left to train
    assert_same(model.state_dict(), trained.state_dict(), "weights")
    assert_same(switched.optimizers[0].state_dict(), stock.optimizers[0].state_dict(), "optimizer")
    assert model.hparams.lr == 0.5  # as Lightning: fit(ckpt_path=) keeps the model's own hyperparameters
    switched.save_checkpoint(tmp_path / "sp" / "after.ckpt")  # later saves are shardpoint's
    assert marker(tmp_path / "sp" / "after.ckpt")["iteration"] == 2


def test_objects_outside_the_tensors_are_refused_before_anything_is_written(tmp_path):
    import shardpoint as sp
    from tests.integration_lightning_worker import Tiny, data

    class WithNamespace(Tiny):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["cfg"] = argparse.Namespace(depth=2)  # torch.load(weights_only=True) cannot read this

    with pytest.raises(sp.CheckpointError, match=r"checkpoint\['cfg'\] is a argparse.Namespace"):
        single_device_trainer(tmp_path, 2).fit(WithNamespace(), train_dataloaders=data())
    assert not [p for p in tmp_path.iterdir() if p.name not in (".shardpoint.lock",)]


def test_a_dict_refused_on_one_rank_only_fails_every_rank_at_once(tmp_path):
    result = run_worker("ddp-one-rank-refuses", tmp_path)
    own, peer = result["errors"][1], result["errors"][0]
    assert own.startswith("CheckpointError") and "on rank 1" in own and "argparse.Namespace" in own, own
    assert peer.startswith("CheckpointError") and "rank 1" in peer, peer  # not left in the collective save
    assert result["seconds"] < 120  # far below the control group's timeout, which a hang would reach
    assert not [p for p in (tmp_path / "R" / "ckpt").glob("*") if not p.name.startswith(".")]


def test_what_lightning_decides_and_what_the_plugin_cannot_serve_are_refused(tmp_path):
    from shardpoint.integrations.lightning import ShardpointCheckpointIO

    with pytest.raises(ValueError, match="save_top_k"):
        ShardpointCheckpointIO(keep_last=3)
    with pytest.raises(ValueError, match="does not support FSDPStrategy"):  # Trainer() refuses it on CPU itself
        ShardpointCheckpointIO().connect(lightning.strategies.FSDPStrategy())
    foreign = tmp_path / "epoch=0-step=2.ckpt"
    foreign.write_bytes(b"a checkpoint Lightning wrote itself")
    ShardpointCheckpointIO().remove_checkpoint(foreign)  # not shardpoint's: left alone
    assert foreign.exists()


def test_import_shardpoint_needs_no_lightning():
    code = "import shardpoint, shardpoint.integrations, sys; assert 'lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
