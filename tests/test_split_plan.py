"""A load planned across ranks by rows of the index gives each rank what rank 0's whole plan gives it.

Every planner runs here in one process (``plan_keys(planner=p)``), fed exactly what each
rank would send it; the joined pieces must find what DCP's own planner finds against the
whole ``.metadata``, agree on every chunk's reader, and report the same missing and
unexpected keys as the central plan. Blocks of a row or a few split even these small
tensors' rows between planners, as 16,384 saving ranks split one tensor's. Real ranks:
every multi-rank load of the suite (``test_metadata_once``, the seam matrix).
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shardpoint.catalog.metadata import FileRecord
from shardpoint.errors import CorruptCheckpointError
from shardpoint.formats import chunk_rows, load_parts, read_plan, row_shares, split_plan
from shardpoint.formats.base import wanted_summary
from shardpoint.formats.chunk_index import ChunkIndex
from shardpoint.formats.dcp_metadata import outline_of
from tests.counting import count_calls
from tests.test_load_parts import _dcp_finds, _metadata, _random_box, _request, row_blocks

_RECORD = FileRecord(1, "00")


def _head(index: ChunkIndex, block_rows: int = chunk_rows.BLOCK_ROWS):
    head_bytes, rows = chunk_rows.encode_split(index, _RECORD, block_rows=block_rows)
    return chunk_rows.decode_head(head_bytes, "head", _RECORD, _sizes(rows)), rows


def _split(
    index: ChunkIndex,
    requests,
    shared: bool,
    budget: int = 1 << 30,
    reads: list | None = None,
    block_rows: int = chunk_rows.BLOCK_ROWS,
):
    """Every rank's joined part, every planner run in this process on what the ranks would send it."""
    head, rows = _head(index, block_rows)
    world = len(requests)

    def read_range(start: int, length: int) -> bytes:
        if reads is not None:
            reads.append(length)
        return rows[start : start + length]

    ends = np.zeros(len(index.files), np.int64)
    np.maximum.at(ends, index.file[index.file >= 0], (index.offset + index.length)[index.file >= 0])
    listed = {path: int(end) for (path, _), end in zip(index.files, ends)}

    def sized(name: str) -> int:  # the files as written: a reader keeps its bound's share by their bytes
        return listed.get(name, len(rows))

    asked = [split_plan.asks(request, head, world, budget) for request in requests]
    pieces = [
        split_plan.plan_keys([a[p] for a in asked], head, read_range, shared, "here", sized, planner=p, budget=budget)
        for p in range(world)
    ]
    return [split_plan.join([pieces[p][r] for p in range(world)], head) for r in range(world)], len(rows)


def _sizes(rows: bytes):
    """The marker's sizes: the rows file's own, and room for every data file's items."""
    return lambda name: len(rows) if name == chunk_rows.ROWS_NAME else 1 << 40


def test_each_rank_gets_what_dcp_finds_and_every_chunk_one_reader():
    rng = random.Random(5)
    for _ in range(60):
        shapes = {f"model.t{i}": tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 3))) for i in range(5)}
        metadata = _metadata(rng, shapes)
        outline, saved = outline_of(metadata), sorted(shapes)
        world = rng.randint(1, 5)
        asked = [{k: _random_box(rng, s) for k, s in shapes.items() if rng.random() < 0.7} for _ in range(world)]
        asked[0]["model.not_saved"] = ((0,), (1,))
        requests = [_request({k: b for k, b in a.items() if k in shapes}, outline, saved) for a in asked]
        requests[0] = _with_missing(requests[0], asked[0], saved)  # a key not saved: missing on every rank
        shared = rng.random() < 0.5 and world > 1
        index = ChunkIndex.from_metadata(metadata, "here")
        parts, _ = _split(index, requests, shared, block_rows=rng.choice([1, 2, 3, 64]))
        central = load_parts.plan(index, requests, shared, 1 << 30, "here")
        readers: dict[int, int] = {}
        for rank, part in enumerate(parts):
            mine, _ = part.metadata(outline, saved)
            for key, box in asked[rank].items():
                if key in shapes:
                    assert _dcp_finds(mine, key, box) == _dcp_finds(metadata, key, box), (shapes[key], box)
            assert (part.missing, part.unexpected) == (central[rank].missing, central[rank].unexpected)
            assert part.needed == central[0].needed or shared
            if not shared:
                assert part.positions.tolist() == central[rank].positions.tolist()
            for at, reader in zip(part.positions.tolist(), part.readers.tolist()):
                assert readers.setdefault(at, reader) == reader, "two planners named two readers of one chunk"


