"""A save killed (SIGKILL) at any point never moves the tracker; the next run resumes from the last commit."""

from __future__ import annotations

import os

import pytest
import torch

import shardpoint as sp
from tests import toy
from tests.distributed import launch


def _save_then_die(rank: int, world: int, root: str, fmt: str, fault: str):
    topo = sp.Topology(2, 1, 2)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=True)
    ckpt = sp.Checkpointer(root, topology=topo, format=fmt)
    toy.train_step(state, 1)
    ckpt.save(1, state)
    torch.save(toy.snapshot(state), f"{root}/../committed_{rank}.pt")
    toy.train_step(state, 2)
    os.environ["SHARDPOINT_FAULT"] = fault
    ckpt.save(2, state)


def _resume(rank: int, world: int, root: str, fmt: str):
    topo = sp.Topology(2, 1, 2)
    state = toy.build(topo, zero=True)
    ckpt = sp.Checkpointer(root, topology=topo, format=fmt)
    result = ckpt.load(state)
    loaded = toy.snapshot(state)
    ckpt.save(3, state)
    return {"iteration": result.iteration, "snapshot": loaded, "entries": sorted(os.listdir(root))}


def assert_resumed_from_committed(tmp_path, resumed) -> None:
    """Every rank's loaded tensors equal what it had when the last committed save was taken."""
    for r, result in enumerate(resumed):
        committed = torch.load(tmp_path / f"committed_{r}.pt", weights_only=False)
        for key, (_, _, tensor) in committed["tensors"].items():
            assert torch.equal(result["snapshot"]["tensors"][key][2], tensor), key


POINTS = [
    ("before-data", 1),
    ("mid-data", 1),
    ("after-data", 3),
    ("before-marker", 0),
    ("before-tracker", 0),
]


@pytest.mark.parametrize("fmt", ["dist", "torch"])
@pytest.mark.parametrize("point,rank", POINTS)
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, fmt, point, rank):
    root = tmp_path / "run"
    codes = launch(_save_then_die, 4, str(root), fmt, f"point={point},rank={rank},action=kill", expect_failure=True)
    assert codes[rank] == -9, codes  # the chosen rank really died by SIGKILL
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    if point == "before-tracker":
        assert (root / "iter_0000002" / "shardpoint.json").exists()  # committed, but not yet latest
    else:
        assert not (root / "iter_0000002").exists()

    resumed = launch(_resume, 4, str(root), fmt)
    assert {r["iteration"] for r in resumed} == {1}
    assert_resumed_from_committed(tmp_path, resumed)
    # the next save cleaned the partial directory and committed normally
    assert not any(n.startswith(".shardpoint-tmp") for n in resumed[0]["entries"])
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"


def _save_then_die_in_retention(rank: int, world: int, root: str, fmt: str, point: str):
    topo = sp.Topology(2, 1, 2)
    state = toy.build(topo, zero=True)
    ckpt = sp.Checkpointer(root, topology=topo, format=fmt, keep_last=1)
    toy.train_step(state, 1)
    ckpt.save(1, state)
    toy.train_step(state, 2)
    torch.save(toy.snapshot(state), f"{root}/../committed_{rank}.pt")
    os.environ["SHARDPOINT_FAULT"] = f"point={point},rank=0,action=kill"
    ckpt.save(2, state)
    ckpt.wait()  # rank 0 dies here, in its background deletion


@pytest.mark.parametrize("point", ["during-retention", "mid-retention"])
@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_kill_during_retention_keeps_the_new_checkpoint(tmp_path, fmt, point):
    root = tmp_path / "run"
    codes = launch(_save_then_die_in_retention, 4, str(root), fmt, point, expect_failure=True)
    assert codes[0] == -9, codes
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"  # committed before retention ran
    if point == "mid-retention":  # iter 1 had stopped being a checkpoint before its files went
        assert not (root / "iter_0000001").exists()
    resumed = launch(_resume, 4, str(root), fmt)
    assert {r["iteration"] for r in resumed} == {2}
    assert_resumed_from_committed(tmp_path, resumed)
    assert not any(n.startswith(".shardpoint-tmp") for n in resumed[0]["entries"])


def test_retention_runs_in_the_background(tmp_path, monkeypatch):
    root = tmp_path / "run"
    state = toy.build(sp.Topology(1, 1, 1))
    ckpt = sp.Checkpointer(root, keep_last=1)
    ckpt.save(1, state)
    monkeypatch.setenv("SHARDPOINT_FAULT", "point=during-retention,rank=0,action=stall,seconds=3")
    ckpt.save(2, state)
    assert (root / "iter_0000001").exists()  # save() returned while the deletion was still stalled
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    ckpt.wait()
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000002"]
    ckpt.close()
