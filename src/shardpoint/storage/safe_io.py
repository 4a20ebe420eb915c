"""Reading files from a checkpoint without ever running code from them.

``pickle`` can call any importable function while loading, so a checkpoint from a
stranger could run anything. Every pickle shardpoint reads goes through one of two
doors:

* ``torch.load(weights_only=True)`` for ``.pt`` files: tensors, containers and
  numbers only;
* :class:`RestrictedUnpickler` for DCP's ``.metadata``, which allows exactly the
  dataclasses DCP stores there and nothing else;
* :func:`load_plain_pickle` for pickles that other libraries store as bytes and
  unpickle themselves (torchtitan's data loader state): plain containers, numbers,
  strings and tensors only.

Anything else raises :class:`~shardpoint.errors.UnsafeCheckpointError` before a
single object is built.
"""

from __future__ import annotations

import gc
import io
import pickle
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardpoint.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["RestrictedUnpickler", "load_dcp_metadata", "load_plain_pickle", "paused_gc", "safe_torch_load"]

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: set[tuple[str, str]] = {
    (_DCP_META, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_DTYPES = {str(dt).removeprefix("torch.") for dt in vars(torch).values() if isinstance(dt, torch.dtype)}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds only DCP metadata classes, dtypes and plain data."""

    def __init__(self, file: Any, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.where} asks to load {module}.{name}, which a checkpoint never needs; refusing to load it "
            "(the file may have been crafted to run code). Use a checkpoint from a trusted source."
        )


def load_dcp_metadata(data: bytes, where: str, unpickler: type[RestrictedUnpickler] | None = None) -> Any:
    """Unpickle DCP's ``.metadata`` with :class:`RestrictedUnpickler` (or a stricter-or-wider subclass)."""
    try:
        with paused_gc():
            return (unpickler or RestrictedUnpickler)(io.BytesIO(data), where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CorruptCheckpointError(
            f"{where} cannot be read ({type(exc).__name__}: {exc}); the file is damaged"
        ) from None


def _tensor_storage_from_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` (which uses ``weights_only=False``), weights-only."""
    return safe_torch_load(io.BytesIO(data), name="a tensor inside a stored pickle")


class _PlainDataUnpickler(pickle.Unpickler):
    """Dicts, lists, tuples, sets, numbers, strings, bytes and tensors: what a stateful data loader holds."""

    _REPLACED = {("torch.storage", "_load_from_bytes"): _tensor_storage_from_bytes}
    _ALLOWED = {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def __init__(self, file: Any, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._REPLACED:
            return self._REPLACED[(module, name)]
        if (module, name) in self._ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.where} is a pickle that asks for {module}.{name}; stored state may hold only containers, "
            "numbers, strings and tensors, so shardpoint refuses to load it (the file may have been crafted to "
            "run code). Use a checkpoint from a trusted source."
        )


def load_plain_pickle(data: bytes, where: str) -> Any:
    """Unpickle bytes that hold plain data only (containers, numbers, strings, tensors), else refuse.

    Some libraries store their state as a pickle inside the checkpoint and call
    ``pickle.loads`` on it themselves; this checks such bytes first, and whoever hands
    them on should hand on a fresh pickle of the result, never the stored bytes.

    Raises:
        UnsafeCheckpointError: the pickle names any other class or function.
        CorruptCheckpointError: the bytes are not a complete pickle.
    """
    try:
        return _PlainDataUnpickler(io.BytesIO(data), where).load()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as exc:  # noqa: BLE001 - any other unpickling failure means damaged bytes
        raise CorruptCheckpointError(
            f"{where} cannot be unpickled ({type(exc).__name__}: {_first_line(exc)}); the stored bytes are damaged"
        ) from None


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while DCP builds many small objects.

    DCP's plans and metadata hold thousands of objects per save or load (pickled,
    gathered, unpickled); creating them triggers full collections over the whole
    training process's heap: 0.1 s per metadata read for 1,200 items in a 4-rank job,
    15x the unpickling itself. Reference counting still frees everything at once; only
    cycles wait until the block ends.

    Only the main thread pauses it: a background (async) save must not hold collection
    off the training code for as long as it writes or uploads.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def safe_torch_load(source: Any, *, mmap: bool = False, name: str | None = None) -> Any:
    """``torch.load(weights_only=True)`` of a path or binary file, with errors that say which file and why."""
    where = name or str(source)
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where} contains objects that weights-only loading refuses ({_first_line(exc)}); shardpoint never "
            "unpickles arbitrary classes. If you trust this file, convert it with the tool that made it."
        ) from None
    except Exception as exc:  # noqa: BLE001 - damaged bytes make the unpickler raise anything (IndexError, KeyError...)
        raise CorruptCheckpointError(
            f"{where} cannot be read ({type(exc).__name__}: {_first_line(exc)}); the file is damaged or truncated"
        ) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
