"""Every rank's boxes as columns: the first save's tiling and replica check on rank 0, with no Python step per box.

The first save's start round sends rank 0 the boxes of every rank, ``ranks × tensors``
of them (4.9 million at 16,384 ranks × 300 tensors). Walked one by one in Python, as
:func:`~shardpoint.state.coverage.check_tiling` and a dict of holders did, that took
10.3 s at 4,096 simulated ranks while every other rank waited. Here each rank sends
its boxes as raw integer columns and its key names as one compressed blob
(:class:`RankBoxes`: 36 bytes a two-dimensional box, 12 KB for 300 tensors); rank 0
decodes each distinct set of names once and decides with array operations over the
boxes of all ranks, grouped by key (a transposition when every rank has the same keys,
else one radix sort) (:func:`survey`):

* **tiling**: per key and dimension, the distinct spans ``(offset, length)`` of the
  canonical boxes (``replica_id == 0``) must partition the dimension (neighbours
  compared within the key; boxes in rank order are usually sorted already), and every
  cell of that grid must be held; a copy (another replica id) must lie on a cell. That
  is every split tp, ep, FSDP and DTensor make. A key that fails, or that has no grid
  (a brick-wall tiling), goes to :func:`~shardpoint.state.coverage.problem` in Python
  with its own boxes only: the error names the key, the region and the ranks as
  before, and a valid tiling that is no grid is still accepted;
* **replicas**: a box is named by its key, its cell and its scope, one dense integer,
  so holders are counted with ``bincount``; the boxes held by the same ranks (a
  data-parallel group's) are split among those ranks by bytes, each written by one.

Since the check is split by key across ranks (:mod:`~shardpoint.state.split_survey`),
each key's planner runs :func:`survey` on its keys' boxes from every rank, as rank 0 ran
it on the whole job; what follows says "rank 0" for whichever rank surveys.

Rank 0's Python work is a few steps per rank (its message, its answer), none per box.
Its memory: the columns it received (4 bytes a value where all fit in 32 bits) and
one key-ordered copy of those that vary, with index arrays of 1 to 8 bytes a box
(``shardpoint bench --simulate-ranks`` reports the peak). Every other rank holds its
own columns and its answer.
"""

from __future__ import annotations

import pickle
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from shardpoint.state import coverage

__all__ = ["RankBoxes", "describe", "survey"]

# (problems or None, deduplicated bytes, shared, always, written elsewhere, (anything shared, any always shared))
Answer = tuple


class RankBoxes(NamedTuple):
    """One rank's boxes, in the order of its tensors: what it sends rank 0 in the save's start round.

    A tuple of plain values, so that rank 0 unpickles thousands of them without a
    Python step each. ``columns`` holds, as raw integers (64-bit where ``wide``, else
    32), one row per field and one column per box: :data:`FIELDS`, then the offset,
    the shape and the tensor's global shape, one row per dimension, padded to
    ``width`` dimensions with 0, 1 and 1.
    """

    names: bytes  # zlib of the pickled tuple of keys: identical on most ranks, decoded once per distinct set
    scope: tuple[int, ...]
    rank_local_bytes: int
    columns: bytes
    width: int
    wide: bool

    def array(self) -> np.ndarray:
        """``columns`` as a ``[fields, boxes]`` array (a view of the bytes)."""
        values = np.frombuffer(self.columns, np.int64 if self.wide else np.int32)
        return values.reshape(len(FIELDS) + 3 * self.width, -1)


#: the first rows of :attr:`RankBoxes.columns`; ``kind`` is twice the element size, plus 1 for a shared_if_equal value
FIELDS = ("ndim", "kind", "replica")


def describe(
    keys: Sequence[str],
    shards: Sequence[Any],
    always: Sequence[bool],
    scope: tuple[int, ...] = (),
    rank_local_bytes: int = 0,
) -> RankBoxes:
    """This rank's :class:`RankBoxes` from its ``sp.Shard`` s (each rank builds its own, in parallel)."""
    shapes = [tuple(s.tensor.shape) for s in shards]
    width = max(map(len, shapes), default=0)
    rows = [
        list(map(len, shapes)),
        [2 * s.tensor.element_size() + bool(a) for s, a in zip(shards, always)],
        [int(s.replica_id) for s in shards],
    ]
    for values, fill in (([s.global_offset for s in shards], 0), (shapes, 1), ([s.global_shape for s in shards], 1)):
        padded = [(*v, *(fill,) * (width - len(v))) for v in values]
        rows += [list(column) for column in zip(*padded)] if padded else [[] for _ in range(width)]
    columns = np.array(rows, np.int64).reshape(len(rows), len(shards))
    wide = bool(columns.size) and (columns.min() < -(1 << 31) or columns.max() >= 1 << 31)
    names = zlib.compress(pickle.dumps(tuple(keys), protocol=pickle.HIGHEST_PROTOCOL), 1)
    data = columns.tobytes() if wide else columns.astype(np.int32).tobytes()
    return RankBoxes(names, tuple(scope), int(rank_local_bytes), data, width, wide)


