"""The chunk index (``.chunk_index``): loads plan from arrays, never unpickling ``.metadata`` (issue 59 item 1).

Real gloo ranks save and load; the index's bytes read per load are counted in
``tests/test_metadata_once.py`` (16 ranks, local and S3), the collective calls per load
in ``tests/test_collective_rounds.py`` (unchanged), crafted indexes in ``tests/fuzz_readers.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
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
from shardpoint.formats.chunk_rows import ROWS_NAME
from shardpoint.storage.base import LocalStorage
from tests import toy
from tests.distributed import launch


def _train_and_save(rank: int, world: int, root: str, steps: int) -> sp.TrainState:
    topo = sp.Topology(1, 1, world)
    toy.seed_rng(topo)
    state = toy.build(topo)
    with sp.Checkpointer(root, topology=topo, keep_last=0) as ckpt:
        for step in range(1, steps + 1):
            toy.train_step(state, step)
            ckpt.save(step, state)
    return state


def _load(rank: int, world: int, root: str, steps: int, damage: str | None, fallback: bool):
    """Save ``steps`` iterations, let rank 0 ``damage`` the last, load; count the metadata unpickler's calls."""
    from shardpoint.storage import safe_io

    state = _train_and_save(rank, world, root, steps)
    if rank == 0 and damage is not None:
        _DAMAGE[damage](Path(root))
    torch.distributed.barrier()
    unpickled: list[str] = []
    construct = safe_io.RestrictedUnpickler.__init__

    def counting(self, file, where):  # every unpickling of .metadata or its outline builds one
        unpickled.append(where)
        construct(self, file, where)

    safe_io.RestrictedUnpickler.__init__ = counting
    opened: list[str] = []
    sys.addaudithook(
        lambda event, args: opened.append(str(args[0])) if event == "open" and "elsewhere" in str(args[0]) else None
    )
    fresh = toy.build(sp.Topology(1, 1, world))
    try:
        result = sp.Checkpointer(root, topology=sp.Topology(1, 1, world)).load(fresh, fallback=fallback)
    except sp.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "opened": opened}
    finally:
        safe_io.RestrictedUnpickler.__init__ = construct
    saved, loaded = toy.snapshot(state)["tensors"], toy.snapshot(fresh)["tensors"]
    same = saved.keys() == loaded.keys() and all(torch.equal(saved[k][2], loaded[k][2]) for k in saved)
    return {"iteration": result.iteration, "same": same, "unpickled": unpickled}


def _save(rank: int, world: int, root: str) -> None:
    _train_and_save(rank, world, root, 1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One checkpoint of 2 ranks, read (not changed) by the tests below."""
    root = tmp_path_factory.mktemp("index") / "run"
    launch(_save, 2, str(root))
    return _last(root)


def _last(root: Path) -> Path:
    return sorted(root.glob("iter_*"))[-1]


def _reseal(checkpoint: Path, name: str) -> None:
    """Record ``name``'s present size and checksum in the marker (or drop it when the file is gone)."""
    marker = checkpoint / "shardpoint.json"
    doc = json.loads(marker.read_text())
    path = checkpoint / name
    if path.exists():
        raw = path.read_bytes()
        doc["files"][name] = {"size": len(raw), "xxh3_64": xxhash.xxh3_64(raw).hexdigest()}
    else:
        del doc["files"][name]
    marker.write_text(json.dumps(doc))


def _flip(root: Path) -> None:
    path = _last(root) / INDEX_NAME
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 5] ^= 0x01  # in the arrays: only the checksum tells
    path.write_bytes(bytes(raw))


def _other_metadata(root: Path) -> None:
    """``.metadata`` rewritten after the index (same chunks, other bytes), the marker resealed: they disagree."""
    last = _last(root)
    path = last / ".metadata"
    raw = path.read_bytes()
    path.write_bytes(pickle.dumps(pickle.loads(raw)))  # our own file: trusted here
    assert path.read_bytes() != raw
    _reseal(last, ".metadata")


def _without_index(root: Path) -> None:
    """A checkpoint as shardpoint wrote them before the index."""
    last = _last(root)
    for name in (INDEX_NAME, ROWS_NAME):
        (last / name).unlink()
        _reseal(last, name)


def _as_version_1(root: Path) -> None:
    """A checkpoint as shardpoint wrote them before ``.chunk_rows``: the whole index in ``.chunk_index`` version 1."""
    last = _last(root)
    _write_version_1(last, _decode(last))


def _write_version_1(checkpoint: Path, index: ChunkIndex) -> None:
    marker = json.loads((checkpoint / "shardpoint.json").read_text())["files"]
    (checkpoint / INDEX_NAME).write_bytes(chunk_index.encode(index, FileRecord(**marker[".metadata"])))
    (checkpoint / ROWS_NAME).unlink(missing_ok=True)
    _reseal(checkpoint, INDEX_NAME)
    _reseal(checkpoint, ROWS_NAME)


