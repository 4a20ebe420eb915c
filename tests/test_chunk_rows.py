"""``.chunk_index`` version 2 and ``.chunk_rows``: a planner reads only its share of rows, checked by block (issue 59).

The format's own checks on a small index built here (round trips over every key range
and every span of blocks, flipped, moved, copied and crafted rows, slabs a head claims
that its rows do not keep), then a real 2-rank save and load: the marker lists both
files, and a flipped byte in the rows fails the load on every rank by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch
import xxhash

import shardpoint as sp
from shardpoint.catalog.metadata import FileRecord
from shardpoint.formats import chunk_index, chunk_rows
from shardpoint.formats.chunk_index import INDEX_NAME, ChunkIndex
from shardpoint.formats.chunk_rows import ROWS_NAME, decode_head, encode_split, read_rows
from tests import toy
from tests.distributed import launch

METADATA = FileRecord(size=1234, xxh3_64="0123456789abcdef")
FILES = {"__0_0.distcp": 4096, "__1_0.distcp": 4096}


def _index(offset_shift: int = 0) -> ChunkIndex:
    """Four keys: a matrix in two row blocks, a bytes item, a vector, a 3-d tensor in three blocks (width 3)."""
    keys = ["a", "b", "c", "d"]
    dtypes = ["torch.float32", None, "torch.int64", "torch.bfloat16"]
    shapes = [(4, 6), (), (10,), (3, 4, 5)]
    starts = [[0, 0, 0], [2, 0, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0], [2, 0, 0]]
    sizes = [[2, 6, 1], [2, 6, 1], [10, 1, 1], [1, 4, 5], [1, 4, 5], [1, 4, 5]]
    file = [0, 1, 0, 0, 1, 1]
    offset = [0, 0, 48, 128, 48, 88]
    length = [48, 48, 80, 40, 40, 40]
    return ChunkIndex(
        keys,
        dtypes,  # type: ignore[arg-type]
        shapes,
        np.array([0, 2, 2, 3, 6], np.int64),
        np.array(starts, np.int64),
        np.array(sizes, np.int64),
        np.array(file, np.int32),
        np.array(offset, np.int64) + offset_shift,
        np.array(length, np.int64),
        [(name, None) for name in FILES],
    )


def _size_of(rows: bytes):
    listed = {**FILES, ROWS_NAME: len(rows)}

    def size_of(name: str) -> int:
        if name not in listed:
            raise sp.CorruptCheckpointError(f"{name} is not listed")
        return listed[name]

    return size_of


class Ranged:
    """``read_range`` over bytes in memory, counting its calls."""

    def __init__(self, data: bytes) -> None:
        self.data, self.calls = data, 0

    def __call__(self, start: int, length: int) -> bytes:
        self.calls += 1
        return self.data[start : start + length]


def _read(head_bytes: bytes, rows: bytes, k0: int, k1: int, ranged: Ranged | None = None) -> ChunkIndex:
    head = decode_head(head_bytes, INDEX_NAME, METADATA, _size_of(rows))
    return read_rows(ranged or Ranged(rows), head, k0, k1, ROWS_NAME, _size_of(rows))


def test_every_key_range_reads_back_the_rows_of_the_whole_index_with_one_ranged_read_or_none():
    index = _index()
    head_bytes, rows = encode_split(index, METADATA)
    head = decode_head(head_bytes, INDEX_NAME, METADATA, _size_of(rows))
    assert (head.keys, head.dtypes, head.shapes, head.width, head.files) == (
        index.keys,
        index.dtypes,
        index.shapes,
        3,
        index.files,
    )
    assert len(rows) == 6 * chunk_rows.record_dtype(3).itemsize + 3 * 8  # a block each for a, c, d; b has no rows
    for k0 in range(5):
        for k1 in range(k0, 5):
            ranged = Ranged(rows)
            sub = read_rows(ranged, head, k0, k1, ROWS_NAME, _size_of(rows))
            r0, r1 = index.first_row[k0], index.first_row[k1]
            assert ranged.calls == (1 if r1 > r0 else 0), (k0, k1)
            assert sub.keys == index.keys[k0:k1] and sub.shapes == index.shapes[k0:k1]
            assert np.array_equal(sub.first_row, index.first_row[k0 : k1 + 1] - r0)
            assert [sub.files[f] for f in sub.file] == [index.files[f] for f in index.file[r0:r1]]  # only those used
            assert len(sub.files) == len(set(index.file[r0:r1].tolist()))
            for column in ("starts", "sizes", "offset", "length"):
                assert np.array_equal(getattr(sub, column), getattr(index, column)[r0:r1]), (k0, k1, column)
            assert sub.file.dtype == np.int32 and sub.starts.dtype == np.int64


def test_the_rows_are_views_of_the_bytes_read():
    head_bytes, rows = encode_split(_index(), METADATA)
    sub = _read(head_bytes, rows, 0, 4)
    for column in ("starts", "sizes", "offset", "length"):
        assert not getattr(sub, column).flags.owndata, column


def test_a_flipped_byte_in_one_keys_rows_is_refused_naming_the_file_and_key_and_the_others_still_read():
    head_bytes, rows = encode_split(_index(), METADATA)
    size = chunk_rows.record_dtype(3).itemsize
    damaged = bytearray(rows)
    head = decode_head(head_bytes, INDEX_NAME, METADATA, _size_of(rows))
    assert head.at(3) == 3 * size + 2 * 8  # after the blocks of a and c
    damaged[head.at(3) + 5] ^= 0x01  # in "d"'s first row
    with pytest.raises(sp.CorruptCheckpointError, match="rows of 'd' fail their checksum") as caught:
        _read(head_bytes, bytes(damaged), 0, 4)
    assert ROWS_NAME in str(caught.value) and "fallback=True" in str(caught.value)
    assert _read(head_bytes, bytes(damaged), 0, 3).keys == ["a", "b", "c"]


@pytest.mark.parametrize("block_rows", [1, 2])
def test_every_span_of_blocks_reads_back_its_rows_with_one_ranged_read(block_rows):
    """A planner's share may start and end inside a key whose rows keep slabs, at a block's edge."""
    index = _index()
    head_bytes, rows = encode_split(index, METADATA, block_rows=block_rows)
    head = decode_head(head_bytes, INDEX_NAME, METADATA, _size_of(rows))
    assert head.slab_step.tolist() == [2, 0, 0, 1] and head.slab_rows.tolist() == [1, 0, 0, 1]
    edges = sorted({0, 6, *range(0, 2, block_rows), 2, 3, *range(3, 6, block_rows)})
    for r0 in edges:
        for r1 in (r for r in edges if r > r0):
            k0 = int(np.searchsorted(index.first_row, r0, side="right")) - 1 if r0 < 6 else 4
            k1 = int(np.searchsorted(index.first_row, r1 - 1, side="right"))
            ranged = Ranged(rows)
            sub = chunk_rows.read_span(ranged, head, k0, k1, r0, r1, ROWS_NAME, _size_of(rows))
            assert ranged.calls == 1, (r0, r1)
            assert np.array_equal(sub.starts, index.starts[r0:r1]) and np.array_equal(sub.offset, index.offset[r0:r1])
            assert sub.first_row[0] == 0 and sub.first_row[-1] == r1 - r0


def test_blocks_moved_within_the_file_are_refused_by_their_numbers():
    """Two blocks of one key swapped: each block's checksum is its own bytes and its number."""
    head_bytes, rows = encode_split(_index(), METADATA, block_rows=1)
    size = chunk_rows.record_dtype(3).itemsize + 8
    swapped = rows[size : 2 * size] + rows[:size] + rows[2 * size :]  # a's two rows, each with its checksum
    with pytest.raises(sp.CorruptCheckpointError, match="rows of 'a' fail their checksum"):
        _read(head_bytes, swapped, 0, 1)