def survey(gathered: Sequence[RankBoxes], rotation: float = 0.0) -> list[Answer]:
    """The replica check of some keys: each rank's answer from every rank's boxes of them.

    Each answer is ``(problems, deduplicated bytes, shared, always, written elsewhere,
    (anything shared, any shared_if_equal value shared))``, the middle three as indices
    into that rank's boxes; ``problems`` (``{key: why}``) is set in every rank's answer
    when the boxes do not tile some tensor exactly once. ``rotation`` (0 to 1) moves where
    the split of shared bytes among their holders starts (:mod:`~shardpoint.state.split_survey`).
    """
    t = _Table(gathered)
    cell, cells, slow = _grid(t)
    problems = _problems(t, slow)
    if problems:
        return [(problems, 0, (), (), (), (False, False))] * len(gathered)
    return _replicas(t, _box_ids(t, cell, cells), rotation)


class _Table:
    """Every rank's boxes as columns sorted by key (within a key in rank order); keys and scopes as small integers."""

    def __init__(self, gathered: Sequence[RankBoxes]):
        index: dict[str, int] = {}
        decoded: dict[bytes, np.ndarray] = {}
        ids = []
        for boxes in gathered:  # a step per rank; names decoded once per distinct set
            found = decoded.get(boxes.names)
            if found is None:  # pickled by our own ranks
                found = decoded[boxes.names] = _key_ids(pickle.loads(zlib.decompress(boxes.names)), index)
            ids.append(found)
        arrays = [b.array() for b in gathered]
        counts = np.array([a.shape[1] for a in arrays], np.int64)
        self.keys, self.starts = list(index), np.concatenate(([0], np.cumsum(counts)))
        world = len(gathered)
        self.order: np.ndarray | None = None  # sorted position -> row; None: the transposition below
        if len(decoded) == 1 and world > 1:  # the same keys on every rank: grouped by key by a transposition
            self.shape = (world, int(counts[0]))
            self.key = np.repeat(ids[0], world)
            self.rank: np.ndarray = np.tile(np.arange(world, dtype=_index_type(world)), self.shape[1])
        else:
            key = np.concatenate([*ids, np.zeros(0, np.int32)])
            self.order = np.argsort(key.astype(np.uint16) if len(index) <= 1 << 16 else key, kind="stable")
            self.key = key[self.order]
            self.rank = np.repeat(np.arange(world, dtype=_index_type(world)), counts)[self.order]
        self.first = np.ones(len(self.key), np.bool_)  # the first box of its key
        self.first[1:] = self.key[1:] != self.key[:-1]
        columns = [self._sorted(c) for c in _columns(gathered, arrays)]
        self.ndim, kind, self.replica = columns[: len(FIELDS)]
        self.always, self.itemsize = (kind & 1).astype(np.bool_), kind >> 1
        width = (len(columns) - len(FIELDS)) // 3
        self.offsets, self.shapes, self.full = (
            columns[len(FIELDS) + i * width : len(FIELDS) + (i + 1) * width] for i in range(3)
        )
        scopes: dict[tuple[int, ...], int] = {}
        scope_of_rank = np.array([scopes.setdefault(b.scope, len(scopes)) for b in gathered] + [0], np.int64)
        self.scopes = len(scopes) or 1
        self.scope = scope_of_rank[self.rank] if self.scopes > 1 else np.zeros(len(self.key), np.int8)
        self.rank_local_bytes = sum(b.rank_local_bytes for b in gathered)

    def _sorted(self, column: np.ndarray) -> np.ndarray:
        """``column`` (in rank order) in key order; a constant one as a view of its value (so nothing is kept)."""
        if not len(column) or column.min() == column.max():
            return np.broadcast_to(np.array(column[:1]), column.shape)
        if self.order is None:
            return column.reshape(self.shape).T.ravel()
        return column[self.order]

    def origin(self, positions: np.ndarray) -> np.ndarray:
        """The rows (in rank order) at sorted ``positions``."""
        if self.order is None:
            world, per_rank = self.shape
            return (positions % world) * per_rank + positions // world
        return self.order[positions]