def _with_missing(request: load_parts.Request, asked: dict, saved: list[str]) -> load_parts.Request:
    return load_parts.Request(wanted_summary(asked, saved), request.ids, request.usable, request.boxes, request.types)


def _uniform(world: int, params: int, replicas: int = 1):
    """``params`` tensors of ``world // replicas`` row blocks saved by as many ranks, loaded by ``world`` ranks."""
    saving = world // replicas
    metadata = row_blocks(saving, params)
    outline, saved = outline_of(metadata), sorted(metadata.state_dict_metadata)
    requests = [_request({k: ((r % saving * 4, 0), (4, 8)) for k in saved}, outline, saved) for r in range(world)]
    return ChunkIndex.from_metadata(metadata, "here"), requests


@pytest.mark.parametrize("block_rows", [1, 4, 64])
def test_each_block_is_read_once_in_all_and_one_read_per_planner(block_rows):
    index, requests = _uniform(16, 40)
    reads: list[int] = []
    _, size = _split(index, requests, False, reads=reads, block_rows=block_rows)
    assert sum(reads) == size  # summed over planners: the rows file once
    assert len(reads) <= 16  # one ranged read per planner that owns rows


def test_replicas_read_each_file_once_and_each_rank_reads_its_own():
    """dp=2 replicas of 8 saving ranks: every file has one reader, the rank that wrote it."""
    index, requests = _uniform(16, 12, replicas=2)
    parts, _ = _split(index, requests, True)
    for rank, part in enumerate(parts):
        own = index.files.index((f"__{rank % 8}_0.distcp", None))
        files = [part.files[f] for f in part.file.tolist()]
        readers = {path: reader for (path, _), reader in zip(files, part.readers.tolist())}
        assert readers == {f"__{rank % 8}_0.distcp": rank % 8}, (rank, readers, own)
    assert all(part.needed for part in parts)  # the replicas 8..15 receive from 0..7


@pytest.mark.parametrize("block_rows", [1, 4, 64])
def test_no_planner_holds_more_than_its_share_and_a_block_and_every_row_has_one_planner(block_rows):
    """64 ranks saved 30 tensors (64 rows each); 64 planners each plan 30 rows, give or take a block.

    With a planner per key (the last stop's design) one planner held a tensor's 64 rows.
    Every row's planner, as a rank computes it (``row_shares.owner``), is the planner
    whose share holds it (``row_shares.cut``).
    """
    world, params = 64, 30
    index, _ = _uniform(world, params)
    head, _ = _head(index, block_rows)
    cuts = row_shares.cut(head, np.arange(world + 1), world)
    share = int(index.first_row[-1]) // world
    assert np.diff(cuts).max() <= share + block_rows, np.diff(cuts)
    rows = np.arange(int(index.first_row[-1]))
    assert np.array_equal(row_shares.owner(head, rows, world), np.searchsorted(cuts, rows, side="right") - 1)