def test_a_head_claiming_slabs_its_rows_do_not_keep_is_refused_by_the_planner_that_reads_them():
    """Crafted as an attacker would: the head gives ``d`` slabs of two rows, which its rows do not keep."""
    head_bytes, rows = encode_split(_index(), METADATA)
    header, arrays = _head_parts(head_bytes)
    arrays["slab_step"] = np.array([2, 0, 0, 1], np.int64)
    arrays["slab_rows"] = np.array([1, 0, 0, 2], np.int64)  # d's three rows in slabs of two rows of one element each
    crafted = safetensors.numpy.save(arrays, metadata=header)
    head = decode_head(crafted, INDEX_NAME, METADATA, _size_of(rows))
    with pytest.raises(sp.CorruptCheckpointError, match="rows of 'd' do not lie in the slabs its head records"):
        read_rows(Ranged(rows), head, 0, 4, ROWS_NAME, _size_of(rows))


@pytest.mark.parametrize(
    "column, key, value, said",
    [
        ("split_dim", 3, 3, "cut a dimension its tensor does not have"),  # d has 3 dimensions
        ("split_dim", 2, 99, "cut a dimension its tensor does not have"),  # c keeps no slabs, and is routed by it too
        ("split_dim", 2, -1, "cut a dimension its tensor does not have"),
        ("slab_step", 3, -1, "slabs are negative"),
        ("slab_rows", 0, 2**61, "more or larger than its tensor and its rows hold"),  # overflowed a rank's routing
        ("slab_step", 0, 5, "more or larger than its tensor and its rows hold"),  # a's dimension 0 is 4 long
        ("slab_step", 3, 1, None),  # as written: d's three rows, one slab each
    ],
)
def test_slabs_a_rank_would_route_by_are_checked_with_the_head(column, key, value, said):
    """Every rank places its boxes by the head's slabs before any planner reads a row: checked on decoding.

    Found by review: a ``split_dim`` past the tensor's dimensions on a key without slabs
    raised an IndexError in every rank's routing, and 2**61 rows a slab wrapped int64,
    sending a box to a planner without its rows.
    """
    head_bytes, rows = encode_split(_index(), METADATA)
    header, arrays = _head_parts(head_bytes)
    arrays[column][key] = value
    crafted = safetensors.numpy.save(arrays, metadata=header)
    if said is None:
        decode_head(crafted, INDEX_NAME, METADATA, _size_of(rows))
        return
    with pytest.raises(sp.CorruptCheckpointError, match=said) as caught:
        decode_head(crafted, INDEX_NAME, METADATA, _size_of(rows))
    assert INDEX_NAME in str(caught.value)


