"""``bench --simulate-ranks``: the first save's tiling and replica check on rank 0, the way before and today's.

Before, each rank sent rank 0 a Python tuple per box (key, offset, shape, scope, its
bytes, whether it is a ``shared_if_equal`` value, its global shape and replica id) and
rank 0 walked all of them in Python (:func:`survey_before`, kept here as it was, for the
comparison): 10.3 s at 4,096 simulated ranks × 300 tensors. Today each rank sends its
boxes as columns (:class:`~shardpoint.state.box_table.RankBoxes`) and rank 0 decides
with array operations (:func:`~shardpoint.state.box_table.survey`).

Both are measured on the same simulated job: N ranks, each holding 300 ``Shard(0)``
parameters (``64 × 1024`` float32 rows of an ``[N·64, 1024]`` tensor). Rank 0's time
counts unpickling what it received (as its gather does) and the check; its peak extra
memory is what it received plus the growth of its resident memory while it unpickles
and checks (Linux's high-water mark); another rank's is its own message and its answer.
"""

from __future__ import annotations

import gc
import pickle
import time
from typing import Any

from shardpoint.commands.bench_timing import peak_memory, traced_peak
from shardpoint.errors import ShardingError
from shardpoint.state import box_table, coverage

__all__ = ["simulate_check", "survey_before"]

ROWS, COLUMNS = 64, 1024


def simulate_check(world: int, params: int = 300, before: bool = True) -> dict[str, Any]:
    """Rank 0's part of the first save's check at ``world`` simulated ranks: before (if asked) and today."""
    row: dict[str, Any] = {}
    if before:
        row.update(_measured("before", _messages_before(world, params), survey_before))
    row.update(_measured("rank 0", _messages_today(world, params), box_table.survey))
    row.update(_measured_split(world, params))
    return row


def _measured_split(world: int, params: int) -> dict[str, Any]:
    """Today's check, split by key (:mod:`~shardpoint.state.split_survey`): the slowest rank's part.

    One rank makes its messages to its planners; the busiest planner (the most keys,
    each held by every rank) surveys the boxes every rank sent it; the rank joins one
    answer per planner of its keys (that planner's answer standing in for each). Its peak
    is what the busiest planner allocates receiving (unpickling) every rank's message and
    surveying them (tracemalloc: the resident high-water mark missed small objects).
    """
    import numpy as np
    import torch

    from shardpoint.state import split_survey
    from shardpoint.state.sharding import Shard

    keys = [f"model.layers.{p}.weight" for p in range(params)]
    owner = split_survey.owners(keys, world)
    busiest = int(np.argmax(np.bincount(owner, minlength=world)))
    local = torch.empty(ROWS, COLUMNS)
    start = time.process_time()
    shards = [Shard(local, (world * ROWS, COLUMNS), (0, 0))] * params
    sent, picked = split_survey.requests(keys, shards, [False] * params, (), 0, world)
    asking = time.process_time() - start
    one = sent[busiest]
    assert one is not None
    columns = one.array().copy()
    messages = []
    for rank in range(world):  # each rank's boxes of the busiest planner's keys, at its own rows
        columns[len(box_table.FIELDS)] = rank * ROWS
        messages.append(pickle.dumps(one._replace(columns=columns.tobytes()), protocol=pickle.HIGHEST_PROTOCOL))
    gc.collect()
    start = time.process_time()
    received = [pickle.loads(m) for m in messages]  # made by this process
    answers = split_survey.survey_keys(received, busiest)
    planning = time.process_time() - start
    del received
    held = traced_peak(lambda: split_survey.survey_keys([pickle.loads(m) for m in messages], busiest))
    start = time.process_time()
    split_survey.join([answers[-1] if p in set(owner.tolist()) else None for p in range(world)], picked)
    joining = time.process_time() - start
    return {
        "check s (split)": planning + asking + joining,
        "busiest planner keys (split)": int((owner == busiest).sum()),
        "busiest rank peak MB (split)": held / 1e6,
    }