def _key_ids(names: Sequence[str], index: dict[str, int]) -> np.ndarray:
    """Each name's number, numbering the new ones (C loops: no Python step per name)."""
    new = [name for name in names if name not in index]
    index.update(zip(new, range(len(index), len(index) + len(new))))
    return np.fromiter(map(index.__getitem__, names), np.int32, len(names))


def _columns(gathered: Sequence[RankBoxes], arrays: list[np.ndarray]) -> np.ndarray:
    """Every rank's columns side by side, of one width and integer type (widened where ranks differ)."""
    width = max((b.width for b in gathered), default=0)
    parts = [a if b.width == width else _widened(a, b.width, width) for a, b in zip(arrays, gathered)]
    return np.concatenate([*parts, np.zeros((len(FIELDS) + 3 * width, 0), np.int32)], axis=1)


def _widened(columns: np.ndarray, width: int, wider: int) -> np.ndarray:
    """``columns`` of ``width`` dimensions, each coordinate padded to ``wider`` (offsets with 0, sizes with 1)."""
    fields = len(FIELDS)
    out = np.ones((fields + 3 * wider, columns.shape[1]), columns.dtype)
    out[:fields] = columns[:fields]
    for i in range(3):
        out[fields + i * wider : fields + i * wider + width] = columns[fields + i * width : fields + (i + 1) * width]
    out[fields + width : fields + wider] = 0
    return out


