"""The Hugging Face weights layout: safetensors headers, ``model.safetensors.index.json``, byte ranges.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and ``data_offsets`` (relative to the end of the header), then the
raw tensor bytes. That is all a sharded reader needs: with the header, any box of any
tensor is a known set of byte ranges, read without touching the rest of the file. So
the header is parsed here rather than through ``safetensors.safe_open``, which needs a
local file to ``mmap`` and cannot read object storage (``s3://``, ``gs://``, ``az://``).

The checks are the ones that let a damaged file be named rather than half-loaded: a
header length beyond the file, a header that is not JSON, an unknown dtype, offsets
that disagree with the shape or overlap, and data that ends past the end of the file
(a truncated download). Safetensors has no checksums: a flipped byte inside tensor
data cannot be detected by any reader.

Writing: :func:`encode_header` gives the header bytes of a file whose tensors are then
written in order, one at a time (``safetensors.torch.save_file`` needs every tensor of
a file in memory at once, 5 GB per file by default); :func:`plan_files` splits tensors
into files as ``transformers``' ``save_pretrained`` does, and :func:`index_json` writes
the index it reads.
"""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardpoint.catalog.untrusted_json import check_member_name, parse_json_object
from shardpoint.errors import CorruptCheckpointError, StorageError
from shardpoint.storage.base import Storage
from shardpoint.storage.object_store import ObjectStorage

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "RangeReader",
    "StoredTensor",
    "encode_header",
    "file_names",
    "index_json",
    "parse_header",
    "parse_index",
    "parse_size",
    "plan_files",
    "read_header",
    "safetensors_dtype",
]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
MAX_HEADER = 100_000_000  # safetensors' own limit on the header length

_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in (
        ("BOOL", torch.bool),
        ("U8", torch.uint8),
        ("I8", torch.int8),
        ("I16", torch.int16),
        ("U16", getattr(torch, "uint16", None)),
        ("I32", torch.int32),
        ("U32", getattr(torch, "uint32", None)),
        ("I64", torch.int64),
        ("U64", getattr(torch, "uint64", None)),
        ("F16", torch.float16),
        ("BF16", torch.bfloat16),
        ("F32", torch.float32),
        ("F64", torch.float64),
        ("F8_E4M3", getattr(torch, "float8_e4m3fn", None)),
        ("F8_E5M2", getattr(torch, "float8_e5m2", None)),
    )
    if dtype is not None
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_SIZE_UNITS = {
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: ``file`` (relative to the directory), from byte ``start``."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file of element 0
    nbytes: int


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (``F32``, ``BF16``, ...); ValueError if safetensors cannot store it."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"safetensors cannot store {dtype}") from None


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string as ``transformers`` takes it ("5GB" = 5·10⁹, "500MiB" = 500·2²⁰)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", str(size))
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be bytes or a size such as '5GB' or '500MiB', got {size!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_header(raw: bytes, name: str, file_size: int, where: str | None = None) -> dict[str, StoredTensor]:
    """The tensors of safetensors file ``name`` from its header JSON ``raw``, checked against ``file_size``.

    ``where``: the file's full path, for messages (default ``name``).

    Raises:
        CorruptCheckpointError: naming ``name`` and what is wrong with it.
    """
    data_start, file, name = 8 + len(raw), name, where or name
    header = parse_json_object(raw, name, "safetensors header")
    tensors = {
        key: _entry(file, name, key, value, data_start) for key, value in header.items() if key != "__metadata__"
    }
    end = data_start
    # by (start, end): a zero-size tensor may share its start with the next one (safetensors accepts that)
    for key, tensor in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].start + kv[1].nbytes)):
        if tensor.start < end:
            raise CorruptCheckpointError(f"{name}: tensor {key!r} overlaps the one before it; the header is damaged")
        end = tensor.start + tensor.nbytes
    if end > file_size:
        last = max(tensors, key=lambda k: tensors[k].start + tensors[k].nbytes)
        raise CorruptCheckpointError(
            f"{name} is truncated: its header places tensor {last!r} up to byte {end}, but the file has "
            f"{file_size} bytes; download or copy the file again"
        )
    return tensors


