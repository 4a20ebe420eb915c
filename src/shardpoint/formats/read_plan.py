"""Who reads which file of a shared load, and who receives which chunk: planned per share of rows.

The policy half of :mod:`shardpoint.formats.shared_reads` (which moves the bytes). Each
planner of a load split across ranks (:mod:`~shardpoint.formats.split_plan`; rank 0 for a
checkpoint whose index is one file) plans for the ranks that asked it from the needs it
found in its rows (:mod:`~shardpoint.formats.load_parts`) and sends each rank its share;
every planner names the same reader of a file (:func:`designated_readers`). Planned
whole on rank 0 it is O(ranks × items), which is why it works on columns (numpy)
rather than a dict per rank: at 4096 ranks of 300 chunks each that is 1.2 million
needs, 2.5 s as dicts and 0.3 s as columns, and why :func:`plan_sharing` loops in
Python only over the items some rank besides their reader needs.

Stored items are named by their position, which the planner gives every rank
(:mod:`~shardpoint.formats.load_parts`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

__all__ = ["Files", "Need", "Needs", "designated_readers", "distinct", "plan_reads", "plan_sharing"]

#: what a rank needs of one stored item: its stored bytes, and whether it is exactly one of
#: the rank's targets (received into it, no buffer)
Need = tuple[int, bool]


@dataclass
class Needs:
    """Every rank's needs as columns, one row per (rank, stored item), ordered by item then rank."""

    world: int
    ranks: np.ndarray  # int64
    positions: np.ndarray  # int64
    lengths: np.ndarray  # int64: stored bytes
    exact: np.ndarray  # bool: exactly one of the rank's targets

    @classmethod
    def from_dicts(cls, needs: Sequence[Mapping[int, Need]]) -> Needs:
        """From one dict per rank (position -> :data:`Need`); for tests and small tools."""
        rows = [(r, at, n, flag) for r, rank_needs in enumerate(needs) for at, (n, flag) in rank_needs.items()]
        ranks, positions, lengths = (np.array([row[i] for row in rows], dtype=np.int64) for i in range(3))
        return cls._sorted(len(needs), ranks, positions, lengths, np.array([row[3] for row in rows], dtype=np.bool_))

    @classmethod
    def from_columns(
        cls, world: int, ranks: np.ndarray, at: np.ndarray, lengths: np.ndarray, exact: np.ndarray
    ) -> Needs:
        """From one row per (rank, stored item) in any order, as rank 0 plans a load (formats.load_parts)."""
        return cls._sorted(world, ranks.astype(np.int64), at.astype(np.int64), lengths.astype(np.int64), exact)

    @classmethod
    def _sorted(cls, world: int, ranks: np.ndarray, at: np.ndarray, lengths: np.ndarray, exact: np.ndarray) -> Needs:
        pair = at * max(world, 1) + ranks
        if len(pair) and (np.diff(pair) > 0).all():  # one needer per item, in order: a load at the saved layout
            return cls(world, ranks, at, lengths, exact)
        order = np.lexsort((ranks, at))
        return cls(world, ranks[order], at[order], lengths[order], exact[order])

    def items(self) -> np.ndarray:
        """The stored items some rank needs, ascending (the rows are sorted by item already)."""
        return distinct(self.positions)


def distinct(ordered: np.ndarray) -> np.ndarray:
    """Each value of the sorted ``ordered`` once.

    Not ``np.unique`` or ``np.union1d``: they import ``numpy.ma`` on first use, 0.4 MB of reads on a first load.
    """
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if len(ordered) else ordered


@dataclass
class Files:
    """The file of each stored item as a column: ``names[ids[position]]`` (-1: none), no string per item.

    What rank 0 passes from the chunk index (:mod:`~shardpoint.formats.load_parts`):
    1.2 million items at 4096 ranks × 300 tensors, where a string per item was a Python
    step per item. ``names`` are distinct.
    """

    ids: np.ndarray
    names: Sequence[str]

    @classmethod
    def of(cls, files: Sequence[str] | Files) -> Files:
        """``files`` as ids and names; a list of one name per position (tests, small tools) is converted."""
        if isinstance(files, Files):
            return files
        names = sorted(set(files))
        at = {name: i for i, name in enumerate(names)}
        return cls(np.fromiter(map(at.__getitem__, files), np.int64, len(files)), names)


