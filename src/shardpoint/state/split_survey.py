"""The first save's tiling and replica check split by key across ranks: no rank holds every rank's boxes.

Checked on rank 0 (:func:`~shardpoint.state.box_table.survey` over every rank's
:class:`~shardpoint.state.box_table.RankBoxes`), the check held 4.9 million boxes at
16,384 ranks × 300 tensors: 722 MB on one process, growing with ranks × tensors. A
tensor's tiling and its replicas concern its own boxes only, so here each key has a
*planner*, the rank its name hashes to (:func:`owners`, XXH3 of the name: every rank
finds the planner of its own keys alike, with no list of all keys anywhere). Each rank
sends each planner a ``RankBoxes`` of its boxes of that planner's keys
(:func:`requests`), each planner surveys what it received exactly as rank 0 surveyed
the whole job, and each rank joins the answers of its planners into one (:func:`join`),
in the two all-to-alls of :func:`shardpoint.parallel.comm.spread` (the gather and the
scatter it replaces were two calls too).

What the whole job must agree on travels to every rank: a planner that finds a bad
tiling sends its problems to all, and every planner with keys sends every rank its
share of the job's deduplicated bytes and whether any of its boxes is shared, so every
rank takes the same branch after. Which holder writes a shared box is split by bytes
within each planner's keys, from a starting point that depends on the planner
(``rotation``): a planner of one key would otherwise give every such key to the same
holder of each replica group, which would then write everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from shardpoint.state import box_table
from shardpoint.state.box_table import Answer, RankBoxes

__all__ = ["join", "owners", "requests", "survey_keys"]

_NOTHING: Answer = (None, 0, (), (), (), (False, False))


def owners(keys: Sequence[str], world: int) -> np.ndarray:
    """Each key's planner: XXH3-64 of its name, modulo the ranks (the same on every rank, for any key)."""
    digest = xxhash.xxh3_64_intdigest
    hashed = np.fromiter((digest(key.encode("utf-8", "surrogatepass")) for key in keys), np.uint64, len(keys))
    return (hashed % np.uint64(max(world, 1))).astype(np.int64)


def requests(
    keys: Sequence[str],
    shards: Sequence[Any],
    always: Sequence[bool],
    scope: tuple[int, ...],
    rank_local_bytes: int,
    world: int,
) -> tuple[list[RankBoxes | None], list[np.ndarray]]:
    """This rank's boxes for each planner (None: none of its keys), and each one's indices into ``keys``.

    Planner 0 also receives the bytes this rank stores as its own (counted once in the job's size).
    """
    owner = owners(keys, world)
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(world + 1))
    out: list[RankBoxes | None] = [None] * world
    picked = [np.zeros(0, np.int64)] * world
    for p in np.flatnonzero(np.diff(bounds)).tolist():
        mine = order[bounds[p] : bounds[p + 1]]
        listed = mine.tolist()
        own = rank_local_bytes if p == 0 else 0
        sub = ([keys[i] for i in listed], [shards[i] for i in listed], [always[i] for i in listed])
        out[p], picked[p] = box_table.describe(*sub, scope, own), mine
    if out[0] is None and rank_local_bytes:
        out[0] = box_table.describe([], [], [], scope, rank_local_bytes)
    return out, picked


def survey_keys(received: Sequence[RankBoxes | None], planner: int) -> list[Answer | None]:
    """This planner's answer to each rank (:func:`~shardpoint.state.box_table.survey` of its keys' boxes)."""
    if all(boxes is None for boxes in received):
        return [None] * len(received)
    empty = box_table.describe([], [], [], ())
    filled = [empty if boxes is None else boxes for boxes in received]
    rotation = (xxhash.xxh3_64_intdigest(planner.to_bytes(8, "little")) >> 11) / float(1 << 53)
    return list(box_table.survey(filled, rotation))


def join(answers: Sequence[Answer | None], picked: Sequence[np.ndarray]) -> Answer:
    """This rank's whole answer from its planners' (indices mapped back to its own boxes)."""
    problems: dict[str, str] = {}
    total, flags = 0, [False, False]
    found: list[list[np.ndarray]] = [[], [], []]
    for p, answer in enumerate(answers):
        if answer is None:
            continue
        wrong, size, shared, always, elsewhere, anything = answer
        problems.update(wrong or {})
        total += size
        flags = [flags[0] or anything[0], flags[1] or anything[1]]
        for into, indices in zip(found, (shared, always, elsewhere)):
            if len(indices):
                into.append(picked[p][np.asarray(indices, np.int64)])
    if problems:
        return (problems, 0, (), (), (), (False, False))
    joined = [np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64) for parts in found]
    return (None, total, *joined, tuple(flags))