def _entry(file: str, name: str, key: str, value: Any, data_start: int) -> StoredTensor:
    try:
        dtype = _DTYPES[value["dtype"]]
        shape = tuple(value["shape"])
        begin, end = value["data_offsets"]
        valid = all(isinstance(s, int) and s >= 0 for s in shape) and isinstance(begin, int) and isinstance(end, int)
    except KeyError as exc:
        what = f"dtype {value.get('dtype')!r}" if isinstance(value, dict) and "dtype" in value else f"field {exc}"
        raise CorruptCheckpointError(f"{name}: tensor {key!r} has an unknown or missing {what}") from None
    except (TypeError, ValueError):
        valid = False
    nbytes = math.prod(shape) * dtype.itemsize if valid else -1
    if not valid or begin < 0 or end - begin != nbytes:
        raise CorruptCheckpointError(
            f"{name}: tensor {key!r} has inconsistent shape and data_offsets ({value!r}); the header is damaged"
        )
    return StoredTensor(file, dtype, shape, data_start + begin, nbytes)


def parse_index(raw: bytes, name: str) -> dict[str, str]:
    """``{tensor name: file name}`` from a ``model.safetensors.index.json``.

    Raises:
        CorruptCheckpointError: not a JSON object with a ``weight_map`` of file names inside the
            index's own directory (``""``, NUL, absolute paths and ``..`` are refused by name).
    """
    weight_map = parse_json_object(raw, name, "safetensors index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{name} is not a valid safetensors index (no weight_map object); it is damaged")
    for file in weight_map.values():
        check_member_name(file, name)
    return weight_map


