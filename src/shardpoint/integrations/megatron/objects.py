"""megatron-core's ``ShardedObject`` values (Transformer Engine's ``_extra_state``), never unpickled unrestricted.

A ``ShardedObject`` is no tensor: a module's ``get_extra_state()`` (TE's FP8 scaling
metadata), one per layer, replicated across tensor- and data-parallel ranks. Megatron
keys it by ``<key>/shard_<global offset>_<global shape>`` (its ``unique_key``: the layer
axis of stacked layers, and the expert axis, in the offset), which is the same at any
tp/pp/dp, so a resume at another layout finds each layer's object.

A save serialises each object its main replica holds with ``torch.save`` and gathers
them on rank 0 into one file, :data:`OBJECTS_FILE`, committed with the checkpoint and
listed in the marker with its size and checksum. A load reads it back checked against
the marker and unpickles with ``weights_only=True`` only (tensors, numbers, strings and
containers of them; any other class is refused by name), then hands each object to its
module's ``set_extra_state`` through the chunk's ``load_state_dict``, as Megatron's own
load does.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import torch

from shardpoint.errors import CorruptCheckpointError, MissingKeysError
from shardpoint.storage.safe_io import safe_torch_load

from .checked_file import read_checked

__all__ = ["OBJECTS_FILE", "encode", "encode_rank", "restore", "saved_objects"]

log = logging.getLogger(__name__)

OBJECTS_FILE = "megatron_objects.pt"


def sharded_objects(chunks: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, str, Any]]:
    """``(chunk, its state-dict key, ShardedObject)`` for every object of the model chunks."""
    found = []
    for chunk in chunks:
        megatron_module: Any = chunk  # a MegatronModule; torch's Module type does not know the method
        for local, value in megatron_module.sharded_state_dict().items():
            if type(value).__name__ == "ShardedObject":
                found.append((chunk, local, value))
    return found


def _is_main(replica_id: Any) -> bool:
    return all(r == 0 for r in replica_id) if isinstance(replica_id, tuple) else replica_id == 0


def encode(chunks: list[torch.nn.Module], own: dict[str, bytes] | None = None) -> bytes | None:
    """Every rank: serialise the objects this rank holds the main replica of; rank 0 gets the file's bytes.

    ``own``: this rank's further entries, already serialised (its rerun state, see
    :mod:`.rerun`). A collective over the default group (every rank calls it); None on
    other ranks, and on rank 0 when there is nothing to store.
    """
    mine = {**_serialised(chunks, main_only=True), **(own or {})}
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)  # bytes between this job's own processes
    if torch.distributed.get_rank() != 0:
        return None
    return _table({k: v for part in everyone for k, v in part.items()})


def encode_rank(chunks: list[torch.nn.Module], own: dict[str, bytes] | None = None) -> bytes | None:
    """This rank's table for its node-local tier copy: every object it holds (main replica or not) and ``own``.

    No collective: a local-tier copy restores only the rank that wrote it, at the same layout.
    """
    return _table({**_serialised(chunks, main_only=False), **(own or {})})


def _serialised(chunks: list[torch.nn.Module], main_only: bool) -> dict[str, bytes]:
    mine = {}
    for _, _, obj in sharded_objects(chunks):
        if not main_only or _is_main(obj.replica_id):
            buffer = io.BytesIO()
            torch.save(obj.data, buffer)
            mine[obj.unique_key] = buffer.getvalue()
    return mine


def _table(entries: dict[str, bytes]) -> bytes | None:
    if not entries:
        return None
    buffer = io.BytesIO()
    torch.save(dict(sorted(entries.items())), buffer)
    return buffer.getvalue()


def saved_objects(checkpoint: str) -> dict[str, Any] | None:
    """The objects saved with ``checkpoint`` by Megatron's unique key; None when it has no table.

    Both the table and each object are unpickled weights-only (tensors, numbers, strings
    and containers of them).

    Raises:
        CorruptCheckpointError: the file differs from what was saved (size or checksum), or is no table.
        UnsafeCheckpointError: it holds a class weights-only unpickling refuses (named with its key).
    """
    path = os.path.join(checkpoint, OBJECTS_FILE)
    raw = read_checked(checkpoint, OBJECTS_FILE, "restoring the modules' extra state (ShardedObject)")
    if raw is None:
        return None
    table = safe_torch_load(io.BytesIO(raw), name=path)
    if not isinstance(table, dict) or not all(isinstance(v, bytes) for v in table.values()):
        raise CorruptCheckpointError(f"{path} is not a table of serialised objects; the file is damaged")
    return {key: safe_torch_load(io.BytesIO(value), name=f"{path}: {key}") for key, value in table.items()}


def restore(chunks: list[torch.nn.Module], checkpoint: str, strict: bool, saved: dict[str, Any] | None) -> int:
    """Give each module its saved object (``set_extra_state``); returns how many were restored.

    ``saved``: :func:`saved_objects` of ``checkpoint`` (read once by the caller).

    Raises:
        CorruptCheckpointError, UnsafeCheckpointError: see :func:`saved_objects`.
        MissingKeysError: ``strict`` and an object this job asks for is not in the saved table
            (a checkpoint without the table, imported or older, leaves every module as built).
    """
    wanted = sharded_objects(chunks)
    if not wanted:
        return 0
    if saved is None:  # imported by `convert --from megatron`, or saved before objects were stored: kept as built
        log.info("megatron: %s holds no extra state (ShardedObject); the modules keep theirs", checkpoint)
        return 0
    missing = sorted(obj.unique_key for _, _, obj in wanted if obj.unique_key not in saved)
    if missing and strict:  # named as a strict load names tensors (--dist-ckpt-strictness log_all skips them)
        raise MissingKeysError(checkpoint, [f"model.{k}" for k in missing], [])
    if missing:
        log.warning("megatron: no saved extra state for %s; kept as built", ", ".join(missing[:5]))
    values: dict[int, tuple[torch.nn.Module, dict[str, Any]]] = {}
    for chunk, local, obj in wanted:
        if obj.unique_key in saved:
            values.setdefault(id(chunk), (chunk, {}))[1][local] = saved[obj.unique_key]
    for chunk, chunk_values in values.values():  # one call per chunk: megatron-core's linear layers give
        chunk.load_state_dict(chunk_values, strict=False)  # an extra state absent from the dict None
    return len(wanted) - len(missing)
