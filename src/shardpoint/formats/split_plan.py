"""A load's plan split across ranks by rows of the index: no rank reads, holds or plans the whole job.

Planned on rank 0 (:mod:`~shardpoint.formats.load_parts`), a load at 16,384 ranks ×
300 tensors put every rank's boxes (4.9 million) and the whole chunk index (256 MB)
on one process, which took seconds and a gigabyte while every other rank waited. Here
each rank plans an equal share of the index's rows (:mod:`~shardpoint.formats.row_shares`):

1. rank 0 reads and checks the index's head (``.chunk_index``: the outline, each key's
   rows and slabs, the files; no chunks) and broadcasts it (:func:`share_head`);
2. each rank places its targets against the outline and sends each box to the planners
   whose rows it can overlap (:func:`asks`; one, at the layout it was saved at), one
   all-to-all (:func:`shardpoint.parallel.comm.spread`);
3. each planner reads its rows of ``.chunk_rows``, one ranged read checked block by
   block (:func:`~shardpoint.formats.chunk_rows.read_span`), and plans them as rank 0
   plans a whole load (:func:`~shardpoint.formats.load_parts.plan`), with each file's
   reader chosen as every other planner chooses it
   (:func:`~shardpoint.formats.read_plan.designated_readers`) and each rank's exchange
   buffers bounded by the share of its bound those boxes hold (:func:`plan_keys`);
4. a second all-to-all gives each rank its piece from every planner, which it joins into
   its :class:`~shardpoint.formats.load_parts.Part` (:func:`join`).

A planner holds its share of the rows plus at most a block, and hears only from the
ranks whose boxes reach its rows, however many ranks saved one tensor; a tensor whose
rows keep no slabs is planned whole by one planner. Bytes of index read, summed over
ranks, are the index's size: each block is read once. Planner 0 also carries what the
whole job must agree on (the device types of every rank's targets, the keys asked for
that were not saved, the parts of the state asked for), so every rank ends with the
same verdicts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from shardpoint.catalog.metadata import FileRecord
from shardpoint.formats import chunk_rows, load_parts, read_plan, row_shares, shared_reads
from shardpoint.formats.base import unexpected_keys, wanted_keys
from shardpoint.formats.chunk_rows import ROWS_NAME, Head
from shardpoint.formats.load_parts import Part, Request
from shardpoint.parallel import comm
from shardpoint.storage.base import Storage

__all__ = [
    "Ask",
    "Piece",
    "asks",
    "join",
    "plan_keys",
    "plan_part",
    "share_head",
]

#: the part of a rank's exchange bound it keeps for the files it reads for others (the rest: what it asks for)
_READ_FOR_OTHERS = 0.5
_ITEMSIZE = {str(d): d.itemsize for d in vars(torch).values() if isinstance(d, torch.dtype)}


def share_head(reader: Any, listed: dict[str, FileRecord]) -> Head:
    """Collective: rank 0 reads and checks ``.chunk_index`` against the marker; every rank gets its head."""
    return comm.from_root(lambda: chunk_rows.read_head(reader, listed), "reading the chunk index")


class Ask(NamedTuple):
    """What one rank sends one planner: its boxes that reach that planner's rows, and its share of the buffer bound.

    Sent as a plain tuple (:func:`plan_part`): a pickled class costs its name in every
    frame, and a planner may hear from thousands of ranks.
    """

    ids: bytes  # int32: the key of each box, counted from the planner's first key (row_shares.key_ranges)
    usable: bytes
    boxes: bytes
    share: int  # bytes of the rank's exchange bound these boxes may use
    types: tuple[str, ...]
    agreed: tuple[tuple[str, ...], list[str]] | None = None  # to planner 0: the parts asked for, keys not saved


def asks(request: Request, head: Head, world: int, budget: int) -> list[Ask | None]:
    """This rank's :class:`Ask` of each planner (None: nothing to ask), from its whole-job :class:`Request`.

    Each box goes to every planner whose rows it can overlap (:func:`row_shares.planners_of`:
    one, at the layout it was saved at). The rank's exchange bound is shared among its
    planners by the bytes of its boxes each holds, so the pieces it receives together
    never exceed it.
    """
    ids = np.frombuffer(request.ids, np.int32)
    usable = np.frombuffer(request.usable, np.bool_)
    boxes = np.frombuffer(request.boxes, np.int64).reshape(len(ids), 2, -1) if len(ids) else np.zeros((0, 2, 1))
    lo, hi = row_shares.planners_of(head, ids, boxes, world)
    fan = hi - lo + 1
    box = np.repeat(np.arange(len(ids)), fan)
    planner = np.repeat(lo, fan) + np.arange(len(box)) - np.repeat(np.cumsum(fan) - fan, fan)
    k0, k1, _, _ = row_shares.key_ranges(head, planner, world)
    local = ids[box] - k0
    held = (local >= 0) & (local < k1 - k0)  # not a planner between two whose shares are empty
    box, planner, local = box[held], planner[held], local[held].astype(np.int32)
    fan = np.bincount(box, minlength=len(ids))
    itemsize = np.array([_ITEMSIZE.get(d or "", 1) for d in head.dtypes] or [1], np.float64)
    volume = (
        boxes[:, 1].prod(axis=1).astype(np.float64) * itemsize[ids] / np.maximum(fan, 1) if len(ids) else np.zeros(0)
    )
    per_planner = np.bincount(planner, volume[box], world) if len(box) else np.zeros(world)
    total = float(per_planner.sum()) or 1.0
    order = np.argsort(planner, kind="stable")
    bounds = np.searchsorted(planner[order], np.arange(world + 1))
    wanted = wanted_keys([request.keys], head.keys)
    agreed = (tuple(sorted({key.split(".", 1)[0] for key in wanted})), list(request.keys[1]))
    out: list[Ask | None] = [None] * world
    for p in np.flatnonzero(np.diff(bounds)).tolist():
        pairs = order[bounds[p] : bounds[p + 1]]
        mine = box[pairs]
        share = int(budget * (1 - _READ_FOR_OTHERS) * per_planner[p] / total)
        out[p] = Ask(local[pairs].tobytes(), usable[mine].tobytes(), boxes[mine].tobytes(), share, request.types)
    out[0] = (out[0] or Ask(b"", b"", b"", 0, request.types))._replace(agreed=agreed)
    return out


class Piece(NamedTuple):
    """What a planner sends one rank: its part of that planner's rows, and what every rank must agree on.

    Sent as a plain tuple, as :class:`Ask` is.
    """

    part: tuple | None  # _wire(Part), positions and keys already global
    needed: bool  # some rank receives something from this planner's rows
    unwanted: bytes  # int64: keys this planner plans that no rank asked it for
    agreed: tuple[tuple[str, ...], tuple[str, ...], list[str]] | None = None  # from planner 0: types, parts, missing


def plan_keys(
    received: Sequence[Ask | None],
    head: Head,
    read_range: Callable[[int, int], bytes],
    shared: bool,
    where: str,
    size_of: Callable[[str], int],
    planner: int | None = None,
    budget: int | None = None,
) -> list[Piece | None]:
    """This planner's pieces, one per rank, from every rank's :class:`Ask` of its rows.

    ``read_range(start, length)``: bytes of ``.chunk_rows``; ``shared``: replicas split
    the reading (the same on every planner); ``size_of``: a listed file's size;
    ``planner``: which planner this is (this rank; another in the bench's simulation);
    ``budget``: every rank's exchange bound (:data:`~shardpoint.formats.shared_reads.EXCHANGE_BUFFER_BYTES`).

    Each file's reader (:func:`~shardpoint.formats.read_plan.designated_readers`) plans
    here even if it asked nothing: it reads the file's items the askers need. Its buffers
    for them come from the part of its bound it keeps for reading for others
    (:data:`_READ_FOR_OTHERS`), shared among planners by the file's bytes each holds.
    """
    world = len(received)
    me = comm.rank() if planner is None else planner
    k0, k1, r0, r1 = row_shares.keys_of(head, me, world)
    asked = [a for a in received if a is not None]  # not an empty Ask per silent rank: 16,384 of them
    agreed = None
    if me == 0:
        types = tuple(sorted({t for a in asked for t in a.types}))
        asked_parts = {p for a in asked if a.agreed for p in a.agreed[0]}
        missing = sorted({k for a in asked if a.agreed for k in a.agreed[1]})
        agreed = (types, tuple(sorted(asked_parts)), missing)
    if k1 == k0:
        return [Piece(None, False, b"", agreed) for _ in range(world)] if agreed else [None] * world
    sub = chunk_rows.read_span(read_range, head, k0, k1, r0, r1, f"{where}/{ROWS_NAME}", size_of)
    bound = shared_reads.EXCHANGE_BUFFER_BYTES if budget is None else budget
    paths = [path for path, _ in sub.files]
    designated = read_plan.designated_readers(paths, world) if shared else np.zeros(0, np.int64)
    asking = [r for r, a in enumerate(received) if a is not None and a.ids]  # only these plan here, and the readers
    who = sorted({*asking, *designated.tolist()})
    at = {rank: i for i, rank in enumerate(who)}
    nothing: tuple[bytes, list[str]] = (np.zeros((k1 - k0 + 7) // 8, np.uint8).tobytes(), [])
    empty = Ask(b"", b"", b"", 0, ())
    their = [received[r] or empty for r in who]
    requests = [Request(nothing, a.ids, a.usable, a.boxes, a.types) for a in their]
    budgets = np.array([a.share for a in their], np.int64)
    if len(designated):  # each reader's share of the bound it keeps for reading for others: its file's rows here
        here = np.bincount(sub.file[sub.file >= 0], sub.length[sub.file >= 0], len(paths))
        sizes = np.array([max(size_of(path), 1) for path in paths], np.float64)
        reserve = (bound * _READ_FOR_OTHERS * np.minimum(here / sizes, 1.0)).astype(np.int64)
        np.add.at(budgets, [at[r] for r in designated.tolist()], reserve)
    readers = {path: at[r] for path, r in zip(paths, designated.tolist())}
    dims = max([1, *map(len, head.shapes)])  # the requests' boxes: load_parts.width of the whole outline
    names = np.array(who, np.int64)
    ids = np.concatenate([np.frombuffer(r.ids, np.int32) for r in requests] or [np.zeros(0, np.int32)])
    asked_for = np.zeros(k1 - k0, np.bool_)
    asked_for[ids] = True  # not np.setdiff1d: numpy.ma is imported on its first use (a first load's reads)
    unwanted = (np.flatnonzero(~asked_for) + k0).astype(np.int64).tobytes()

    def wired(part: Part) -> tuple[bool, tuple | None]:  # as each is made: no asker's Part is kept
        return part.needed, _wire(part, r0, k0, names) if len(part.positions) or part.sends else None

    made = load_parts.plan(sub, requests, shared, budgets, where, dims=dims, readers=readers, finish=wired)
    needed = any(flag for flag, _ in made)  # the same for every part
    quiet = Piece(None, needed, unwanted, agreed) if needed or unwanted or agreed else None
    pieces: list[Piece | None] = [quiet] * world
    for rank, (_, wire) in zip(who, made):
        if wire is not None:
            pieces[rank] = Piece(wire, needed, unwanted, agreed)
    return pieces


def join(pieces: Sequence[Piece | None], head: Head) -> Part:
    """This rank's :class:`Part` of the whole load, from its piece of every planner's rows (in planner order).

    A key is unwanted when every planner of its rows found it unasked
    (:func:`row_shares.holders`): one planner's rows of a tensor may be asked by no rank
    while another's are.
    """
    got = [p for p in pieces if p is not None]
    parts = [_unwire(p.part) for p in got if p.part is not None]
    agreed = next((p.agreed for p in got if p.agreed is not None), ((), (), []))
    types, asked_parts, missing = agreed
    found = np.concatenate([np.frombuffer(p.unwanted, np.int64) for p in got] or [np.zeros(0, np.int64)])
    found.sort()
    keys = read_plan.distinct(found)  # not np.unique: it imports numpy.ma, 0.4 MB of reads on a first load
    times = np.searchsorted(found, keys, side="right") - np.searchsorted(found, keys)
    unasked = keys[times == row_shares.holders(head, keys, len(pieces))] if len(keys) else keys
    unwanted = {head.keys[k] for k in unasked.tolist()}
    # unexpected_keys keeps the saved keys nobody asked for in the parts asked for (its `wanted` gives the parts)
    unexpected = unexpected_keys(unwanted, {f"{part}." for part in asked_parts})
    part = _joined(parts)
    part.missing, part.unexpected = list(missing), unexpected
    part.needed = any(p.needed for p in got)
    part.kinds = tuple(types)
    return part


def _wire(part: Part, base: int, k0: int, names: np.ndarray) -> tuple:
    """``part`` as one bytes object and short lists (about 150 bytes for a part of one chunk: it rides in the frame).

    Positions and keys counted from the whole index's, ranks (``names``: each asker's) the
    job's. One buffer, not one per column: ten bytes objects cost 330 bytes of headers
    per asker, on a planner that holds every asker's wire at once.
    """
    sends = {at + base: names[ranks].tolist() for at, ranks in part.sends.items()}
    readers = names[part.readers].astype(np.int32) if len(part.readers) else part.readers
    wide = (
        part.positions + base,
        part.starts,
        part.sizes,
        part.offset,
        part.length,
        part.receives + base,
        part.direct + base,
    )
    narrow = (part.keys + k0, part.file, readers)  # int32, after the int64 columns: every column stays aligned
    blob = b"".join([c.tobytes() for c in (*wide, *narrow)])  # C order, whatever the view
    counts = (len(part.positions), part.starts.shape[1], len(part.readers), len(part.receives), len(part.direct))
    return counts, blob, part.files, sends, part.shared


def _unwire(wired: tuple) -> Part:
    (rows, width, readers, receives, direct), blob, files, sends, shared = wired
    sizes = (rows, rows * width, rows * width, rows, rows, receives, direct, rows, rows, readers)
    ends = np.cumsum([0, *(n * (8 if i < 7 else 4) for i, n in enumerate(sizes))]).tolist()
    cols = [np.frombuffer(blob, np.int64 if i < 7 else np.int32, n, ends[i]) for i, n in enumerate(sizes)]
    positions, starts, box_sizes, offset, length, received, direct_, keys, file, read_by = cols
    starts, box_sizes = starts.reshape(-1, width), box_sizes.reshape(-1, width)
    part = Part(positions, keys, starts, box_sizes, file, offset, length, list(files), [], [], shared=shared)
    part.readers, part.receives, part.direct, part.sends = read_by, received, direct_, dict(sends)
    return part


def _joined(parts: list[Part]) -> Part:
    """One :class:`Part` of several planners' (each with its own files): columns joined, file numbers merged."""
    if len(parts) == 1:
        return parts[0]
    files: dict[Any, int] = {}
    remapped = []
    for part in parts:
        mapping = np.array([files.setdefault(f, len(files)) for f in part.files] or [0], np.int32)
        remapped.append(mapping[part.file] if len(part.file) else part.file)

    def join_column(name: str, dtype: Any) -> np.ndarray:
        found = [getattr(p, name) for p in parts]
        return np.concatenate(found).astype(dtype, copy=False) if found else np.zeros(0, dtype)

    def boxes(name: str) -> np.ndarray:  # every planner's are as wide as the outline (load_parts.width)
        out = [getattr(p, name) for p in parts]
        return np.concatenate(out) if out else np.zeros((0, 1), np.int64)

    part = Part(
        join_column("positions", np.int64),
        join_column("keys", np.int32),
        boxes("starts"),
        boxes("sizes"),
        np.concatenate(remapped).astype(np.int32) if remapped else np.zeros(0, np.int32),
        join_column("offset", np.int64),
        join_column("length", np.int64),
        list(files),
        [],
        [],
        shared=any(p.shared for p in parts),
    )
    part.readers = join_column("readers", np.int32)
    part.receives, part.direct = join_column("receives", np.int64), join_column("direct", np.int64)
    part.sends = {at: ranks for p in parts for at, ranks in p.sends.items()}
    return part


