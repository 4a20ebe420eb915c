"""Async saves: training resumes after a memory copy; commit waits for every rank's writes."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import shardpoint as sp
from tests import toy
from tests.distributed import launch
from tests.test_checkpointer import assert_same, make_state, train


def _async_then_keep_training(rank: int, world: int, root: str):
    topo = sp.Topology(2, 1, 2)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=True)
    ckpt = sp.Checkpointer(f"{root}/async", topology=topo, async_save=True, save_interval=2)
    sync = sp.Checkpointer(f"{root}/sync", topology=topo)
    toy.train_step(state, 1)
    toy.train_step(state, 2)
    sync.save(2, state)
    at_save = toy.snapshot(state)
    assert ckpt.maybe_save(2, state)
    stall = ckpt.last_stall_seconds
    toy.train_step(state, 3)  # changes every tensor while the write may still be running
    ckpt.maybe_save(3, state)
    ckpt.close()  # commits the pending save
    return {"at_save": at_save, "stall": stall, "background": ckpt.last_background_seconds}


def _load(rank: int, world: int, root: str):
    topo = sp.Topology(2, 1, 2)
    state = toy.build(topo, zero=True)
    result = sp.Checkpointer(root, topology=topo).load(state)
    return {"snap": toy.snapshot(state), "iteration": result.iteration}


def test_async_save_holds_the_state_at_save_time(tmp_path):
    results = launch(_async_then_keep_training, 4, str(tmp_path))
    assert (tmp_path / "async" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert all(r["stall"] > 0 and r["background"] > 0 for r in results)
    from_async = launch(_load, 4, str(tmp_path / "async"))
    from_sync = launch(_load, 4, str(tmp_path / "sync"))
    expected = toy.assemble([r["at_save"] for r in results])
    got_async = toy.assemble([r["snap"] for r in from_async])
    got_sync = toy.assemble([r["snap"] for r in from_sync])
    for key in expected:
        assert torch.equal(got_async[key], expected[key]), key
        assert torch.equal(got_sync[key], got_async[key]), key


def _async_then_die(rank: int, world: int, root: str):
    topo = sp.Topology(2, 1, 2)
    state = toy.build(topo, zero=True)
    ckpt = sp.Checkpointer(root, topology=topo, async_save=True)
    ckpt.save(1, state)
    ckpt.wait()
    toy.train_step(state, 2)
    ckpt.save(2, state)
    os.kill(os.getpid(), signal.SIGKILL)  # the job dies with the save written but not committed


def test_crash_before_async_commit_keeps_previous(tmp_path):
    root = tmp_path / "run"
    codes = launch(_async_then_die, 4, str(root), expect_failure=True)
    assert codes == [-9] * 4
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not (root / "iter_0000002").exists()
    assert {r["iteration"] for r in launch(_load, 4, str(root))} == {1}


def test_background_failure_surfaces_at_next_call(tmp_path, monkeypatch):
    state = make_state()
    ckpt = sp.Checkpointer(tmp_path, async_save=True, save_interval=1)
    ckpt.save(1, state)
    ckpt.wait()
    monkeypatch.setenv("SHARDPOINT_FAULT", "point=mid-data,rank=0,action=raise,errno=EIO")
    ckpt.save(2, state)  # returns: the failure happens in the background
    with pytest.raises(sp.StorageError, match="injected fault at mid-data"):
        ckpt.wait()
    monkeypatch.delenv("SHARDPOINT_FAULT")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not any(p.name.startswith(".shardpoint-tmp") for p in tmp_path.iterdir())
    train(state)
    ckpt.save(3, state)
    ckpt.close()
    fresh = make_state(4)
    assert sp.Checkpointer(tmp_path).load(fresh).iteration == 3
    assert_same(state, fresh)


def test_buffers_are_reused_across_saves(tmp_path):
    state = make_state()
    train(state)
    ckpt = sp.Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, state)
    staging = ckpt._saver.staging
    first = (staging.allocations, staging.nbytes)
    train(state)
    ckpt.save(2, state)
    assert (staging.allocations, staging.nbytes) == first == (1, first[1]) and first[1] > 0
    ckpt.close()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_async_requires_dist_format(tmp_path):
    with pytest.raises(ValueError, match="format='dist'"):
        sp.Checkpointer(tmp_path, async_save=True, format="torch")


def _commit_waits_for_the_slow_rank(rank: int, world: int, root: str):
    os.environ["SHARDPOINT_FAULT"] = "point=mid-data,rank=1,action=stall,seconds=4"
    state = toy.build(sp.Topology(1, 1, world), zero=False)
    ckpt = sp.Checkpointer(root, async_save=True, save_interval=100)
    ckpt.save(1, state)
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    while rank == 0 and not ckpt._saver._pending.writer.done():
        time.sleep(0.05)
    ckpt.maybe_save(2, state)  # rank 0's write is done, rank 1's is not: nothing may be committed
    before = os.path.exists(tracker)
    ckpt.close()  # waits for rank 1, then commits
    with open(tracker) as f:
        return {"committed_early": before, "after": f.read()}


def test_async_commit_waits_for_every_rank(tmp_path):
    results = launch(_commit_waits_for_the_slow_rank, 2, str(tmp_path / "run"))
    assert [r["committed_early"] for r in results] == [False, False]
    assert [r["after"] for r in results] == ["1", "1"]
