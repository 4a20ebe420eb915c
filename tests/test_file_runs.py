"""The index's files as runs of numbered names (issue 59): every rank holds a few runs, not 16,384 names.

Round trips of every kind of name a checkpoint holds, counted sizes (16,384 DCP files are
one run, and the head every rank holds stays a few dozen bytes per tensor), crafted runs
refused by name, and a real 2-rank checkpoint whose head names its files by runs.
"""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import safetensors.numpy

import shardpoint as sp
from shardpoint.catalog.metadata import FileRecord
from shardpoint.formats import chunk_rows, file_runs
from shardpoint.formats.chunk_index import ChunkIndex


def _round_trip(files: list) -> tuple[file_runs.FileRuns, np.ndarray]:
    arrays, header, renumbered = file_runs.encode(files)
    data = safetensors.numpy.save(arrays, metadata={"format": "x", **header})
    loaded = safetensors.numpy.load(data)
    found = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    return file_runs.decode(loaded, found, "index"), renumbered


def test_every_kind_of_name_comes_back_under_its_new_number():
    rng = random.Random(3)
    files = [(f"__{r}_0.distcp", None) for r in range(300)]
    files += [(f"__{r}_1.distcp", None) for r in range(0, 300, 7)]  # a second file of some ranks
    files += [(f"base/__{r}_0.distcp", None) for r in range(12)]  # stored once, another prefix
    files += [("__3_0.distcp.lz4", ("lz4",)), ("__4_0.distcp.lz4", ("lz4",)), ("__5_0.distcp.lz4", None)]
    files += [("common.pt", None), ("ünïcode_7.bin", None), ("__007_0.distcp", None), ("x9" * 40, None)]
    rng.shuffle(files)
    runs, renumbered = _round_trip(files)
    assert len(runs) == len(files)
    for old, file in enumerate(files):
        assert runs[int(renumbered[old])] == file, (old, file)
    assert sorted(renumbered.tolist()) == list(range(len(files)))
    assert list(runs) == [runs[i] for i in range(len(runs))] == runs.take(np.arange(len(runs)))
    picked = np.array([5, 0, 17, len(runs) - 1])
    assert runs.take(picked) == [runs[i] for i in picked.tolist()]


def test_16384_ranks_files_are_one_run_and_the_broadcast_head_stays_small():
    """Counted: the head of 16,384 ranks × 4 tensors pickles to under 2 KB; as names it was over 350 KB."""
    world = 16384
    files = sorted([(f"__{r}_0.distcp", None) for r in range(world)])  # as the index numbers them: by name
    runs, _ = _round_trip(files)
    assert len(runs.counts) == 1 and len(runs) == world
    index = _row_blocks(world, 4, files)
    head_bytes, rows = chunk_rows.encode_split(index, FileRecord(1, "00"))
    sizes = {chunk_rows.ROWS_NAME: len(rows), **{path: 1 << 20 for path, _ in files}}
    head = chunk_rows.decode_head(head_bytes, ".chunk_index", FileRecord(1, "00"), sizes.__getitem__)
    assert len(pickle.dumps(head)) < 2000, len(pickle.dumps(head))
    assert len(head_bytes) < 4000, len(head_bytes)
    named = sum(len(path) + 8 for path, _ in files)
    assert named > 350_000  # what version 1's columns of names held


def _row_blocks(world: int, params: int, files: list) -> ChunkIndex:
    """``params`` tensors of ``world`` row blocks, block ``r`` in rank ``r``'s file."""
    rows = world * params
    number = {path: i for i, (path, _) in enumerate(files)}
    rank = np.tile(np.arange(world), params)
    starts, sizes = np.zeros((rows, 2), np.int64), np.zeros((rows, 2), np.int64)
    starts[:, 0], sizes[:, 0], sizes[:, 1] = rank * 4, 4, 8
    file = np.array([number[f"__{r}_0.distcp"] for r in rank.tolist()], np.int32)
    offset = np.repeat(np.arange(params), world) * 128
    keys = [f"model.p{i}" for i in range(params)]
    first_row = np.arange(0, rows + 1, world, dtype=np.int64)
    return ChunkIndex(
        keys, ["torch.float32"] * params, [(world * 4, 8)] * params, first_row,
        starts, sizes, file, offset, np.full(rows, 128), files,
    )  # fmt: skip