def _outside(root: Path) -> None:
    """The index names a file of another run (a real copy, there to be opened), the marker resealed."""
    last = _last(root)
    other = root.parent / "elsewhere"
    other.mkdir(exist_ok=True)
    shutil.copy(last / "__0_0.distcp", other / "__0_0.distcp")
    index = _decode(last)
    index.files[0] = (os.path.relpath(other / "__0_0.distcp", last), None)
    _write_version_1(last, index)


_DAMAGE = {"flip": _flip, "other": _other_metadata, "none": _without_index, "outside": _outside, "v1": _as_version_1}


def test_a_load_with_the_index_unpickles_nothing_and_one_without_it_reads_metadata(tmp_path):
    """Counted: the restricted unpickler builds nothing on any rank when the index is there."""
    results = launch(_load, 2, str(tmp_path / "a"), 1, None, False)
    assert all(r["same"] for r in results), results
    assert [r["unpickled"] for r in results] == [[], []]
    old = launch(_load, 2, str(tmp_path / "b"), 1, "none", False)
    assert all(r["same"] for r in old), old
    assert any(".metadata" in where for where in old[0]["unpickled"]), old  # the count sees the old path
    assert all(r["unpickled"] for r in old), old  # rank 0 the file, the others its outline


def test_a_checkpoint_with_a_version_1_index_still_loads_from_it(tmp_path):
    """Checkpoints written before ``.chunk_rows`` hold the whole index in ``.chunk_index`` version 1."""
    results = launch(_load, 2, str(tmp_path / "run"), 1, "v1", False)
    assert all(r["same"] for r in results), results
    assert [r["unpickled"] for r in results] == [[], []]


@pytest.mark.parametrize("damage", ["flip", "other"])
def test_a_damaged_or_disagreeing_index_is_refused_by_name_and_fallback_loads_the_one_before(tmp_path, damage):
    results = launch(_load, 2, str(tmp_path / "run"), 2, damage, False)
    assert {r.get("error") for r in results} == {"CorruptCheckpointError"}, results
    said = "checksum mismatch" if damage == "flip" else "records another .metadata"
    assert all(INDEX_NAME in r["message"] and said in r["message"] for r in results), results
    assert all("fallback=True" in r["message"] for r in results), results
    if damage == "flip":  # fallback skips what fails its checksum (a resealed file passes, as any crafted one)
        results = launch(_load, 2, str(tmp_path / "again"), 2, damage, True)
        assert [r["iteration"] for r in results] == [1, 1], results


def test_an_index_naming_another_runs_file_is_refused_on_every_rank_which_never_opens_it(tmp_path):
    results = launch(_load, 2, str(tmp_path / "run"), 1, "outside", False)
    assert {r.get("error") for r in results} == {"CorruptCheckpointError"}, results
    assert all("elsewhere/__0_0.distcp" in r["message"] and "does not list" in r["message"] for r in results), results
    assert [r["opened"] for r in results] == [[], []]


def test_the_index_holds_exactly_the_chunks_of_metadata(saved):
    """Every column equals the one built from the unpickled ``.metadata``, chunk positions included."""
    checkpoint = saved
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own file: trusted here
    expected = ChunkIndex.from_metadata(metadata, str(checkpoint))
    index = _decode(checkpoint)
    _assert_same(index, expected)
    assert len(index.file) == sum(len(md.chunks) for md in metadata.state_dict_metadata.values())


def _assert_same(index: ChunkIndex, expected: ChunkIndex) -> None:
    for name in ("keys", "dtypes", "shapes", "files"):
        assert getattr(index, name) == getattr(expected, name), name
    for column in ("first_row", "starts", "sizes", "file", "offset", "length"):
        assert np.array_equal(getattr(index, column), getattr(expected, column)), column


def _decode(checkpoint: Path, data: bytes | None = None) -> ChunkIndex:
    """The index of ``checkpoint`` (or ``data`` as its ``.chunk_index``), of either version, checked."""
    marker = json.loads((checkpoint / "shardpoint.json").read_text())["files"]
    data = (checkpoint / INDEX_NAME).read_bytes() if data is None else data
    metadata = FileRecord(**marker[".metadata"])

    def size_of(name: str) -> int:
        if name not in marker:
            raise sp.CheckpointError(f"{name} is not listed")
        return marker[name]["size"]

    if json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]["version"] == "1":
        return chunk_index.decode(data, INDEX_NAME, metadata, size_of)
    head = chunk_rows.decode_head(data, INDEX_NAME, metadata, size_of)
    read_range = chunk_rows.rows_reader(LocalStorage(str(checkpoint)), str(checkpoint))
    return chunk_rows.read_rows(read_range, head, 0, len(head.keys), ROWS_NAME, size_of)


