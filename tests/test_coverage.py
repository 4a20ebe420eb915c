"""A save whose declared boxes leave a hole or overlap is refused on every rank, in every format, for free.

The two cases of issue 37 at 2 ranks, for one ``[8, 4]`` weight: both ranks declaring the
first half (Megatron-LM#1836: every etp rank declaring the first 1/etp), and boxes
``[0:5]`` and ``[3:8]``. The check rides on the save's start round: the collective
counts of a planned save are those measured before the check existed.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import shardpoint as sp
from shardpoint.commands.scale import count_collectives
from shardpoint.state.coverage import check_tiling
from tests import toy
from tests.distributed import launch

# collective calls of the first (planned) save of toy.build at tp=2 on 2 ranks, measured before the
# coverage check existed (commit 4a8ba2b): the check adds none
FIRST_SAVE_CALLS = {"dist": 8, "torch": 6}  # dist: no DCP planning rounds (21 with dcp.save)


class _Declared(torch.nn.Module):
    """One ``[8, 4]`` weight of which each rank declares the rows ``rows[rank]``, plus a good sharded bias."""

    def __init__(self, rank: int, rows: list[tuple[int, int]]):
        super().__init__()
        start, stop = rows[rank]
        self.w = torch.nn.Parameter(torch.arange(32.0).reshape(8, 4)[start:stop].clone())
        self.b = torch.nn.Parameter(torch.arange(8.0)[4 * rank : 4 * rank + 4].clone())
        self.start = start
        self.rank = rank

    def sharded_state_dict(self) -> dict:
        return {"w": sp.Shard(self.w, (8, 4), (self.start, 0)), "b": sp.Shard(self.b, (8,), (4 * self.rank,))}


def _refused(rank: int, world: int, root: str, fmt: str, rows: list[tuple[int, int]]):
    topo = sp.Topology(1, 1, world)
    ckpt = sp.Checkpointer(root, topology=topo, format=fmt)
    good = _Declared(rank, [(0, 4), (4, 8)])
    ckpt.save(1, sp.TrainState(good))  # a correct save first: the refused one must leave it as it is
    bad = _Declared(rank, rows)
    opt = torch.optim.AdamW(bad.parameters())
    bad.w.grad, bad.b.grad = torch.ones_like(bad.w), torch.ones_like(bad.b)
    opt.step()
    try:
        ckpt.save(2, sp.TrainState(bad, opt))
    except sp.ShardingError as exc:
        error = (type(exc).__name__, str(exc))
    else:
        error = None
    ckpt.close()
    entries = sorted(e for e in os.listdir(root) if e != ".shardpoint.lock")  # temporary directories included
    with open(f"{root}/latest_checkpointed_iteration.txt") as tracker:
        return {"error": error, "entries": entries, "tracker": tracker.read()}


@pytest.mark.parametrize("fmt", ["dist", "torch"])
@pytest.mark.parametrize(
    "rows,region,says",
    [
        ([(0, 4), (0, 4)], "[4:8, 0:4]", "no rank declares [4:8, 0:4] of [8, 4]"),  # the hole of Megatron-LM#1836
        ([(0, 5), (3, 8)], "[3:5, 0:4]", "[3:5, 0:4] is declared twice: by rank(s) 0 as [0:5, 0:4] and by rank(s) 1"),
    ],
    ids=["hole", "overlap"],
)
def test_a_hole_or_an_overlap_is_refused_on_every_rank_and_nothing_is_committed(tmp_path, fmt, rows, region, says):
    results = launch(_refused, 2, str(tmp_path), fmt, rows)
    for rank, r in enumerate(results):
        assert r["error"] is not None, (rank, "the save was not refused")
        name, message = r["error"]
        assert name == "ShardingError"
        assert "'model.w'" in message and region in message and says in message, message
        assert "'model.b'" not in message  # the good tensor is not blamed
        # the optimizer state follows its parameter's boxes: refused as well, under its own key
        assert "'optimizer.state.w.exp_avg'" in message, message
        assert r["entries"] == ["iter_0000001", "latest_checkpointed_iteration.txt"], r["entries"]
        assert r["tracker"].strip() == "1"


def _first_save_calls(rank: int, world: int, root: str, fmt: str) -> int:
    calls = count_collectives()
    topo = sp.Topology(world, 1, 1)
    state = toy.build(topo)
    toy.train_step(state, 1)
    ckpt = sp.Checkpointer(root, topology=topo, format=fmt, keep_last=0)
    before = sum(calls.values())
    ckpt.save(1, state)
    after = sum(calls.values())
    ckpt.close()
    return after - before


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_the_check_adds_no_collective_to_a_planned_save(tmp_path, fmt):
    counts = launch(_first_save_calls, 2, str(tmp_path), fmt)
    assert counts == [FIRST_SAVE_CALLS[fmt]] * 2, counts


def test_tiling_rules_and_cost():
    w = ((8, 4), 0)
    # replicas of a canonical box (identical boxes; or another replica id) and empty pieces are allowed
    check_tiling(
        [
            ("k", (0, 0), (4, 4), (8, 4), 0, 0),
            ("k", (0, 0), (4, 4), (8, 4), 0, 1),
            ("k", (0, 0), (4, 4), (8, 4), 3, 2),
            ("k", (4, 0), (4, 4), (8, 4), 0, 3),
            ("k", (0, 0), (0, 4), (8, 4), 0, 4),
        ]
    )
    with pytest.raises(sp.ShardingError, match=r"global shape: ranks 0 declare \[8, 4\]; ranks 1 declare \[8, 5\]"):
        check_tiling([("k", (0, 0), (4, 4), (8, 4), 0, 0), ("k", (4, 0), (4, 4), (8, 5), 0, 1)])
    with pytest.raises(
        sp.ShardingError, match=r"held only as replicas \(replica_id != 0\) by rank\(s\) 1 \[4:8, 0:4\]"
    ):
        check_tiling([("k", (0, 0), (4, 4), *w, 0), ("k", (4, 0), (4, 4), (8, 4), 1, 1)])
    with pytest.raises(sp.ShardingError, match=r"copy no canonical box: rank\(s\) 2 \[0:2, 0:4\]"):
        check_tiling([("k", (0, 0), (4, 4), *w, 0), ("k", (4, 0), (4, 4), *w, 1), ("k", (0, 0), (2, 4), (8, 4), 1, 2)])
    # a 2-D grid hole is found in its corner
    grid = [("g", (r * 2, c * 2), (2, 2), (8, 8), 0, r * 4 + c) for r in range(4) for c in range(4) if (r, c) != (2, 3)]
    with pytest.raises(sp.ShardingError, match=r"no rank declares \[4:6, 6:8\]"):
        check_tiling(grid)
    # a tiling that is no grid (a brick wall) is checked by the sweep; one brick moved overlaps its neighbour
    wall = [("w", (r, c * 4 + 2 * (r % 2)), (1, 4), (4, 20), 0, 0) for r in range(4) for c in range(4)]
    wall += [("w", (r, 0), (1, 2), (4, 20), 0, 1) for r in (1, 3)] + [
        ("w", (r, 16), (1, 4), (4, 20), 0, 1) for r in (0, 2)
    ]
    wall += [("w", (r, 18), (1, 2), (4, 20), 0, 1) for r in (1, 3)]
    check_tiling(wall)
    with pytest.raises(sp.ShardingError, match=r"\[1:2, 5:6\] is declared twice"):
        check_tiling([*wall[:-1], ("w", (1, 5), (1, 2), (4, 20), 0, 2)])
    # cheap at scale: 4096 row-parallel pieces of one tensor and a 64 x 64 grid
    rows = [("r", (0, i * 2), (16, 2), (16, 8192), 0, i) for i in range(4096)]
    cells = [("c", (r, c), (1, 1), (64, 64), 0, r * 64 + c) for r in range(64) for c in range(64)]
    start = time.perf_counter()
    check_tiling(rows + cells)
    assert time.perf_counter() - start < 0.5
