"""A rank stopped (SIGSTOP) in the middle of a save, a load or a local-tier copy is named by the others.

Every collective round has a deadline (``Checkpointer(round_timeout=...)``): the ranks
that arrived raise ``CheckpointTimeoutError`` naming the rank that did not, instead of
waiting for the control group's 2-hour timeout. Rank 0 then kills the stopped rank (as a
job's launcher would) and a restarted job loads the previous checkpoint exactly.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import shardpoint as sp
from tests import toy
from tests.distributed import launch
from tests.test_crash_safety import _resume, assert_resumed_from_committed

DEADLINE = 4.0
STOPPED = 2


def _outcome(rank: int, root: str, pids: list[int], action) -> None:
    """Run ``action``; record what it raised and how long it took; rank 0 then kills the stopped rank."""
    begin = time.monotonic()
    try:
        action()
        record = {"error": None}
    except sp.CheckpointTimeoutError as exc:
        record = {"error": "CheckpointTimeoutError", "message": str(exc), "missing": exc.missing}
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        record = {"error": type(exc).__name__, "message": str(exc)}
    record["seconds"] = time.monotonic() - begin
    with open(f"{root}/../outcome_{rank}.json", "w") as f:
        json.dump(record, f)
    if rank == 0:  # rank 0 hosts the c10d store here (torchrun's agent would): it leaves last
        others = [r for r in range(len(pids)) if r not in (0, STOPPED)]
        limit = time.monotonic() + 30
        while time.monotonic() < limit and not all(os.path.exists(f"{root}/../outcome_{r}.json") for r in others):
            time.sleep(0.1)
        os.kill(pids[STOPPED], signal.SIGKILL)
    os._exit(0)  # the control group is broken: leave without the harness's barrier


def _pids() -> list[int]:
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return pids


def _committed_once(rank: int, root: str, fmt: str):
    """A 4-rank job that committed iteration 1 (its state kept for the resume check): topology, state, pids, ckpt."""
    topo = sp.Topology(2, 1, 2)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=True)
    pids = _pids()
    ckpt = sp.Checkpointer(root, topology=topo, format=fmt, round_timeout=DEADLINE)
    toy.train_step(state, 1)
    ckpt.save(1, state)
    torch.save(toy.snapshot(state), f"{root}/../committed_{rank}.pt")
    return topo, state, pids, ckpt


def _save_then_stop(rank: int, world: int, root: str, fmt: str, point: str):
    _, state, pids, ckpt = _committed_once(rank, root, fmt)
    toy.train_step(state, 2)
    os.environ["SHARDPOINT_FAULT"] = f"point={point},rank={STOPPED},action=stop"
    _outcome(rank, root, pids, lambda: ckpt.save(2, state))


def _assert_named(tmp_path, world: int = 4) -> None:
    for rank in range(world):
        if rank == STOPPED:
            assert not (tmp_path / f"outcome_{rank}.json").exists()
            continue
        record = json.loads((tmp_path / f"outcome_{rank}.json").read_text())
        assert record["error"] == "CheckpointTimeoutError", record
        assert record["missing"] == [STOPPED], record
        assert f"rank(s) [{STOPPED}] did not arrive" in record["message"], record
        assert record["seconds"] < DEADLINE + 10, record


@pytest.mark.parametrize("fmt, point", [("dist", "mid-data"), ("torch", "before-data")])
def test_a_rank_stopped_mid_save_is_named_and_the_previous_checkpoint_loads(tmp_path, fmt, point):
    root = tmp_path / "run"
    codes = launch(_save_then_stop, 4, str(root), fmt, point, expect_failure=True, timeout=60)
    assert codes[STOPPED] == -9, codes
    _assert_named(tmp_path)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not (root / "iter_0000002").exists()
    resumed = launch(_resume, 4, str(root), fmt)
    assert {r["iteration"] for r in resumed} == {1}
    assert_resumed_from_committed(tmp_path, resumed)
    assert not any(n.startswith(".shardpoint-tmp") for n in resumed[0]["entries"])


def _load_then_stop(rank: int, world: int, root: str, fmt: str):
    topo, _, pids, ckpt = _committed_once(rank, root, fmt)
    fresh = toy.build(topo, zero=True)
    os.environ["SHARDPOINT_FAULT"] = f"point=mid-load,rank={STOPPED},action=stop"
    _outcome(rank, root, pids, lambda: ckpt.load(fresh))


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_a_rank_stopped_mid_load_is_named_and_a_restart_loads_exactly(tmp_path, fmt):
    root = tmp_path / "run"
    codes = launch(_load_then_stop, 4, str(root), fmt, expect_failure=True, timeout=60)
    assert codes[STOPPED] == -9, codes
    _assert_named(tmp_path)
    resumed = launch(_resume, 4, str(root), fmt)
    assert {r["iteration"] for r in resumed} == {1}
    assert_resumed_from_committed(tmp_path, resumed)


def _tier_copy_then_stop(rank: int, world: int, base: str):
    topo = sp.Topology(2, 1, 2)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=True)
    pids = _pids()
    ckpt = sp.Checkpointer(
        f"{base}/run",
        topology=topo,
        save_interval=100,
        local_dir=f"{base}/node{rank // 2}",
        local_interval=2,
        local_replicas=1,
        round_timeout=DEADLINE,
    )
    toy.train_step(state, 1)
    ckpt.save(1, state)
    torch.save(toy.snapshot(state), f"{base}/committed_{rank}.pt")
    toy.train_step(state, 2)
    os.environ["SHARDPOINT_FAULT"] = f"point=local-after-data,rank={STOPPED},action=stop"

    def local_save_and_replicate():
        ckpt.maybe_save(2, state)
        ckpt.wait()

    _outcome(rank, f"{base}/run", pids, local_save_and_replicate)


def test_a_rank_stopped_mid_local_tier_copy_is_named_and_a_restart_loads_exactly(tmp_path):
    codes = launch(_tier_copy_then_stop, 4, str(tmp_path), expect_failure=True, timeout=60)
    assert codes[STOPPED] == -9, codes
    _assert_named(tmp_path)
    resumed = launch(_resume, 4, str(tmp_path / "run"), "dist")
    assert {r["iteration"] for r in resumed} == {1}
    assert_resumed_from_committed(tmp_path, resumed)