def encode_header(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for tensors stored in this order, and each tensor's data offset.

    The JSON is padded with spaces to a multiple of 8 bytes, as safetensors' writer does, so
    tensor data starts aligned.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, position = [], 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {
            "dtype": safetensors_dtype(dtype),
            "shape": list(shape),
            "data_offsets": [position, position + nbytes],
        }
        offsets.append(position)
        position += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


def plan_files(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names split into files of at most ``max_bytes``, in order, as ``save_pretrained`` splits them.

    A tensor larger than ``max_bytes`` gets a file of its own.
    """
    files: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for key, nbytes in sizes:
        if nbytes > max_bytes:
            files.append([key])
            continue
        if current and current_size + nbytes > max_bytes:
            files.append(current)
            current, current_size = [], 0
        current.append(key)
        current_size += nbytes
    if current:
        files.append(current)
    return files


def file_names(count: int) -> list[str]:
    """``model.safetensors`` for one file, else ``model-00001-of-0000N.safetensors``, ..."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_json(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


class RangeReader:
    """Reads byte ranges of the files in one directory, counting every byte it returns.

    Local files are mapped (:meth:`view`, as ``safe_open`` does): a range is copied once,
    from the page cache into its destination, and only its pages are read; reading into
    a buffer first cost twice the time (a second copy, and faults on the fresh buffer).
    On object storage each range is one ranged GET (:meth:`read_into`, ``cat_ranges``,
    concurrent within a call): s3fs's buffered file would read ahead a whole block (64 MB)
    past every range, so ranks sharing a file would fetch each other's bytes.
    """

    def __init__(self, storage: Storage, directory: str):
        self.storage, self.directory = storage, directory
        self.bytes_read = 0
        self._files: dict[str, io.BufferedIOBase] = {}
        self._maps: dict[str, torch.Tensor] = {}

    def view(self, name: str, start: int, length: int) -> torch.Tensor | None:
        """Bytes ``[start, start + length)`` of a local file as a mapped ``uint8`` tensor; None on object storage."""
        if not self.storage.is_local:
            return None
        whole = self._maps.get(name)
        if whole is None:
            size = self.size(name)
            try:
                whole = torch.from_file(self.path(name), shared=False, size=size, dtype=torch.uint8)
            except RuntimeError as exc:
                raise StorageError(f"mapping {self.path(name)} failed: {exc}") from exc
            self._maps[name] = whole
        self._check_length(name, start, max(0, min(length, whole.numel() - start)), length)
        self.bytes_read += length
        return whole[start : start + length]

    def path(self, name: str) -> str:
        return self.storage.join(self.directory, name)

    def size(self, name: str) -> int:
        try:
            return self.storage.size(self.path(name))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.path(name)} is missing; the checkpoint is incomplete") from None

    def read_bytes(self, name: str, start: int, length: int) -> bytes:
        out = torch.empty(length, dtype=torch.uint8)
        self.read_into([(name, start, out)])
        return out.numpy().tobytes()

    def read_into(self, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        """Fill each 1-D ``uint8`` CPU tensor ``out`` with the bytes of file ``name`` from ``start``."""
        requests = [r for r in requests if r[2].numel()]
        if isinstance(self.storage, ObjectStorage):
            self._read_ranges(self.storage, requests)
        else:
            for name, start, out in requests:
                self._read_local(name, start, out)
        self.bytes_read += sum(out.numel() for _, _, out in requests)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._maps.clear()  # a mapping goes with the last view of it

    def _read_local(self, name: str, start: int, out: torch.Tensor) -> None:
        f = self._files.get(name)
        try:
            if f is None:
                f = self._files[name] = self.storage.open_read(self.path(name))
            f.seek(start)
            view, done = out.numpy(), 0
            while done < len(view):
                got = f.readinto(view[done:].data)
                if not got:
                    break
                done += got
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.path(name)} is missing; the checkpoint is incomplete") from None
        except OSError as exc:
            raise StorageError(f"reading {self.path(name)} failed: {exc}") from exc
        self._check_length(name, start, done, len(view))

    def _read_ranges(self, store: ObjectStorage, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        if not requests:
            return
        paths = [self.path(name) for name, _, _ in requests]
        starts = [start for _, start, _ in requests]
        ends = [start + out.numel() for _, start, out in requests]
        try:
            blobs = store.fs.cat_ranges(paths, starts, ends, on_error="raise")
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(
                f"{exc.filename or sorted(set(paths))} is missing; the checkpoint is incomplete"
            ) from None
        except Exception as exc:
            raise StorageError(
                f"object storage reads of {sorted(set(paths))[:3]} failed after retries ({type(exc).__name__}: "
                f"{str(exc)[:200]}); check the endpoint (AWS_ENDPOINT_URL), credentials and bucket"
            ) from exc
        for (name, start, out), blob in zip(requests, blobs):
            self._check_length(name, start, len(blob), out.numel())
            out.numpy()[:] = np.frombuffer(blob, dtype=np.uint8)

    def _check_length(self, name: str, start: int, got: int, wanted: int) -> None:
        if got != wanted:
            raise CorruptCheckpointError(
                f"{self.path(name)} is truncated: {wanted} bytes wanted from byte {start}, only {got} there; "
                "download or copy the file again"
            )


def read_header(reader: RangeReader, name: str) -> dict[str, StoredTensor]:
    """The tensors of file ``name`` (two small reads: the length, then the header).

    Raises:
        CorruptCheckpointError: the file is missing, too short, or its header is damaged.
    """
    size = reader.size(name)
    where = reader.path(name)
    if size < 8:
        raise CorruptCheckpointError(f"{where} has {size} bytes, too few for a safetensors file; it is damaged")
    length = int.from_bytes(reader.read_bytes(name, 0, 8), "little")
    if length > MAX_HEADER or 8 + length > size:
        raise CorruptCheckpointError(
            f"{where}: the safetensors header length {length} exceeds the file's {size} bytes; the file is "
            "truncated or not safetensors"
        )
    return parse_header(reader.read_bytes(name, 8, length), name, size, where)
