"""The files a chunk index names, as runs of numbered names: a few bytes for 16,384 ranks' files.

DCP names each rank's file ``__{rank}_{n}.distcp``, so a checkpoint saved by 16,384
ranks names 16,384 files. Listed one by one (version 1 of the index), they were most of
the head every rank of a split load holds (0.4 MB as bytes, 3.7 MB as Python strings at
16,384 ranks), against a rank's share of the index of 17 KB. Here names that differ
only in one number are one *run*: a prefix, a first number, a count, a suffix (the
prefix and suffix may hold other numbers) and the transform descriptors DCP recorded.
``__0_0.distcp`` … ``__16383_0.distcp`` is one run, and so are the files a checkpoint
stores once in an earlier one (``../iter_0000100/__{rank}_0.distcp``); a name with no
number is a run of one. A file's number in the index is its place in the runs, and its name is
built when asked for (:class:`FileRuns`), so what a rank holds grows with the kinds of
names, not with the ranks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from shardpoint.formats.chunk_table import File, complaint, decode_names, encode_names

__all__ = ["RUN_COLUMNS", "FileRuns", "decode", "encode"]

#: the columns of the runs (name: dtype, dimensions)
RUN_COLUMNS = {
    "run_prefixes": (np.uint8, 1),
    "run_prefix_ends": (np.int64, 1),
    "run_suffixes": (np.uint8, 1),
    "run_suffix_ends": (np.int64, 1),
    "run_start": (np.int64, 1),  # the first number; -1: the prefix is the whole name (a run of one)
    "run_count": (np.int64, 1),
}
_DIGITS = re.compile(r"([0-9]+)")  # ASCII digits only: int() would read other scripts' digits as the same number
_CANONICAL = re.compile(r"0|[1-9][0-9]{0,17}")  # as str(int) writes it, so a name comes back byte for byte
_MAX_FILES = 1 << 40


class FileRuns(Sequence[File]):
    """The files of an index, built from their runs when one is asked for (a :class:`Sequence` of ``File``)."""

    def __init__(
        self, prefixes: list[str], suffixes: list[str], start: np.ndarray, count: np.ndarray, descriptors: list
    ) -> None:
        self.prefixes, self.suffixes, self.descriptors = prefixes, suffixes, descriptors
        self.starts, self.counts = start, count
        self.ends = np.cumsum(count, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @overload
    def __getitem__(self, i: int) -> File: ...
    @overload
    def __getitem__(self, i: slice) -> list[File]: ...
    def __getitem__(self, i: int | slice) -> File | list[File]:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.take(np.array([i % len(self)]))[0]

    def take(self, numbers: np.ndarray) -> list[File]:
        """The files of ``numbers`` (ascending or not), built together: a planner's few hundred of 16,384."""
        if len(numbers) and (numbers.min() < 0 or numbers.max() >= len(self)):
            raise IndexError(f"file numbers outside the {len(self)} files")
        run = np.searchsorted(self.ends, numbers, side="right")
        number = (self.starts[run] + numbers - (self.ends[run] - self.counts[run])).tolist()
        prefixes, suffixes, descriptors = self.prefixes, self.suffixes, self.descriptors
        whole = (self.starts < 0).tolist()  # a run of one: the prefix is the name
        return [
            (prefixes[r] if whole[r] else f"{prefixes[r]}{n}{suffixes[r]}", descriptors[r])
            for r, n in zip(run.tolist(), number)
        ]

    def __iter__(self) -> Iterator[File]:
        for run, (first, count) in enumerate(zip(self.starts.tolist(), self.counts.tolist())):
            d = self.descriptors[run]
            if first < 0:
                yield self.prefixes[run], d
                continue
            prefix, suffix = self.prefixes[run], self.suffixes[run]
            for number in range(first, first + count):
                yield f"{prefix}{number}{suffix}", d

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