def _grid(t: _Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each box's cell in its key's grid (-1: none), each key's number of cells, and the keys to check in Python.

    A key whose boxes are all whole tensors with replica id 0 is a replicated value:
    its global shapes are not compared (each scope may hold its own), as before.
    """
    differ = t.ndim[1:] != t.ndim[:-1]
    whole = t.replica != 0
    nonempty = np.ones(len(t.key), np.bool_)
    for shape, full in zip(t.shapes, t.full):
        differ |= full[1:] != full[:-1]
        whole |= shape != full
        nonempty &= shape != 0
    disagree = _keys_of(t, np.flatnonzero(differ & ~t.first[1:]) + 1)
    partial = _keys_of(t, np.flatnonzero(whole))
    check = ~disagree[t.key] & nonempty
    picked = None if check.all() else np.flatnonzero(check)
    found, counts, bad = _cells(t, picked)
    good = ~disagree & ~bad
    if picked is None and good.all():  # the usual case: every box on a grid
        return found, counts, np.zeros(len(good), np.bool_)
    cell = np.full(len(t.key), -1, found.dtype)
    keep = good[t.key if picked is None else t.key[picked]]
    if picked is None:
        cell[keep] = found[keep]
    else:
        cell[picked[keep]] = found[keep]
    return cell, np.where(good, counts, 0), partial & (disagree | bad)


def _index_type(largest: int) -> type:
    """32-bit integers for numbers below ``largest`` where they fit (half the memory of rank 0's arrays)."""
    return np.int32 if largest < 1 << 31 else np.int64


def _keys_of(t: _Table, rows: np.ndarray) -> np.ndarray:
    """The keys of the boxes at ``rows``, as a mask over keys."""
    out = np.zeros(len(t.keys), np.bool_)
    out[t.key[rows]] = True
    return out


def _cells(t: _Table, picked: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the non-empty boxes ``picked`` (None: all): their cells, each key's count of cells, keys with no grid."""
    nkeys = len(t.keys)
    if picked is None:
        key, first, replica = t.key, t.first, t.replica
        offsets, shapes, full = t.offsets, t.shapes, t.full
    else:
        key, replica = t.key[picked], t.replica[picked]
        offsets, shapes, full = ([c[picked] for c in columns] for columns in (t.offsets, t.shapes, t.full))
        first = np.append(True, key[1:] != key[:-1]) if len(key) else np.zeros(0, np.bool_)
    canonical = replica == 0
    holders = key if canonical.all() else key[canonical]
    bad = np.zeros(nkeys, np.bool_)
    product = np.zeros(nkeys, np.float64)  # in float: a product of many spans must not wrap around
    product[key[first]] = 1
    spans = []
    for offset, size, whole in zip(offsets, shapes, full):
        if not offset.any() and np.array_equal(size, whole):
            continue  # not split along this dimension: one span, number 0
        span, per_key = _spans(key, first, offset, size, canonical, whole, bad)
        spans.append((span, per_key))
        product *= per_key
    bad |= product > np.bincount(holders, minlength=nkeys)  # more cells than boxes: no grid
    counts = np.where(bad, 0, product).astype(np.int64)
    kind = _index_type(len(key))  # a cell's number is below its key's count of boxes
    cell: np.ndarray = np.zeros(len(key), kind)
    stride: np.ndarray = np.ones(nkeys, kind)
    for span, per_key in reversed(spans):
        cell += span * stride[key]
        stride *= np.where(bad, 1, per_key).astype(kind)
    bad |= _uncovered(holders, cell if holders is key else cell[canonical], counts)
    return cell, counts, bad


def _spans(
    key: np.ndarray,
    first: np.ndarray,
    offset: np.ndarray,
    size: np.ndarray,
    canonical: np.ndarray,
    full: np.ndarray,
    bad: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Along one dimension: each box's span number within its key and each key's spans; marks keys in ``bad``.

    A key's distinct spans must partition the dimension: the first at 0, each next one
    where the last ends, the last at the end; each held by a canonical box, and every
    box at that offset of the same length.
    """
    order = None
    if not np.all(first[1:] | (offset[1:] >= offset[:-1])):  # boxes in rank order are usually sorted already
        order = np.lexsort((offset, key))
        offset, size, canonical, full = offset[order], size[order], canonical[order], full[order]
    new = first.copy()
    new[1:] |= offset[1:] != offset[:-1]
    bad[key[1:][~new[1:] & (size[1:] != size[:-1])]] = True
    group: np.ndarray = np.cumsum(new, dtype=_index_type(len(new)))
    group -= 1
    start, length, owner, begins = offset[new], size[new], key[new], first[new]
    if not canonical.all():  # each span held by a canonical box
        held = np.concatenate(([0], np.cumsum(canonical)))[np.append(np.flatnonzero(new), len(new))]
        bad[owner[np.diff(held) == 0]] = True
    end = start + length
    bad[owner[begins & (start != 0)]] = True
    bad[owner[1:][~begins[1:] & (start[1:] != end[:-1])]] = True
    bad[owner[np.append(begins[1:], True) & (end != full[new])]] = True
    kind = _index_type(len(start))
    span = (np.arange(len(start), dtype=kind) - np.flatnonzero(begins).astype(kind)[np.cumsum(begins) - 1])[group]
    if order is not None:
        span[order] = span.copy()
    return span, np.bincount(owner, minlength=len(bad))


def _uncovered(key: np.ndarray, cell: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """Keys with a cell of their grid that no canonical box holds (``cells`` 0: not checked)."""
    base: np.ndarray = np.concatenate(([0], np.cumsum(cells))).astype(_index_type(int(np.sum(cells)) + 1))
    held = np.zeros(int(base[-1]), np.bool_)
    counted = cells[key] > 0
    if counted.all():
        held[base[key] + cell] = True
    else:
        held[base[key[counted]] + cell[counted]] = True
    out = np.zeros(len(cells), np.bool_)
    out[np.searchsorted(base, np.flatnonzero(~held), side="right") - 1] = True
    return out


def _problems(t: _Table, slow: np.ndarray) -> dict[str, str]:
    """The keys the arrays could not settle, checked in Python with their own boxes (the messages as before)."""
    problems = {}
    by_key: dict[int, list[coverage.Piece]] = {}
    for row in np.flatnonzero(slow[t.key]).tolist():
        n = int(t.ndim[row])
        by_key.setdefault(int(t.key[row]), []).append(
            (
                t.keys[t.key[row]],
                tuple(int(c[row]) for c in t.offsets[:n]),
                tuple(int(c[row]) for c in t.shapes[:n]),
                tuple(int(c[row]) for c in t.full[:n]),
                int(t.replica[row]),
                int(t.rank[row]),
            )
        )
    for key, found in by_key.items():
        why = coverage.problem(found)
        if why is not None:
            problems[t.keys[key]] = why
    return problems


def _box_ids(t: _Table, cell: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """Each box's number, dense from 0: the same for the same box (key, offset, shape) in the same scope."""
    base = np.concatenate(([0], np.cumsum(cells)))
    ids = base[:-1].astype(_index_type(int(base[-1]) * t.scopes + len(t.key)))[t.key]
    ids += cell
    if t.scopes > 1:
        ids *= t.scopes
        ids += t.scope
    rest = np.flatnonzero(cell < 0)  # empty boxes, tilings that are no grid, differing whole values: few
    if rest.size:
        columns = tuple(c[rest] for c in (*t.shapes[::-1], *t.offsets[::-1], t.ndim, t.scope, t.key))
        order = np.lexsort(columns)
        stacked = np.stack([np.asarray(c[order], np.int64) for c in columns], axis=1)
        new = np.ones(len(rest), np.bool_)
        new[1:] = (stacked[1:] != stacked[:-1]).any(axis=1)
        ids[rest[order]] = base[-1] * t.scopes + np.cumsum(new) - 1
    return ids


def _replicas(t: _Table, ids: np.ndarray, rotation: float = 0.0) -> list[Answer]:
    """Each rank's answer: which of its boxes others hold too, which are always checked, which another rank writes."""
    holders = np.bincount(ids)
    size = np.zeros(len(holders), np.int64)
    nbytes = t.itemsize.astype(np.int64)
    for shape in t.shapes:
        nbytes *= shape
    size[ids] = nbytes
    always = np.zeros(len(holders), np.bool_)
    always[ids[t.always]] = True
    total = int(size.sum()) + t.rank_local_bytes
    shared = holders[ids] > 1
    anything = (bool(shared.any()), bool((shared & always[ids]).any()))
    world = len(t.starts) - 1
    if not anything[0]:
        return [(None, total, (), (), (), anything)] * world
    rows = np.flatnonzero(shared)
    elsewhere = np.zeros(len(ids), np.bool_)
    elsewhere[rows] = _not_writer(t, ids, rows, size, rotation)
    at, also, other = (_by_rank(t, mask) for mask in (shared, shared & always[ids], elsewhere))
    return [(None, total, at[r], also[r], other[r], anything) for r in range(world)]


def _not_writer(t: _Table, ids: np.ndarray, rows: np.ndarray, size: np.ndarray, rotation: float) -> np.ndarray:
    """For each of ``rows`` (boxes several ranks hold): whether a rank other than its own writes that box.

    The boxes held by the same ranks (a data-parallel group's) are split among those
    ranks in a scrambled order of bytes: holder ``j`` of ``n`` writes those whose middle byte falls
    in the ``j``-th ``n``-th of the group's bytes, about ``1/n`` each (DCP's greedy
    ``dedup_save_plans`` balances alike, one box at a time). Ranks are grouped by a
    signature of the set (first holder, count, sums of ranks and of their squares): two
    sets that share one only share a split, which stays valid.
    """
    order = np.lexsort((t.rank[rows], ids[rows]))  # each box's holders in rank order
    rows = rows[order]
    rank = t.rank[rows].astype(np.int64)
    begin = np.flatnonzero(np.append(True, ids[rows][1:] != ids[rows][:-1]))
    count = np.diff(np.append(begin, len(rows)))
    nbytes = size[ids[rows][begin]].astype(np.float64)
    sums = np.add.reduceat(rank, begin), np.add.reduceat(rank * rank, begin)
    # within a set, boxes in a scrambled order (a fixed odd multiplier, mod 2**64): in key order, keys that
    # sort together (a frozen encoder's, stored once) would all fall to one holder, which then writes
    # nothing in later saves
    scrambled = np.arange(len(begin), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    by_set = np.lexsort((scrambled, *sums, count, rank[begin]))
    signature = np.stack([rank[begin], count, *sums])[:, by_set]
    firsts = np.append(True, (signature[:, 1:] != signature[:, :-1]).any(axis=0))
    start_at = np.maximum.accumulate(np.where(firsts, np.arange(len(by_set)), 0))
    ranked, n = nbytes[by_set], count[by_set]
    before = np.cumsum(ranked) - ranked
    before -= before[start_at]
    totals = np.add.reduceat(ranked, np.flatnonzero(firsts))[np.cumsum(firsts) - 1]
    middle = ((before + ranked / 2) / np.where(totals > 0, totals, 1) + rotation) % 1.0
    turned = np.arange(len(n)) - start_at + (rotation * n).astype(np.int64)
    pick = np.where(totals > 0, np.minimum((middle * n).astype(np.int64), n - 1), turned % n)
    chosen = np.empty(len(begin), np.int64)
    chosen[by_set] = rank[begin[by_set] + pick]
    out = np.empty(len(rows), np.bool_)
    out[order] = rank != np.repeat(chosen, count)
    return out


def _by_rank(t: _Table, mask: np.ndarray) -> list[np.ndarray]:
    """The boxes ``mask`` selects, by rank, as indices into each rank's boxes (a step per rank)."""
    found = np.sort(t.origin(np.flatnonzero(mask)))
    cuts = np.searchsorted(found, t.starts)
    return [found[cuts[r] : cuts[r + 1]] - t.starts[r] for r in range(len(t.starts) - 1)]