def _head_parts(head_bytes: bytes) -> tuple[dict, dict]:
    length = int.from_bytes(head_bytes[:8], "little")
    header = json.loads(head_bytes[8 : 8 + length])["__metadata__"]
    return header, {k: np.array(v) for k, v in safetensors.numpy.load(head_bytes).items()}


def test_a_short_read_is_refused_by_name():
    head_bytes, rows = encode_split(_index(), METADATA)
    head = decode_head(head_bytes, INDEX_NAME, METADATA, _size_of(rows))
    with pytest.raises(sp.CorruptCheckpointError, match=r"shorter than written") as caught:
        read_rows(lambda start, length: rows[start : start + length - 1], head, 2, 4, ROWS_NAME, _size_of(rows))
    assert ROWS_NAME in str(caught.value) and "'c'" in str(caught.value)


def test_a_head_recording_another_metadata_is_refused():
    head_bytes, rows = encode_split(_index(), METADATA)
    other = FileRecord(size=METADATA.size, xxh3_64="f" * 16)
    with pytest.raises(sp.CorruptCheckpointError, match="records another .metadata") as caught:
        decode_head(head_bytes, INDEX_NAME, other, _size_of(rows))
    assert INDEX_NAME in str(caught.value)


def test_rows_copied_from_another_checkpoint_of_the_same_size_are_refused_by_checksum():
    head_bytes, rows = encode_split(_index(), METADATA)
    _, other = encode_split(_index(offset_shift=8), METADATA)
    assert len(other) == len(rows) and other != rows
    with pytest.raises(sp.CorruptCheckpointError, match="rows of 'a' fail their checksum"):
        _read(head_bytes, other, 0, 4)


def test_a_rows_file_of_another_size_than_the_head_describes_is_refused():
    head_bytes, rows = encode_split(_index(), METADATA)
    with pytest.raises(sp.CorruptCheckpointError, match=f"lists {ROWS_NAME} of"):
        decode_head(head_bytes, INDEX_NAME, METADATA, _size_of(rows + b"\0" * 8))


