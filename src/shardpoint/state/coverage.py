"""Declared boxes must tile each tensor exactly once: checked at every planned save, before anything is written.

A checkpoint stores, per global key, the boxes the ranks declare (``sp.Shard``,
``DTensor``, the tensor-parallel helpers). Nothing else says whether those boxes add
up to the tensor: when every expert-tensor-parallel rank declares the first ``1/etp``
(Megatron-LM#1836), the checkpoint is written at a fraction of its size and a resume
loads zeros, or garbage, into the rest. So every rank's boxes, which the replica check
(:func:`~shardpoint.state.replicas.check_replicas`) already gathers in the save's
start round, are checked here too; no extra message is sent, only each box's global
shape and replica id ride along (``None`` for the usual whole, canonical tensor).

The rule, per key (Megatron's ``validate_sharding_integrity``, with shardpoint's
declared replicas):

* boxes a rank declares with ``replica_id == 0`` are the canonical pieces; the same
  box held by several ranks counts once (it is a declared replica, hashed equal by
  the replica check);
* the distinct canonical boxes must be pairwise disjoint and their volumes must sum
  to the global volume: together that is exactly one cover, with no voxel grid;
* a box declared with another replica id must be a copy of a canonical box (DCP
  writes every distinct box, so a stray one would overlap the canonical ones);
* every rank must declare the same global shape.

Pieces that are the cells of a grid (every split tp, ep, FSDP and DTensor make) are
recognised in ``O(n log n)``: each dimension's spans partition it and there is one box
per cell. Other layouts, and the error path, sweep along the dimension the boxes split
most (``O(n k)`` where pieces also split ``k`` ways across the other dimensions). Empty
pieces (uneven FSDP shards) are not written and are skipped.

Every rank decides from the same gathered data, so every rank raises the same
:class:`~shardpoint.errors.ShardingError`, and the save stops before its directory
exists.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from typing import Any

from shardpoint.errors import ShardingError

__all__ = ["Piece", "check_tiling", "extents", "pieces", "problem"]

# key, offset, local shape, global shape, replica id, rank
Piece = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int]
_Box = tuple[tuple[int, ...], tuple[int, ...]]  # offset, shape


def extents(shards: Iterable[Any]) -> list[tuple[tuple[int, ...], int] | None]:
    """What the start round adds to each box, in ``shards`` order: ``(global_shape, replica_id)``.

    ``None`` for a whole tensor with replica id 0 (a plain tensor, the usual case), so
    a replicated model adds a byte per tensor to the round's message.
    """
    return [None if s.replica_id == 0 and s.is_full else (s.global_shape, s.replica_id) for s in shards]


def pieces(rank: int, boxes: Iterable[tuple], found: Sequence[tuple[tuple[int, ...], int] | None]) -> list[Piece]:
    """One rank's pieces from its gathered ``(key, offset, shape, ...)`` boxes and their :func:`extents`."""
    out = []
    for box, extent in zip(boxes, found):
        key, offset, shape = box[0], tuple(box[1]), tuple(box[2])
        full, replica = (shape, 0) if extent is None else (tuple(extent[0]), int(extent[1]))
        out.append((key, offset, shape, full, replica, rank))
    return out


def check_tiling(declared: Iterable[Piece]) -> None:
    """Raise :class:`ShardingError` for every key whose declared boxes do not tile its global shape once.

    Raises:
        ShardingError: naming each bad key, the missing or doubled region and the ranks (on every rank).
    """
    by_key: dict[str, list[Piece]] = {}
    for piece in declared:
        by_key.setdefault(piece[0], []).append(piece)
    problems = {}
    for key, found in by_key.items():
        if all(p[2] == p[3] and p[4] == 0 for p in found):
            continue  # whole tensors only (replicated): nothing to tile, the cheap usual case
        why = problem(found)
        if why is not None:
            problems[key] = why
    if problems:
        raise ShardingError(problems)


