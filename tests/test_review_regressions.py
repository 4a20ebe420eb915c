"""Regressions for bugs a review found: each test fails on the code before its fix."""

from __future__ import annotations

import json
import os
import struct
import time

import pytest
import torch

import shardpoint as sp
from shardpoint.demo.optim import DistributedAdamW
from tests.distributed import launch
from tests.test_checkpointer import assert_same, make_state, train


class Column(torch.nn.Module):
    def __init__(self, topo: sp.Topology, value: float):
        super().__init__()
        self.topo = topo
        self.w = torch.nn.Parameter(torch.full((2, 4), value))

    def sharded_state_dict(self):
        return {"w": sp.column_parallel(self.w, self.topo)}


def _torch_format(rank: int, world: int, root: str, phase: str):
    topo = sp.Topology(2, 1, 1)
    model = Column(topo, 1.2345 if phase == "save" else 0.0)
    state = sp.TrainState(model, DistributedAdamW(model.parameters()))
    ckpt = sp.Checkpointer(root, topology=topo, format="torch")
    if phase == "save":
        ckpt.save(1, state)
        return None
    try:
        ckpt.load(state)
    except sp.CheckpointError as exc:  # the rank that found it raises CorruptCheckpointError, the others agree
        return str(exc)
    return f"loaded {model.w.detach()[0].tolist()}"


def test_every_torch_format_file_is_verified_on_load(tmp_path):
    """Each rank's own file list differs in the torch format; checks once skipped some files."""
    root = tmp_path / "run"
    launch(_torch_format, 2, str(root), "save")
    victim = root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(victim.read_bytes())
    data[data.find(struct.pack("<f", 1.2345)) + 3] ^= 0x01
    victim.write_bytes(bytes(data))
    outcomes = launch(_torch_format, 2, str(root), "load")
    assert all("mp_rank_00/model_optim_rng.pt" in o and "checksum mismatch" in o for o in outcomes), outcomes


class Stage(torch.nn.Module):
    def __init__(self, pp_rank: int, cols: int):
        super().__init__()
        self.pp_rank = pp_rank
        self.w = torch.nn.Parameter(torch.ones(4, cols))

    def sharded_state_dict(self):
        return {f"layers.{self.pp_rank}.w": self.w}


def _mismatch_on_one_stage(rank: int, world: int, root: str, fmt: str):
    topo = sp.Topology(1, 2, 1)
    sp.Checkpointer(root, topology=topo, format=fmt).save(1, sp.TrainState(Stage(rank, 4)))
    start = time.monotonic()
    try:
        sp.Checkpointer(root, topology=topo).load(sp.TrainState(Stage(rank, 8 if rank == 1 else 4)))
    except sp.CheckpointError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "loaded", "", time.monotonic() - start


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_a_shape_error_on_one_stage_reaches_every_rank(tmp_path, fmt):
    """Once, the rank with the mismatch raised alone and the others waited in a collective."""
    results = launch(_mismatch_on_one_stage, 2, str(tmp_path / "run"), fmt, timeout=60)
    assert results[1][0] == "ShapeMismatchError" and "layers.1.w" in results[1][1]  # a size difference, not damage
    # every rank raises the same kind of error, naming the rank it came from
    assert results[0][0] == "ShapeMismatchError" and "rank(s) [1]" in results[0][1]
    assert all(seconds < 15 for _, _, seconds in results)


def test_a_nan_metric_does_not_cost_the_save(tmp_path):
    ckpt = sp.Checkpointer(tmp_path, keep_best=(1, "val_loss", "min"))
    ckpt.save(1, make_state(), metrics={"val_loss": float("nan"), "tokens": 10.0})
    marker = json.loads((tmp_path / "iter_0000001" / "shardpoint.json").read_text())
    assert marker["metrics"] == {"tokens": 10.0}
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(3, 3)
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.used(x)


def test_parameters_without_optimizer_state_resume_exactly(tmp_path):
    torch.manual_seed(0)
    model = WithUnused()
    state = sp.TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    model(torch.randn(2, 3)).sum().backward()
    state.optimizer.step()
    sp.Checkpointer(tmp_path).save(1, state)
    fresh_model = WithUnused()
    fresh = sp.TrainState(fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=0.1))
    sp.Checkpointer(tmp_path).load(fresh)  # strict: the unused layer's absent state is not an error
    assert fresh_model.unused.weight not in fresh.optimizer.state
    assert_same(state, fresh)


def test_a_save_that_died_mid_replacement_gets_the_old_checkpoint_back(tmp_path):
    state = make_state()
    sp.Checkpointer(tmp_path).save(1, state)
    # what a kill between "move the old iter_0000001 aside" and "move the new one in" leaves
    os.replace(tmp_path / "iter_0000001", tmp_path / f".shardpoint-trash-iter_0000001-{os.getpid()}")
    fresh = make_state(3)
    assert sp.Checkpointer(tmp_path).load(fresh).iteration == 1
    assert_same(state, fresh)


def test_local_first_resave_replaces_remote_objects(s3_server, bucket, tmp_path):
    """A rollback that saves an iteration again must not keep the old objects under the new marker."""
    remote = f"{bucket}/mirror"
    state = make_state()
    with sp.Checkpointer(tmp_path / "a", upload_to=remote) as ckpt:
        ckpt.save(2, state)
    train(state)
    with sp.Checkpointer(tmp_path / "b", upload_to=remote) as ckpt:
        ckpt.save(2, state)
    fresh = make_state(7)
    assert sp.Checkpointer(remote).load(fresh).iteration == 2  # checksums hold: no stale object
    assert_same(state, fresh)


def test_the_mirror_of_a_replayed_save_has_its_metadata(s3_server, bucket, tmp_path):
    """Rank 0 writes ``.metadata`` in the commit (format.finish), after its own files: it is uploaded too."""
    remote = f"{bucket}/replayed"
    state = make_state()
    with sp.Checkpointer(tmp_path / "local", upload_to=remote, keep_last=0) as ckpt:
        for iteration in (1, 2):  # the second save replays the first one's plan
            train(state)
            ckpt.save(iteration, state)
    fresh = make_state(7)
    assert sp.Checkpointer(remote).load(fresh, iteration=2).iteration == 2
    assert_same(state, fresh)