def _version_1(checkpoint: Path) -> bytes:
    """The checkpoint's index written as version 1 (everything in ``.chunk_index``), as older saves wrote it."""
    marker = json.loads((checkpoint / "shardpoint.json").read_text())["files"]
    return chunk_index.encode(_decode(checkpoint), FileRecord(**marker[".metadata"]))


@pytest.mark.parametrize(
    "column, value, said",
    [
        ("length", 10**12, "past its"),
        ("file", 7, "names a file it does not list"),
        ("sizes", 2**40, "outside its tensor"),
        ("dtype", 100, "dtype code is out of range"),
        ("first_row", 5, "row ranges"),
    ],
)
def test_a_crafted_column_is_refused_before_anything_is_sized_from_it(saved, column, value, said):
    """In version 1's columns; version 2's rows: ``tests/test_chunk_rows.py``."""
    checkpoint = saved
    raw = _version_1(checkpoint)
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    arrays = {name: array.copy() for name, array in safetensors.numpy.load(raw).items()}
    arrays[column].reshape(-1)[-1 if column == "first_row" else 0] = value
    crafted = safetensors.numpy.save(arrays, metadata=header)
    with pytest.raises(sp.CorruptCheckpointError, match=said) as caught:
        _decode(checkpoint, crafted)
    assert INDEX_NAME in str(caught.value)


def test_a_file_name_outside_the_checkpoint_is_refused(saved):
    checkpoint = saved
    index = _decode(checkpoint)
    index.files[0] = ("../../elsewhere/__0_0.distcp", None)
    marker = json.loads((checkpoint / "shardpoint.json").read_text())["files"]
    crafted = chunk_index.encode(index, FileRecord(**marker[".metadata"]))
    with pytest.raises(sp.CheckpointError, match="elsewhere"):
        _decode(checkpoint, crafted)


def test_a_checkpoint_saved_through_dcp_save_gets_its_index_too(tmp_path, saved):
    """Saves that ``dcp.save`` plans (node-local ones) write the index from DCP's ``Metadata``."""
    from shardpoint.formats import dist_save

    class Writer:  # what index_after_dcp needs of a DCP writer: its filesystem, its records, the metadata
        def __init__(self, checkpoint: Path) -> None:
            from shardpoint.formats.dist import HashingFileSystem

            self.fs, self.path = HashingFileSystem(), str(checkpoint)
            self.metadata = pickle.loads((checkpoint / ".metadata").read_bytes())

        def records(self) -> dict:
            marker = json.loads((Path(self.path) / "shardpoint.json").read_text())["files"]
            return {name: FileRecord(**r) for name, r in marker.items()}

    checkpoint = tmp_path / saved.name
    shutil.copytree(saved, checkpoint)
    written = (checkpoint / INDEX_NAME).read_bytes()
    rows = (checkpoint / ROWS_NAME).read_bytes()
    os.remove(checkpoint / INDEX_NAME)
    os.remove(checkpoint / ROWS_NAME)
    writer = Writer(checkpoint)
    dist_save.index_after_dcp(writer, str(checkpoint))
    assert writer.metadata is None
    again = _decode(checkpoint)
    assert len((checkpoint / ROWS_NAME).read_bytes()) == len(rows)  # not the bytes: each index has its own nonce
    (checkpoint / ROWS_NAME).write_bytes(rows)
    _assert_same(again, _decode(checkpoint, written))  # nor the head's: safetensors orders its header


def test_columns_are_views_of_the_bytes_read_not_copies(saved):
    """Counted: decoding copies no column (a copy doubled rank 0's memory for a 256 MB index at 16,384 ranks)."""
    data = _version_1(saved)
    index = _decode(saved, data)
    for column in ("first_row", "starts", "sizes", "file", "offset", "length"):
        assert np.shares_memory(getattr(index, column), np.frombuffer(data, np.uint8)), column


@pytest.mark.parametrize(
    "entry",
    [
        {"data_offsets": [0, 10**9]},  # past the file's end
        {"shape": [3, 3]},  # another size than its bytes
        {"dtype": "F64"},  # another dtype
        {"data_offsets": [-8, 0]},
    ],
)
def test_a_header_giving_a_column_another_range_or_type_is_refused_by_name(saved, entry):
    raw = _version_1(saved)
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])

    def written() -> bytes:
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)  # offsets count from the data section, wherever it begins
        return len(text).to_bytes(8, "little") + text + raw[8 + length :]

    _decode(saved, written())  # written again unchanged: read
    header["offset"].update(entry)
    with pytest.raises(sp.CorruptCheckpointError, match="'offset' is missing or malformed") as caught:
        _decode(saved, written())
    assert INDEX_NAME in str(caught.value)