def plan_part(
    storage: Storage,
    where: str,
    listed: dict[str, FileRecord],
    head: Head,
    prepare: Callable[[], Request],
    shared: bool,
) -> Part:
    """Collective: this rank's part of the load, planned by key across ranks (two all-to-alls).

    ``storage``, ``where``: the checkpoint's, whose ``.chunk_rows`` each planner reads a range of.

    ``prepare``: this rank's :class:`~shardpoint.formats.load_parts.Request` for the whole
    job (its failure, or a planner's, raised on every rank); ``shared``: replicas may
    split the reading (when anything is stored at all).
    """
    world, budget = comm.world_size(), shared_reads.EXCHANGE_BUFFER_BYTES
    shared = shared and int(head.first_row[-1]) > 0
    read_range = chunk_rows.rows_reader(storage, where)  # listed: the load takes this path only then
    size_of = chunk_rows.sized(listed, where)

    def ask() -> list[tuple | None]:
        return [None if a is None else tuple(a) for a in asks(prepare(), head, world, budget)]

    def plan(received: list[tuple | None]) -> list[tuple | None]:
        pieces = plan_keys([None if a is None else Ask(*a) for a in received], head, read_range, shared, where, size_of)
        return [None if p is None else tuple(p) for p in pieces]

    pieces = comm.spread(ask, plan, "preparing the load")
    return join([None if p is None else Piece(*p) for p in pieces], head)