@pytest.mark.parametrize("world", [16, 64])
def test_a_planner_hears_only_from_the_ranks_whose_rows_it_holds(world):
    """Counted: at the layout it was saved at, each box goes to one planner, which hears from its share of ranks.

    30 tensors saved by every rank: each planner holds about 30 rows and hears from the
    ranks that wrote them, however many ranks there are. Planned by key (the last
    stop's design) a tensor's planner heard from all ``world`` ranks.
    """
    index, requests = _uniform(world, 30)
    head, _ = _head(index, block_rows=4)
    asked = [split_plan.asks(request, head, world, 1 << 30) for request in requests]
    assert all(sum(a is not None for a in mine) <= 30 + 1 for mine in asked)  # one planner a box (+ planner 0)
    boxes = [sum(len(a.ids) // 4 for a in mine if a is not None) for mine in asked]
    assert boxes == [30] * world  # no box sent twice
    hearing = [sum(mine[p] is not None and bool(mine[p].ids) for mine in asked) for p in range(world)]
    assert max(hearing) <= 30 + 4, hearing


def test_a_key_without_slabs_is_planned_whole_by_its_home():
    """Rows that do not keep slabs (here a tensor cut along two dimensions unevenly) are never split."""
    shapes = {"model.a": (6, 6), "model.b": (4,)}
    boxes = {"model.a": [((0, 0), (2, 6)), ((2, 0), (4, 3)), ((2, 3), (4, 3))], "model.b": [((0,), (1,)), ((1,), (3,))]}
    index = ChunkIndex.from_metadata(_boxes_metadata(shapes, boxes), "here")
    head, _ = _head(index, block_rows=1)
    assert head.slab_step.tolist() == [0, 0]
    for world in (2, 3, 5):
        owners = row_shares.owner(head, np.arange(5), world)
        assert len(set(owners[:3].tolist())) == 1 and len(set(owners[3:].tolist())) == 1, (world, owners)


def _boxes_metadata(shapes: dict, boxes: dict) -> Metadata:
    tensors, storage = {}, {}
    for key, shape in shapes.items():
        chunks = [ChunkStorageMetadata(torch.Size(at), torch.Size(n)) for at, n in boxes[key]]
        tensors[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
        for at, _ in boxes[key]:
            storage[MetadataIndex(key, torch.Size(at))] = _StorageInfo("__0_0.distcp", 1000 * len(storage), 64)
    return Metadata(tensors, storage_data=storage)


def _planner_and_join_calls(world: int, shared: bool) -> tuple[int, int]:
    """Python calls of the busiest planner (one key that every rank asks for) and of one rank's join."""
    index, requests = _uniform(world, 1)
    head_bytes, rows = chunk_rows.encode_split(index, _RECORD)
    head = chunk_rows.decode_head(head_bytes, "head", _RECORD, _sizes(rows))
    asked = [split_plan.asks(request, head, world, 1 << 30)[0] for request in requests]
    plan = functools.partial(
        split_plan.plan_keys, asked, head, lambda a, n: rows[a : a + n], shared, "x", _sizes(rows), 0
    )
    pieces = plan()
    return count_calls(plan), count_calls(functools.partial(split_plan.join, pieces[:1] * world, head))


@pytest.mark.parametrize("shared", [False, True], ids=["own-reads", "shared-reads"])
def test_a_planner_makes_a_few_calls_per_asking_rank(shared):
    """The per-item guard of the split plan: the busiest planner's Python calls per rank that asks it.

    At 16,384 ranks one key's planner hears from every rank; a step per rank is what it
    may cost (0.4 s there, ``bench --simulate-ranks``), a step per rank per key would not.
    """
    (plan_8, join_8), (plan_32, join_32) = _planner_and_join_calls(8, shared), _planner_and_join_calls(32, shared)
    assert (plan_32 - plan_8) / 24 <= 50, (plan_8, plan_32)
    assert (join_32 - join_8) / 24 <= 80, (join_8, join_32)


def test_a_damaged_key_s_rows_fail_the_planner_that_reads_them_by_name():
    index, requests = _uniform(4, 8)
    head_bytes, rows = chunk_rows.encode_split(index, _RECORD)
    head = chunk_rows.decode_head(head_bytes, "head", _RECORD, _sizes(rows))
    damaged = bytearray(rows)
    damaged[-3] ^= 1
    asked = [split_plan.asks(r, head, 4, 1 << 30) for r in requests]
    last = int(row_shares.owner(head, head.first_row[-1:] - 1, 4)[0])
    with pytest.raises(CorruptCheckpointError, match=r"\.chunk_rows|rows"):
        split_plan.plan_keys(
            [a[last] for a in asked], head, lambda a, n: bytes(damaged[a : a + n]), False, "x", lambda n: 1 << 40, last
        )


def test_a_file_s_reader_is_its_writer_in_the_job_else_a_hash_of_its_name():
    """Whoever needs it: a planner sees only its rows' needers, so the rule must not depend on them."""
    paths = ["__1_0.distcp", "../iter_0000100/__3_0.distcp", "__9_0.distcp", "other/file.distcp"]
    readers = read_plan.designated_readers(paths, 4)
    assert readers[:2].tolist() == [1, 3]  # written by ranks in the job
    assert 0 <= readers[2] < 4 and 0 <= readers[3] < 4  # rank 9 is not in a job of 4: a hash
    assert read_plan.designated_readers(paths[2:], 4).tolist() == readers[2:].tolist()  # alike on every planner


def test_every_planner_names_the_same_reader_of_a_file():
    """Two replicas (ranks 2, 3) load what ranks 0 and 1 wrote; four planners see different keys of ``__1``.

    Balanced over what each planner sees (rank 0's whole-job policy), the planner of ``a``
    would give ``__1`` to rank 3 (rank 2 has ``__0``) and the planner of ``c`` to rank 2:
    neither reads most of the file, and its checksum would go unchecked.
    """
    sizes = {"model.a": [(0, 6), (6, 2)], "model.b": [(0, 6), (6, 2)], "model.c": [(0, 8)], "model.d": [(0, 8)]}
    tensors, storage = {}, {}
    for key, rows in sizes.items():
        chunks = [ChunkStorageMetadata(torch.Size([at, 0]), torch.Size([n, 4])) for at, n in rows]
        tensors[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8, 4]), chunks)
        for i, (at, n) in enumerate(rows):
            file = f"__{1 if key in ('model.c', 'model.d') else i}_0.distcp"
            storage[MetadataIndex(key, torch.Size([at, 0]))] = _StorageInfo(file, 1000 * len(storage), 16 * n)
    metadata = Metadata(tensors, storage_data=storage)
    outline, saved = outline_of(metadata), sorted(tensors)
    whole = {key: ((0, 0), (8, 4)) for key in saved}
    requests = [_request(asked, outline, saved) for asked in ({}, {}, whole, whole)]
    index = ChunkIndex.from_metadata(metadata, "here")
    head, _ = _head(index, block_rows=1)
    assert len(set(row_shares.owner(head, np.arange(6), 4).tolist())) == 4  # __1's rows on every planner
    parts, _ = _split(index, requests, True, block_rows=1)
    readers: dict[str, set[int]] = {}
    for part in parts:
        for f, reader in zip(part.file.tolist(), part.readers.tolist()):
            readers.setdefault(part.files[f][0], set()).add(reader)
    assert all(len(named) == 1 for named in readers.values()), readers


def test_a_rank_s_exchange_buffers_stay_within_its_one_bound_over_all_planners():
    """Resharded (each rank's rows straddle both saved chunks of 8 tensors): each rank would receive 8 partial chunks.

    With a bound of 4 chunks, the two planners together give each rank at most 4 buffers
    (each planner its share of the half a rank asks with, and of the half it reads for
    others with, by the bytes of its file each holds); each one alone would give it 4.
    """
    tensors, storage = {}, {}
    for i in range(8):
        key = f"model.t{i}"
        chunks = [ChunkStorageMetadata(torch.Size([at, 0]), torch.Size([4, 4])) for at in (0, 4)]
        tensors[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8, 4]), chunks)
        for r, at in enumerate((0, 4)):
            storage[MetadataIndex(key, torch.Size([at, 0]))] = _StorageInfo(f"__{r}_0.distcp", 64 * i, 64)  # packed
    metadata = Metadata(tensors, storage_data=storage)
    outline, saved = outline_of(metadata), sorted(tensors)
    requests = [_request({key: ((0, 0), (8, 4)) for key in saved}, outline, saved)]  # rank 0: whole tensors
    requests.append(_request({key: ((2, 0), (4, 4)) for key in saved}, outline, saved))  # rank 1: rows 2..5
    index = ChunkIndex.from_metadata(metadata, "here")
    bound = 4 * 64
    parts, _ = _split(index, requests, True, budget=bound)
    for part in parts:  # a chunk it receives and one it reads for the other rank each cost a buffer (none is exact)
        held = (len(part.receives) + len(part.sends)) * 64
        assert len(part.receives) and held <= bound, (part.receives, part.sends)