def problem(found: list[Piece]) -> str | None:
    """Why one key's pieces do not tile its global shape exactly once, or None when they do.

    In Python, a step per piece: rank 0's check of every rank's boxes calls it only for the keys its
    arrays could not settle (:mod:`shardpoint.state.box_table`), so the messages are these.
    """
    shapes: dict[tuple[int, ...], list[int]] = {}
    for p in found:
        shapes.setdefault(p[3], []).append(p[5])
    if len(shapes) > 1:
        said = "; ".join(f"ranks {_ranks(r)} declare {list(s)}" for s, r in sorted(shapes.items()))
        return f"the ranks disagree on its global shape: {said}"
    (full,) = shapes
    holders: dict[_Box, list[int]] = {}  # canonical boxes and who holds them
    copies: dict[_Box, list[int]] = {}
    for _, offset, shape, _, replica, rank in found:
        if math.prod(shape) == 0:
            continue  # an empty piece is not written
        (holders if replica == 0 else copies).setdefault((offset, shape), []).append(rank)
    strays = {box: ranks for box, ranks in copies.items() if box not in holders}
    if not strays and _is_grid(list(holders), full):
        return None
    overlap = _first_overlap(list(holders))
    if overlap is not None:
        a, b = overlap
        both = _intersection(a, b) or ((), ())  # not empty: _first_overlap returns boxes that intersect
        return (
            f"{_region(*both)} is declared twice: by rank(s) {_ranks(holders[a])} as {_region(*a)} and by "
            f"rank(s) {_ranks(holders[b])} as {_region(*b)}"
        )
    covered = sum(math.prod(shape) for _, shape in holders)
    if covered == math.prod(full) and not strays:
        return None
    if covered < math.prod(full):
        hole = _hole(((0,) * len(full), full), list(holders))
        declared = _strays(holders)
        stray = f"; held only as replicas (replica_id != 0) by {_strays(strays)}" if strays else ""
        return f"no rank declares {_region(*hole)} of {list(full)} (declared: {declared or 'nothing'}{stray})"
    return f"boxes declared as replicas (replica_id != 0) copy no canonical box: {_strays(strays)}"


def _is_grid(boxes: list[_Box], full: tuple[int, ...]) -> bool:
    """Whether ``boxes`` are every cell of a grid of ``full`` once (tp, ep, FSDP splits are): ``O(n log n)``.

    Each dimension's distinct spans must partition it, and there must be as many
    (distinct) boxes as the grid has cells: then each cell is one box.
    """
    cells = 1
    for dim, size in enumerate(full):
        end = 0
        spans = sorted({(offset[dim], shape[dim]) for offset, shape in boxes})
        for start, length in spans:
            if start != end:
                return False
            end += length
        if end != size:
            return False
        cells *= len(spans)
    return len(boxes) == cells


def _first_overlap(boxes: list[_Box]) -> tuple[_Box, _Box] | None:
    """Two distinct boxes that intersect, or None: a sweep along the dimension split into most pieces."""
    if len(boxes) < 2:
        return None
    dims = len(boxes[0][0])
    if dims == 0:
        return None
    axis = max(range(dims), key=lambda d: len({offset[d] for offset, _ in boxes}))
    active: list[tuple[int, int, _Box]] = []  # (end along axis, order, box)
    for order, box in enumerate(sorted(boxes, key=lambda b: (b[0][axis], b[0]))):
        start = box[0][axis]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, _, other in active:
            if _intersection(box, other) is not None:
                return other, box
        heapq.heappush(active, (start + box[1][axis], order, box))
    return None


def _hole(region: _Box, boxes: list[_Box]) -> _Box:
    """A box of ``region`` that none of ``boxes`` covers (the caller knows one exists), split at box edges."""
    inside = [b for b in boxes if _intersection(region, b) is not None]
    if not inside:
        return region
    (lo, size) = region
    for dim in range(len(lo)):
        cuts = sorted({c for o, s in inside for c in (o[dim], o[dim] + s[dim]) if lo[dim] < c < lo[dim] + size[dim]})
        if cuts:
            for half in _split(region, dim, cuts[len(cuts) // 2]):
                if _volume_inside(half, inside) < math.prod(half[1]):
                    return _hole(half, inside)
    return region  # not reached for disjoint boxes that leave a hole


def _split(region: _Box, dim: int, cut: int) -> tuple[_Box, _Box]:
    """``region`` cut in two at coordinate ``cut`` of dimension ``dim``."""
    (lo, size), end = region, region[0][dim] + region[1][dim]

    def part(start: int, stop: int) -> _Box:
        return (*lo[:dim], start, *lo[dim + 1 :]), (*size[:dim], stop - start, *size[dim + 1 :])

    return part(lo[dim], cut), part(cut, end)


def _volume_inside(region: _Box, boxes: list[_Box]) -> int:
    """Covered volume of ``region`` by disjoint ``boxes``."""
    return sum(math.prod(i[1]) for b in boxes if (i := _intersection(region, b)) is not None)


def _intersection(a: _Box, b: _Box) -> _Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _region(offset: Sequence[int], shape: Sequence[int]) -> str:
    """``[0:4, 0:4]``: a box as slices of the global tensor."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offset, shape)) + "]"


def _ranks(ranks: Iterable[int]) -> str:
    shown = sorted(set(ranks))
    return ", ".join(map(str, shown[:8])) + (f", ... ({len(shown)} ranks)" if len(shown) > 8 else "")


def _strays(boxes: dict[_Box, list[int]], limit: int = 8) -> str:
    """``rank(s) 0 [0:4, 0:4]; ...``: who declares which box, the first ``limit`` boxes."""
    shown = [f"rank(s) {_ranks(r)} {_region(*box)}" for box, r in sorted(boxes.items())[:limit]]
    return "; ".join(shown) + (f"; ... ({len(boxes)} boxes)" if len(boxes) > limit else "")
