"""Which rows of ``.chunk_rows`` each planner of a split load plans, from the head alone, on every rank.

Each of ``world`` planners plans an equal share of the index's rows (:func:`cut`), so no
planner holds more than its share plus one block, however the rows fall into keys: one
tensor saved by every rank of 16,384 is 16,384 rows, planned by the 55 planners whose
shares it spans, each asked only by the ranks whose boxes reach its rows. Shares end
only where a planner can check what it read and a rank can tell which planner holds a
box's rows without reading them:

* at a block's first row inside a key whose rows keep slabs (a box's slabs give its
  rows: :func:`planners_of`), since a planner checks the blocks it reads;
* at a key's first row otherwise: a key that keeps no slabs is planned whole, by the
  planner of its first row (its *home*).

A share's end is the first such point at or after ``p * rows // world``; the planner of a
row is then the planner of the last such point at or before it (:func:`owner`), which
every rank computes with no table of shares: a table would be as long as the job.
Every key has a home (:func:`home`): the planner of its first row, or for a key with no
rows the planner whose share holds the next key's first row.
"""

from __future__ import annotations

import numpy as np

from shardpoint.formats.chunk_rows import Head
from shardpoint.formats.read_plan import distinct

__all__ = ["cut", "holders", "home", "key_ranges", "keys_of", "owner", "planners_of"]


def _floor(head: Head, rows: np.ndarray) -> np.ndarray:
    """The last point a share may end at, at or before each of ``rows`` (rows of the index)."""
    key = np.searchsorted(head.first_row, rows, side="right") - 1
    key = np.minimum(key, len(head.keys) - 1)
    first = head.first_row[key]
    block = (rows - first) // head.block_rows * head.block_rows
    return np.where(head.slab_step[key] > 0, first + block, first)


def _plain(points: np.ndarray, rows: int, world: int) -> np.ndarray:
    """The last planner ``p`` with ``p * rows // world <= point``, for each point."""
    if rows == 0:
        return np.zeros(len(points), np.int64)
    return np.minimum(((points + 1) * world - 1) // rows, world - 1).astype(np.int64)


def owner(head: Head, rows: np.ndarray, world: int) -> np.ndarray:
    """The planner of each of ``rows``."""
    rows = np.asarray(rows, np.int64)
    if not len(head.keys):
        return np.zeros(len(rows), np.int64)
    return _plain(_floor(head, rows), int(head.first_row[-1]), world)


def home(head: Head, world: int) -> np.ndarray:
    """Each key's home: the planner of its first row (or of the next key's, for a key with no rows)."""
    return _plain(head.first_row[:-1], int(head.first_row[-1]), world)


def cut(head: Head, planners: np.ndarray, world: int) -> np.ndarray:
    """The first row of each planner's share (``world``: the end of the rows)."""
    total = int(head.first_row[-1])
    points = np.asarray(planners, np.int64) * total // world
    key = np.clip(np.searchsorted(head.first_row, points, side="right") - 1, 0, max(len(head.keys) - 1, 0))
    if not len(head.keys):
        return points
    first, after = head.first_row[key], head.first_row[key + 1]
    up = first + -(-(points - first) // head.block_rows) * head.block_rows
    snapped = np.where(head.slab_step[key] > 0, np.minimum(up, after), after)
    return np.where((points == first) | (points >= total), points, snapped)


def keys_of(head: Head, planner: int, world: int) -> tuple[int, int, int, int]:
    """``(k0, k1, r0, r1)``: the keys a planner plans (with rows in its share, or at home there) and its rows."""
    k0, k1, r0, r1 = (int(column[0]) for column in key_ranges(head, np.array([planner]), world))
    return k0, k1, r0, max(r0, r1)


def key_ranges(head: Head, planners: np.ndarray, world: int) -> tuple[np.ndarray, ...]:
    """Each of ``planners``' first and last + 1 key, and its rows (:func:`keys_of`), vectorised for a rank's asks."""
    r0, r1 = cut(head, planners, world), cut(head, planners + 1, world)
    homes = home(head, world)
    h0, h1 = np.searchsorted(homes, planners), np.searchsorted(homes, planners + 1)
    k0 = np.searchsorted(head.first_row, r0, side="right") - 1
    k1 = np.searchsorted(head.first_row, r1 - 1, side="right")
    rows = r1 > r0
    return np.where(rows, np.minimum(h0, k0), h0), np.where(rows, np.maximum(h1, k1), h1), r0, r1


def planners_of(head: Head, ids: np.ndarray, boxes: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """The first and last planner whose rows each box (of key ``ids``; ``(n, 2, width)``) can overlap.

    A key that keeps slabs: the rows of the slabs the box's extent along ``split_dim``
    reaches; any other key: its home.
    """
    ids = np.asarray(ids, np.int64)
    if not len(ids):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first, after = head.first_row[ids], head.first_row[ids + 1]
    step, per, dim = head.slab_step[ids], np.maximum(head.slab_rows[ids], 1), head.split_dim[ids]
    at = np.arange(len(ids))
    start, size = boxes[at, 0, dim], boxes[at, 1, dim]
    slabs = step > 0
    safe = np.where(slabs, step, 1)
    rows = after - first  # slab numbers clipped to the rows (decode_head: at most a slab a row), so no overflow
    lo = np.minimum(first + np.minimum(start // safe, rows) * per, after - 1)
    hi = np.minimum(first + np.minimum((start + np.maximum(size, 1) - 1) // safe, rows) * per + per, after) - 1
    lo, hi = np.where(slabs, lo, first), np.where(slabs, np.maximum(hi, lo), first)
    empty = after <= first
    total = int(head.first_row[-1])
    homes = _plain(first, total, world)
    lo_p = np.where(empty, homes, owner(head, np.maximum(lo, 0), world))
    hi_p = np.where(empty, homes, owner(head, np.maximum(hi, 0), world))
    return lo_p, hi_p


def holders(head: Head, keys: np.ndarray, world: int) -> np.ndarray:
    """How many planners plan each of ``keys``: those whose shares hold its rows (1 for a key without rows)."""
    out = np.ones(len(keys), np.int64)
    for i, key in enumerate(np.asarray(keys, np.int64).tolist()):  # only the keys some planner found unasked
        first, after = int(head.first_row[key]), int(head.first_row[key + 1])
        if after > first and head.slab_step[key] > 0:
            out[i] = len(distinct(owner(head, np.arange(first, after, head.block_rows), world)))  # ascending
    return out