def _crafted(column: str, row: int, value, dim: int | None = None) -> ChunkIndex:
    index = _index()
    array = getattr(index, column)
    if dim is None:
        array[row] = value
    else:
        array[row, dim] = value
    return index


@pytest.mark.parametrize(
    "index, said",
    [
        (_crafted("file", 2, 2), "names a file it does not list"),
        (_crafted("file", 2, -2), "names a file it does not list"),
        (_crafted("starts", 0, 3, 0), "outside its tensor"),
        (_crafted("sizes", 2, 11, 0), "outside its tensor"),
        (_crafted("offset", 5, 4096), "past its 4096 bytes"),
        (_crafted("length", 0, -1), "negative or impossible"),
        (_crafted("starts", 2, 1, 1), "more dimensions than its tensor"),
        (_crafted("sizes", 2, 2, 2), "more dimensions than its tensor"),
    ],
)
def test_crafted_rows_with_matching_checksums_are_refused_by_name(index, said):
    """As an attacker writes them: the head's checksums are the crafted rows' own."""
    head_bytes, rows = encode_split(index, METADATA)
    with pytest.raises(sp.CorruptCheckpointError, match=said) as caught:
        _read(head_bytes, rows, 0, 4)
    assert ROWS_NAME in str(caught.value)


def test_a_version_1_index_is_not_taken_for_a_head():
    with pytest.raises(sp.CorruptCheckpointError, match="not a shardpoint chunk index of version 2"):
        decode_head(chunk_index.encode(_index(), METADATA), INDEX_NAME, METADATA, _size_of(b""))


# ----------------------------------------------------------------------------- a real save and load
def _save_and_load(rank: int, world: int, root: str, damage: bool, fallback: bool):
    topo = sp.Topology(1, 1, world)
    toy.seed_rng(topo)
    state = toy.build(topo)
    with sp.Checkpointer(root, topology=topo, keep_last=0) as ckpt:
        for step in (1, 2):
            toy.train_step(state, step)
            ckpt.save(step, state)
    last = sorted(Path(root).glob("iter_*"))[-1]
    listed = json.loads((last / "shardpoint.json").read_text())["files"]
    if rank == 0 and damage:
        raw = bytearray((last / ROWS_NAME).read_bytes())
        raw[len(raw) // 2] ^= 0x01
        (last / ROWS_NAME).write_bytes(bytes(raw))
    torch.distributed.barrier()
    fresh = toy.build(topo)
    try:
        result = sp.Checkpointer(root, topology=topo).load(fresh, fallback=fallback)
    except sp.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    saved, loaded = toy.snapshot(state)["tensors"], toy.snapshot(fresh)["tensors"]
    same = all(torch.equal(saved[k][2], loaded[k][2]) for k in saved)
    rows = listed.get(ROWS_NAME, {})
    sealed = rows.get("xxh3_64") == xxhash.xxh3_64((last / ROWS_NAME).read_bytes()).hexdigest()
    return {"iteration": result.iteration, "same": same, "listed": sorted(listed), "sealed": sealed}


def test_a_save_lists_both_files_and_a_flipped_byte_in_the_rows_fails_the_load_on_every_rank(tmp_path):
    """Two real ranks: the rows are listed and sealed; damaged, every rank refuses by name, fallback loads 1."""
    clean = launch(_save_and_load, 2, str(tmp_path / "clean"), False, False)
    assert [r["iteration"] for r in clean] == [2, 2] and all(r["same"] for r in clean), clean
    assert all({INDEX_NAME, ROWS_NAME} <= set(r["listed"]) and r["sealed"] for r in clean), clean
    damaged = launch(_save_and_load, 2, str(tmp_path / "damaged"), True, False)
    assert {r.get("error") for r in damaged} == {"CorruptCheckpointError"}, damaged
    assert all(ROWS_NAME in r["message"] and "checksum" in r["message"] for r in damaged), damaged
    fallen = launch(_save_and_load, 2, str(tmp_path / "fallback"), True, True)
    assert [r["iteration"] for r in fallen] == [1, 1], fallen