def encode(files: Sequence[File]) -> tuple[dict[str, np.ndarray], dict[str, str], np.ndarray]:
    """The runs of ``files``: their columns, header fields, and each file's new number (by its old one).

    Names are grouped by their shape (the text between their numbers, and their
    descriptors); within a group, the number that takes the most values is the run's
    (the rank in ``__{rank}_0.distcp``, also in ``../iter_0000100/__{rank}_0.distcp``, a
    file stored once in an earlier checkpoint), the others stay text.
    """
    split = [_DIGITS.split(path) for path, _ in files]  # text, number, text, ..., text
    groups: dict[tuple, list[int]] = {}
    for old, (tokens, (_, descriptors)) in enumerate(zip(split, files)):
        shape = (tuple(tokens[0::2]), None if descriptors is None else tuple(descriptors))
        groups.setdefault(shape, []).append(old)
    keyed = []
    for (_, d), members in groups.items():
        field = _varying(split, members)
        for old in members:
            tokens = split[old]
            number = tokens[field] if field else ""
            if not _CANONICAL.fullmatch(number):  # no number, or one written with a leading 0: a run of one
                keyed.append(("".join(tokens), "", d is not None, d or (), -1, old))
                continue
            prefix, suffix = "".join(tokens[:field]), "".join(tokens[field + 1 :])
            keyed.append((prefix, suffix, d is not None, d or (), int(number), old))
    keyed.sort(key=lambda k: (k[0], k[1], k[2], k[3], k[4] < 0, k[4]))
    runs: list[list] = []
    for prefix, suffix, has, d, number, _ in keyed:
        kind = (prefix, suffix, d if has else None)
        if runs and number >= 0 and runs[-1][3] >= 0 and tuple(runs[-1][:3]) == kind and sum(runs[-1][3:]) == number:
            runs[-1][4] += 1
        else:
            runs.append([prefix, suffix, d if has else None, number, 1])
    renumbered = np.empty(len(files), np.int64)
    renumbered[[k[5] for k in keyed]] = np.arange(len(files))
    arrays = {}
    arrays["run_prefixes"], arrays["run_prefix_ends"] = encode_names([r[0] for r in runs])
    arrays["run_suffixes"], arrays["run_suffix_ends"] = encode_names([r[1] for r in runs])
    arrays["run_start"] = np.array([r[3] for r in runs], np.int64)
    arrays["run_count"] = np.array([r[4] for r in runs], np.int64)
    header = {}
    if any(r[2] is not None for r in runs):
        header["run_descriptors"] = json.dumps([None if r[2] is None else list(r[2]) for r in runs])
    return arrays, header, renumbered


def _varying(split: Sequence[list[str]], members: Sequence[int]) -> int:
    """The token of the number that takes the most values among ``members`` (0: their names have none)."""
    fields = range(1, len(split[members[0]]), 2)
    return max(fields, key=lambda f: (len({split[m][f] for m in members}), f), default=0)


def decode(arrays: Mapping[str, np.ndarray], found: Mapping[str, Any], name: str) -> FileRuns:
    """The files of an index written by :func:`encode`, every run checked (``name``: the file, for messages).

    Raises:
        CorruptCheckpointError: naming ``name``: runs that do not fit their table, a
        count that is not positive or a number past what a name can hold, a run of one
        with a count, descriptors that do not fit the runs.
    """
    bad = complaint(name)
    prefixes = decode_names(arrays["run_prefixes"], arrays["run_prefix_ends"], name, "file")
    suffixes = decode_names(arrays["run_suffixes"], arrays["run_suffix_ends"], name, "file")
    start, count = arrays["run_start"], arrays["run_count"]
    if not len(prefixes) == len(suffixes) == len(start) == len(count):
        raise bad("its runs of file names do not fit their table")
    if len(count) and (count.min() < 1 or start.min() < -1 or count.astype(np.float64).sum() >= _MAX_FILES):
        raise bad("a run of file names has a count that is not positive, or too many files")
    last = start.astype(np.float64) + count  # float: int64 would wrap
    if len(start) and (((start < 0) & (count != 1)).any() or last.max() >= 10.0**18):
        raise bad("a run of file names has numbers no name holds")
    return FileRuns(prefixes, suffixes, start, count, _descriptors(found, len(count), bad))


def _descriptors(found: Mapping[str, Any], runs: int, bad: Any) -> list:
    if "run_descriptors" not in found:
        return [None] * runs
    try:
        listed = json.loads(found["run_descriptors"])
    except (TypeError, ValueError):
        listed = None
    fine = isinstance(listed, list) and len(listed) == runs
    fine = fine and all(d is None or (isinstance(d, list) and all(isinstance(s, str) for s in d)) for d in listed)
    if not fine:
        raise bad("its transform descriptors do not fit its runs of files")
    return [None if d is None else tuple(d) for d in listed]