def _measured(label: str, messages: list[bytes], survey: Any) -> dict[str, Any]:
    """Rank 0 unpickles every rank's message and checks them all; the seconds and the memory of each part."""
    gc.collect()
    with peak_memory() as memory:
        start = time.process_time()
        gathered = [pickle.loads(m) for m in messages]  # made by this process
        received = time.process_time() - start
        start = time.process_time()
        parts = survey(gathered)
        checked = time.process_time() - start
    peak = memory.extra
    other = len(messages[-1]) + len(pickle.dumps(parts[-1]))
    sent = sum(map(len, messages))
    del gathered, parts
    return {
        f"check s ({label})": checked,
        f"unpickling s ({label})": received,
        f"gathered MB ({label})": sent / 1e6,
        f"rank-0 peak MB ({label})": (sent + peak) / 1e6,
        f"other rank KB ({label})": other / 1e3,
    }


def _messages_today(world: int, params: int) -> list[bytes]:
    """What each simulated rank sends today: its :class:`~shardpoint.state.box_table.RankBoxes`, pickled."""
    import torch

    from shardpoint.state.sharding import Shard

    keys = [f"model.layers.{p}.weight" for p in range(params)]
    local = torch.empty(ROWS, COLUMNS)
    one = box_table.describe(keys, [Shard(local, (world * ROWS, COLUMNS), (0, 0))] * params, [False] * params)
    columns = one.array().copy()
    out = []
    for rank in range(world):  # the same boxes, each rank at its own rows
        columns[len(box_table.FIELDS)] = rank * ROWS
        out.append(pickle.dumps(one._replace(columns=columns.tobytes()), protocol=pickle.HIGHEST_PROTOCOL))
    return out


def _messages_before(world: int, params: int) -> list[bytes]:
    """What each simulated rank sent before: a tuple per box, its global shape and replica id beside."""
    nbytes = ROWS * COLUMNS * 4
    extents = [((world * ROWS, COLUMNS), 0)] * params
    out = []
    for rank in range(world):
        entries = [
            ((f"model.layers.{p}.weight", (rank * ROWS, 0), (ROWS, COLUMNS), ()), nbytes, False) for p in range(params)
        ]
        out.append(pickle.dumps((entries, 0, extents), protocol=pickle.HIGHEST_PROTOCOL))
    return out


_Box = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def survey_before(gathered: list[tuple[list, int, list]]) -> list[tuple]:
    """The check as it was: each rank's answer from every rank's boxes, a Python step per box."""
    world = len(gathered)
    try:
        coverage.check_tiling(
            p for r, (e, _, x) in enumerate(gathered) for p in coverage.pieces(r, (b[0] for b in e), x)
        )
    except ShardingError as exc:
        return [(exc.problems, 0, (), (), (), (False, False))] * world
    holders: dict[_Box, list[int]] = {}
    sizes: dict[_Box, int] = {}
    always: set[_Box] = set()
    for rank, (entries, _, _) in enumerate(gathered):
        for box, nbytes, shared_if_equal in entries:
            holders.setdefault(box, []).append(rank)
            sizes[box] = nbytes
            if shared_if_equal:
                always.add(box)
    shared = {box for box, ranks in holders.items() if len(ranks) > 1}
    writers = _writers_before(holders, sizes, world)
    total = sum(sizes.values()) + sum(extra for _, extra, _ in gathered)
    anything = (bool(shared), bool(shared & always))
    parts = []
    for rank, (entries, _, _) in enumerate(gathered):
        at = [i for i, (box, _, _) in enumerate(entries) if box in shared]
        elsewhere = [i for i in at if writers[entries[i][0]] != rank]
        parts.append((None, total, at, [i for i in at if entries[i][0] in always], elsewhere, anything))
    return parts


def _writers_before(holders: dict[_Box, list[int]], sizes: dict[_Box, int], world: int) -> dict[_Box, int]:
    """The holder with the fewest bytes to write so far writes each shared box (DCP's greedy), one box at a time."""
    load = [0] * world
    for box, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += sizes[box]
    writers = {}
    for box, ranks in holders.items():
        if len(ranks) > 1:
            writers[box] = writer = min(ranks, key=lambda r: (load[r], r))
            load[writer] += sizes[box]
    return writers
