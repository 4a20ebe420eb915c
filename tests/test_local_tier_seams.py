"""The local tier where it meets other features (issue 54): stored-once frozen bytes, explicit loads.

Real gloo processes; each rank's "node" is its own directory, as in tests/test_local_tier.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import shardpoint as sp
from shardpoint.tier.marker import held_copies, run_dir_name
from tests import toy
from tests.distributed import launch
from tests.test_dedup import frozen_state, step


def _checkpointer(base: str, rank: int, topo: sp.Topology) -> sp.Checkpointer:
    return sp.Checkpointer(
        f"{base}/persistent",
        topology=topo,
        save_interval=100,  # nothing persistent: only the local tier can resume
        local_dir=f"{base}/node{rank}",
        local_interval=2,
        local_keep=2,
        local_replicas=1,
    )


def _frozen_job(rank: int, world: int, base: str, steps: int, wipe: bool) -> dict:
    """Load what there is (after wiping this rank's node when ``wipe`` and rank 1), train to ``steps``."""
    topo = sp.Topology(2, 1, 1)
    if wipe and rank == 1:
        shutil.rmtree(f"{base}/node1")  # node 1 was replaced: its local disk is empty
    state = frozen_state(topo)
    ckpt = _checkpointer(base, rank, topo)
    result = ckpt.load(state)
    loaded = None if result is None else (result.iteration, result.tier, toy.snapshot(state))
    snaps = {}
    for it in range((result.iteration if result else 0) + 1, steps + 1):
        step(state, it)
        ckpt.maybe_save(it, state)
        ckpt.wait()
        snaps[it] = toy.snapshot(state)
    held = sorted((c.iteration, c.owner) for c in held_copies(ckpt.local_tier.storage, ckpt.local_tier.root))
    ckpt.close()
    return {"loaded": loaded, "snaps": snaps, "held": held}


def _same(a: dict, b: dict) -> None:
    assert a["tensors"].keys() == b["tensors"].keys()
    for key, (_, _, tensor) in a["tensors"].items():
        assert torch.equal(tensor, b["tensors"][key][2]), key
    assert a["lr"] == b["lr"] and a["sched"] == b["sched"]


def test_a_lost_node_resumes_its_frozen_base_from_the_replica(tmp_path):
    """Issue 54 defect 2: a replica holds every file its marker lists (frozen.pt too), so a wiped node resumes."""
    base = str(tmp_path)
    first = launch(_frozen_job, 2, base, 4, False)
    assert first[0]["held"] == [(2, 0), (2, 1), (4, 0), (4, 1)]
    replica = Path(base) / "node0" / run_dir_name(f"{base}/persistent") / "local_0000004" / "rank_00001"
    assert sorted(p.name for p in replica.iterdir()) == ["frozen.pt", "shardpoint-local.json", "state.pt"]
    resumed = launch(_frozen_job, 2, base, 5, True)
    assert [r["loaded"][:2] for r in resumed] == [(4, "local"), (4, "peer")]
    for before, after in zip(first, resumed):
        _same(before["snaps"][4], after["loaded"][2])
    # the fetch gave node 1 its own copy of iteration 4 again, frozen.pt included
    fetched = Path(base) / "node1" / run_dir_name(f"{base}/persistent") / "local_0000004" / "rank_00001"
    assert (4, 1) in resumed[1]["held"] and (fetched / "frozen.pt").exists()


def test_an_explicit_older_iteration_load_deletes_no_newer_copy(tmp_path):
    """Issue 54 (unconfirmed item, confirmed): a job loading ``iteration=N`` (an evaluation sharing local_dir)
    used to delete every local copy newer than N, from the local tier or from the persistent store;
    it now reads only, and the training job still resumes from its newest local copy."""
    topo = sp.Topology(1, 1, 1)

    def checkpointer() -> sp.Checkpointer:
        return sp.Checkpointer(
            str(tmp_path / "p"),
            topology=topo,
            save_interval=4,
            local_dir=str(tmp_path / "l"),
            local_interval=1,
            local_keep=3,
        )

    state, train = toy.build(topo), checkpointer()
    snaps = {}
    for it in range(1, 7):
        toy.train_step(state, it)
        train.maybe_save(it, state)  # persistent at 4, local at 1, 2, 3, 5, 6 (3 kept)
        train.wait()
        snaps[it] = toy.snapshot(state)
    held = sorted(c.iteration for c in held_copies(train.local_tier.storage, train.local_tier.root))
    assert held == [3, 5, 6]
    for it, tier in ((3, "local"), (4, "persistent")):  # an evaluation of an older checkpoint, then close
        fresh, evaluation = toy.build(topo), checkpointer()
        result = evaluation.load(fresh, iteration=it)
        evaluation.close()
        assert (result.iteration, result.tier) == (it, tier)
        _same(snaps[it], toy.snapshot(fresh))
        assert sorted(c.iteration for c in held_copies(train.local_tier.storage, train.local_tier.root)) == held
    fresh = toy.build(topo)
    result = train.load(fresh)
    train.close()
    assert (result.iteration, result.tier) == (6, "local")
    _same(snaps[6], toy.snapshot(fresh))