def plan_reads(needs: Needs, files: Sequence[str] | Files) -> dict[str, int]:
    """The reader of each file (``files[position]``, or a :class:`Files` column: the file of that stored item).

    Among the ranks that need the most bytes of a file, the one with the fewest bytes
    to read so far; biggest files first, ties to the lower rank.
    """
    if not len(needs.ranks):
        return {}
    column = Files.of(files)
    needed = column.ids[needs.positions]
    used = distinct(np.sort(needed))  # the files some rank needs, by id
    names = [column.names[i] for i in used.tolist()]
    key = np.searchsorted(used, needed) * needs.world + needs.ranks  # (file, rank)
    pairs, inverse = np.unique(key, return_inverse=True)
    wanted = np.bincount(inverse, weights=needs.lengths, minlength=len(pairs)).astype(np.int64)
    pair_file, pair_rank = pairs // needs.world, pairs % needs.world
    starts = np.searchsorted(pair_file, np.arange(len(names) + 1))
    size = np.maximum.reduceat(wanted, starts[:-1])
    load = np.zeros(needs.world, dtype=np.int64)
    readers = {}
    for f in sorted(range(len(names)), key=lambda i: (-size[i], names[i])):
        ranks = pair_rank[starts[f] : starts[f + 1]][wanted[starts[f] : starts[f + 1]] == size[f]]
        reader = int(ranks[np.lexsort((ranks, load[ranks]))[0]])
        readers[names[f]] = reader
        load[reader] += size[f]
    return readers


_WRITER = re.compile(r"(?:^|/)__(\d+)_\d+\.distcp$")  # DCP's file of the rank that wrote it (__{rank}_{n})


def designated_readers(paths: Sequence[str], world: int) -> np.ndarray:
    """The reader of each file (a rank of ``world``), the same for every planner of a split load, whoever needs it.

    A load planned across ranks (:mod:`~shardpoint.formats.split_plan`) has each file's
    items planned by several planners, each seeing only its rows' needs. A reader is
    checked by the whole file's checksum only when it reads most of the file, and an item
    read by two ranks is read twice, so every planner must name the same reader without
    asking the others. A rule over the needers each planner sees is not enough: on a
    load at another layout the file's writer needs some of its items and not others, so
    one planner sees it among the needers and another does not. So the reader is the
    rank that wrote the file (``__{rank}_{n}.distcp``; every rank reads its own file on
    a load at the saved layout: balanced, and local on a node-local tier) when that rank
    is in the job, else a hash of the name over the ranks; it reads the file's needed
    items for the others even where it needs none of them itself.
    """
    writer = np.fromiter(map(_writer_of, paths), np.int64, len(paths))
    digest = xxhash.xxh3_64_intdigest
    hashed = np.fromiter(
        (digest(name.encode("utf-8", "surrogatepass")) % max(world, 1) for name in paths), np.int64, len(paths)
    )
    return np.where((writer >= 0) & (writer < world), writer, hashed)


def _writer_of(name: str) -> int:
    found = _WRITER.search(name)
    return int(found.group(1)) if found else -1


def plan_sharing(
    needs: Needs,
    files: Sequence[str] | Files,
    chunk_bytes: Mapping[int, int] | np.ndarray,
    budget: int | np.ndarray,
    readers: Mapping[str, int] | None = None,
) -> dict[int, list[int]]:
    """For each stored item some rank reads for others: the ranks that receive it from its file's reader.

    A chunk costs its reader a buffer unless it is exactly one of the reader's targets,
    and a receiver likewise; no rank's buffers exceed ``budget``. A needer left out (its
    bound reached, or the reader's) reads its items itself. ``chunk_bytes``: position
    -> the chunk's bytes in memory, for every item needed (a mapping, or an array by
    position). ``budget``: one bound for every rank, or each rank's (a planner of some keys
    gives each rank the share of its bound those keys hold of its targets, formats.split_plan).
    ``readers``: :func:`plan_reads` of the same needs.
    """
    readers = plan_reads(needs, files) if readers is None else readers
    held = np.zeros(needs.world, dtype=np.int64)
    bound = np.broadcast_to(np.asarray(budget, np.int64), (needs.world,))
    receivers: dict[int, list[int]] = {}
    if not len(needs.positions):
        return receivers
    column = Files.of(files)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(needs.positions)) + 1))
    ends = np.append(starts[1:], len(needs.positions))
    items = needs.positions[starts].tolist()
    reader_of_file = np.array([readers.get(name, -1) for name in column.names] or [-1], np.int64)
    item_reader = reader_of_file[column.ids[needs.positions[starts]]]
    # only items some rank other than their reader needs cost anything (one needer: its own reader)
    shared = np.logical_or.reduceat(needs.ranks != np.repeat(item_reader, ends - starts), starts)
    for i in np.flatnonzero(shared).tolist():
        start, end, at, reader = int(starts[i]), int(ends[i]), items[i], int(item_reader[i])
        ranks, exact = needs.ranks[start:end], needs.exact[start:end]
        others = ranks != reader
        size = int(chunk_bytes[at])
        own = exact[~others]
        reader_cost = 0 if own.size and own[0] else size
        taken: list[int] = []
        if held[reader] + reader_cost <= bound[reader]:
            cost = np.where(exact[others], 0, size)
            fits = held[ranks[others]] + cost <= bound[ranks[others]]
            chosen = ranks[others][fits]
            held[chosen] += cost[fits]
            taken = chosen.tolist()
            if taken:
                held[reader] += reader_cost
        receivers[at] = taken
    return receivers