@pytest.mark.parametrize(
    "column, value, said",
    [
        ("run_count", 0, "count that is not positive"),
        ("run_count", -1, "count that is not positive"),
        ("run_count", 2**41, "too many files"),
        ("run_start", -2, "count that is not positive"),
        ("run_start", 10**18, "numbers no name holds"),
        ("run_prefix_ends", 10**6, "names do not fit their table"),
    ],
)
def test_crafted_runs_are_refused_by_name(column, value, said):
    arrays, header, _ = file_runs.encode([(f"__{r}_0.distcp", None) for r in range(4)] + [("common.pt", None)])
    arrays[column] = arrays[column].copy()
    arrays[column][0] = value
    with pytest.raises(sp.CorruptCheckpointError, match=said) as caught:
        file_runs.decode(arrays, header, "ckpt/.chunk_index")
    assert "ckpt/.chunk_index" in str(caught.value)


def test_a_literal_run_with_a_count_and_descriptors_that_do_not_fit_are_refused():
    arrays, header, _ = file_runs.encode([("common.pt", None)])
    arrays["run_count"] = np.array([3], np.int64)
    with pytest.raises(sp.CorruptCheckpointError, match="numbers no name holds"):
        file_runs.decode(arrays, header, "index")
    arrays, header, _ = file_runs.encode([("a_1", ("lz4",)), ("a_2", None)])
    header["run_descriptors"] = '[["lz4"]]'
    with pytest.raises(sp.CorruptCheckpointError, match="descriptors do not fit its runs"):
        file_runs.decode(arrays, header, "index")


def test_files_stored_once_in_an_earlier_checkpoint_are_one_run_too():
    """Found by review: runs cut at a name's first number made each ``../iter_0000100/__{r}_0.distcp`` a run of one."""
    world = 16384
    files = [(f"../iter_0000100/__{r}_0.distcp", None) for r in range(world)]
    files += [(f"__{r}_0.distcp", None) for r in range(world)] + [
        (f"../global_step7/__{r}_0.distcp", None) for r in range(4)
    ]
    runs, renumbered = _round_trip(files)
    assert len(runs.counts) == 3 and len(runs) == len(files)
    assert all(runs[int(renumbered[old])] == file for old, file in enumerate(files))


def test_names_with_other_scripts_digits_come_back_as_they_were():
    """Found by review: ``int`` reads Arabic-Indic digits, so ``__1٠_0`` came back as ``__10_0``, another file."""
    files = [("__1٠_0.distcp", None), ("__10_0.distcp", None), ("x_1٣.bin", None), ("__٣_0.distcp", None)]
    runs, renumbered = _round_trip(files)
    assert [runs[int(renumbered[old])] for old in range(len(files))] == files


def test_run_bounds_that_wrap_int64_are_refused():
    """Found by review: ``start + count`` and the sum of counts were added in int64 and wrapped."""
    arrays, header, _ = file_runs.encode([(f"__{r}_0.distcp", None) for r in range(4)])
    arrays["run_start"] = np.array([2**63 - 1], np.int64)
    with pytest.raises(sp.CorruptCheckpointError, match="numbers no name holds"):
        file_runs.decode(arrays, header, "index")
    arrays, header, _ = file_runs.encode([(f"a{r}_{r}", None) for r in range(10)])  # ten runs: both numbers vary
    arrays["run_count"] = np.full(len(arrays["run_count"]), 922 * 10**15, np.int64)
    with pytest.raises(sp.CorruptCheckpointError, match="too many files"):
        file_runs.decode(arrays, header, "index")
