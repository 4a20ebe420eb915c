"""The first save's check split by key across ranks answers as one survey of the whole job would.

Every planner runs here in one process on what each rank would send it; real ranks
run it in every multi-rank save (``tests/test_coverage.py``, ``tests/test_dedup.py``,
``tests/test_planless_save.py`` weighs what each rank receives).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from shardpoint.state import box_table, split_survey
from shardpoint.state.sharding import Shard


def _split(ranks: list[list[tuple[str, Shard]]], always=lambda key: False):
    """Each rank's joined answer, every planner run here."""
    world = len(ranks)
    asked = []
    for boxes in ranks:
        keys, shards = [k for k, _ in boxes], [s for _, s in boxes]
        asked.append(split_survey.requests(keys, shards, [always(k) for k in keys], (), 0, world))
    answers = [split_survey.survey_keys([sent[p] for sent, _ in asked], p) for p in range(world)]
    return [split_survey.join([answers[p][r] for p in range(world)], asked[r][1]) for r in range(world)]


def _central(ranks: list[list[tuple[str, Shard]]], always=lambda key: False):
    described = [box_table.describe([k for k, _ in b], [s for _, s in b], [always(k) for k, _ in b]) for b in ranks]
    return box_table.survey(described)


def _layout(rng: random.Random, world: int, keys: int) -> list[list[tuple[str, Shard]]]:
    """Tensors split into 1 to ``world`` row blocks, each held by one or more ranks (replicas), one box a rank a key."""
    ranks: list[list[tuple[str, Shard]]] = [[] for _ in range(world)]
    for k in range(keys):
        blocks = rng.randint(1, world)
        free = rng.sample(range(world), world)
        cuts = sorted(rng.sample(range(1, world), blocks - 1)) if blocks > 1 else []
        for b, holders in enumerate(np.split(np.array(free), cuts)):
            for n, r in enumerate(sorted(holders.tolist())):
                ranks[r].append((f"model.t{k}", Shard(torch.zeros(2, 3), (2 * blocks, 3), (2 * b, 0), n)))
    return ranks


def test_the_split_finds_what_one_survey_finds():
    rng = random.Random(7)
    for _ in range(40):
        world = rng.randint(1, 6)
        ranks = _layout(rng, world, rng.randint(1, 12))
        split, central = _split(ranks), _central(ranks)
        for mine, theirs in zip(split, central):
            assert mine[0] is None and theirs[0] is None
            assert mine[1] == theirs[1]  # the job's deduplicated bytes
            assert sorted(mine[2]) == sorted(theirs[2]) and mine[5] == theirs[5]  # shared boxes, the flags
        # who writes a shared box may differ, but each is written by exactly one holder
        written: dict[tuple, int] = {}
        for r, (answer, boxes) in enumerate(zip(split, ranks)):
            for i in set(answer[2].tolist()) - set(answer[4].tolist()):
                key, shard = boxes[i]
                box = (key, shard.global_offset)
                assert box not in written, (box, written[box], r)
                written[box] = r


def test_a_bad_tiling_is_named_on_every_rank():
    holes = [
        [("model.a", Shard(torch.zeros(2, 3), (6, 3), (0, 0)))],
        [("model.a", Shard(torch.zeros(2, 3), (6, 3), (4, 0)))],
    ]
    answers = _split(holes)
    assert all(a[0] and "model.a" in a[0] for a in answers), answers


def test_replicas_of_one_key_per_planner_are_written_by_many_ranks():
    """64 data-parallel ranks, 64 one-box tensors: about one planner each. Every planner starts
    its split of the shared bytes elsewhere, so the writes spread over the ranks; from one
    starting point each would choose the same middle holder, rank 32, for all 64."""
    world = 64
    ranks = [[(f"model.w{k}", Shard(torch.zeros(4), (4,), (0,), r)) for k in range(world)] for r in range(world)]
    answers = _split(ranks)
    writes = np.zeros(world, np.int64)
    for r, answer in enumerate(answers):
        writes[r] = len(set(answer[2].tolist()) - set(answer[4].tolist()))
    assert writes.sum() == world  # each box written once
    assert writes.max() <= 6, writes.tolist()
