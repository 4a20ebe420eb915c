"""Values that several ranks hold: checked equal before they are stored once.

DCP stores a box of a global tensor once, whichever rank holds it, so a value that
several ranks hold is *declared* identical on all of them. When that is not true —
data-parallel replicas that drifted apart, a buffer that is really per rank, a
per-rank optimizer statistic under a global key — storing one copy loses the others
silently, and every rank reads the one copy back. Megatron checks parameter hashes
across data-parallel replicas for this reason; so do we, at every save, before
anything is committed:

1. every rank sends each key's boxes, as numpy columns, to that key's planner (a rank
   chosen by the key's name, :mod:`shardpoint.state.split_survey`); each planner checks
   that they tile each of its tensors, finds the boxes several ranks hold and picks each
   one's writer with array operations, no Python step per box
   (:mod:`shardpoint.state.box_table`), and sends each rank only its own answer: which
   of its boxes are shared and which another rank writes, and its keys' share of the
   job's deduplicated size for the free-space check (two all-to-alls: no rank receives
   every rank's boxes, 4.9 million at 16,384 ranks × 300 tensors);
2. each rank hashes (XXH3-64) only its boxes some other rank holds too, and sends the
   hashes to their keys' planners, which send every rank the disagreements (skipped
   when nothing is shared);
3. a value in ``FlatState.shared_if_equal`` whose holders disagree (an optimizer
   scalar that differs by rank) moves to ``FlatState.rank_local`` and is stored per
   rank; any other disagreement raises :class:`~shardpoint.errors.ReplicaMismatchError`
   on every rank, naming the key and which ranks hold which value.

The hashes cost one read of the replicated bytes (no copy for CPU tensors; a copy to
host for GPU tensors). ``Checkpointer(replica_check_interval=N)`` checks declared
replicas on the first save and every N-th save after it; the ``shared_if_equal``
values are small and decide where state is stored, so they are hashed at every save.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from shardpoint.errors import ReplicaMismatchError, ShardingError
from shardpoint.parallel import comm
from shardpoint.state import box_table, split_survey
from shardpoint.state.train_state import FlatState

__all__ = ["ReplicaReport", "box_of", "check_replicas", "compare", "fingerprint", "hashes_of", "settle"]

_Box = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # key, offset, shape, scope


@dataclass(frozen=True)
class ReplicaReport:
    """What :func:`check_replicas` found: the bytes the whole job writes, each shared box once.

    ``shared`` are this rank's boxes that other ranks hold too, ``always`` those of them
    that are ``shared_if_equal`` values (hashed at every save); rank 0 found them
    (:func:`~shardpoint.state.box_table.survey`), and no rank holds the others' boxes. A later save of the same
    structure hashes them again without gathering the boxes (:func:`hashes_of`, :func:`compare`).
    """

    deduplicated_bytes: int
    shared: frozenset = frozenset()
    always: frozenset = frozenset()
    written_elsewhere: frozenset = frozenset()  # shared boxes this rank holds that another rank writes

    def to_check(self, check_declared: bool) -> frozenset:
        return self.shared if check_declared else self.always


def fingerprint(tensor: torch.Tensor) -> tuple[str, int]:
    """``(dtype, XXH3-64 of the bytes)`` of a tensor, read in place for contiguous CPU tensors."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    raw = data.contiguous().reshape(-1).view(torch.uint8)
    return str(data.dtype), xxhash.xxh3_64_intdigest(raw.numpy().data)


def check_replicas(
    flat: FlatState, group: Any = None, *, check_declared: bool = True, scope: tuple[int, ...] = ()
) -> ReplicaReport:
    """Collective over ``group`` (every rank): verify shared boxes agree; move disagreeing per-rank values aside.

    Every rank of ``group`` must call this with its own ``flat`` at the same point.
    ``check_declared=False`` hashes only ``flat.shared_if_equal`` (see the module
    docstring for why those are always checked). ``scope`` separates ranks whose
    boxes are never the same data however they are named: the ``torch`` format stores
    one file per model-parallel rank, so there only data-parallel ranks are replicas.

    Raises:
        ShardingError: the declared boxes leave a hole in a tensor or cover part twice (on every rank).
        ReplicaMismatchError: a declared replica differs between ranks (on every rank).
    """
    boxes = [_box(key, shard, scope) for key, shard in flat.tensors.items()]
    problems, total, shared, always, elsewhere, anything = _survey(flat, scope, group)
    if problems:
        raise ShardingError(problems)
    report = ReplicaReport(
        total,
        frozenset(boxes[i] for i in shared),
        frozenset(boxes[i] for i in always),
        frozenset(boxes[i] for i in elsewhere),
    )
    # every planner told every rank whether its keys hold a box to check, so every rank takes the same branch
    if anything[0 if check_declared else 1]:
        settle(flat, _compared(hashes_of(flat, report.to_check(check_declared), scope), group))
    return report


def _compared(mine: dict[_Box, tuple[str, int]], group: Any) -> dict[str, list[list[int]]]:
    """Every disagreement, found by each key's planner from its holders' hashes (no rank gets every hash)."""
    world = comm.world_size()

    def ask() -> list:
        out: list[dict | None] = [None] * world
        for box, planner in zip(mine, split_survey.owners([box[0] for box in mine], world).tolist()):
            out[planner] = out[planner] or {}
            out[planner][box] = mine[box]
        return out

    def plan(received: list) -> list:
        return [_disagreements([hashes or {} for hashes in received]) or None] * world

    found: dict[str, list[list[int]]] = {}
    for piece in comm.spread(ask, plan, "comparing replicated tensors", group):
        found.update(piece or {})  # each key is one planner's
    return found


def _survey(flat: FlatState, scope: tuple[int, ...], group: Any) -> box_table.Answer:
    """This rank's answer to the tiling and replica check, made by key across ranks.

    See :mod:`~shardpoint.state.split_survey`: no rank holds every rank's boxes.
    """
    keys, shards = list(flat.tensors), list(flat.tensors.values())
    always = [key in flat.shared_if_equal for key in flat.tensors]
    own = sum(_nbytes(t) for t in flat.rank_local.values())
    picked: list = []

    def ask() -> list:
        sent, chosen = split_survey.requests(keys, shards, always, scope, own, comm.world_size())
        picked.extend(chosen)
        return sent

    def plan(received: list) -> list:
        return split_survey.survey_keys(received, comm.rank())

    return split_survey.join(comm.spread(ask, plan, "finding replicated tensors", group), picked)


def box_of(key: str, shard: Any, scope: tuple[int, ...] = ()) -> _Box:
    """The box ``shard`` fills under ``key``: how the replica check names it."""
    return _box(key, shard, scope)


def hashes_of(flat: FlatState, boxes: frozenset, scope: tuple[int, ...] = ()) -> dict[_Box, tuple[str, int]]:
    """This rank's hashes of the ``boxes`` it holds."""
    found = {}
    for key, shard in flat.tensors.items():
        box = _box(key, shard, scope)
        if box in boxes:
            found[box] = fingerprint(shard.tensor)
    return found


def compare(flat: FlatState, hashes: Iterable[dict[_Box, tuple[str, int]]]) -> set[str]:
    """Given every rank's hashes: move disagreeing ``shared_if_equal`` values to ``rank_local``; returns them.

    Every rank decides from the same gathered hashes, so all move the same keys.

    Raises:
        ReplicaMismatchError: a declared replica differs between ranks.
    """
    return settle(flat, _disagreements(hashes))


def settle(flat: FlatState, disagreements: dict[str, list[list[int]]]) -> set[str]:
    """:func:`compare` given the disagreements found (the same on every rank): the keys moved, or the error."""
    movable = {key for key in disagreements if key in flat.shared_if_equal}
    for key in movable:
        if key in flat.tensors:
            flat.rank_local[key] = flat.tensors.pop(key).tensor
    declared = {key: groups for key, groups in disagreements.items() if key not in movable}
    if declared:
        raise ReplicaMismatchError(declared)
    return movable


def _disagreements(hashes: Iterable[dict[_Box, tuple[str, int]]]) -> dict[str, list[list[int]]]:
    """``{key: [[ranks with value A], [ranks with value B], ...]}`` for keys with a box holding two values."""
    by_box: dict[_Box, dict[tuple[str, int], list[int]]] = {}
    for rank, entries in enumerate(hashes):
        for box, digest in entries.items():
            by_box.setdefault(box, {}).setdefault(digest, []).append(rank)
    found: dict[str, list[list[int]]] = {}
    for box, values in by_box.items():
        if len(values) > 1:
            found.setdefault(box[0], []).extend(sorted(values.values()))
    return found


def _box(key: str, shard: Any, scope: tuple[int, ...] = ()) -> _Box:
    return key, tuple(shard.global_offset), tuple(shard.tensor.shape), scope


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
