"""The interface between the Checkpointer and a storage format.

Call order on a save (every rank calls ``save``; the Checkpointer commits):
``save(ctx, flat)`` writes this rank's files into ``ctx.directory`` and returns their
names with size and checksum. On a load every rank calls ``load(ctx, flat, meta)``, which fills
``flat.tensors`` in place and returns the common and per-rank state it read.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from shardpoint.catalog.integrity import HashingWriter, without_zip_crc32
from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord
from shardpoint.errors import ShapeMismatchError
from shardpoint.parallel.topology import Topology
from shardpoint.state import naming
from shardpoint.state.train_state import FlatState
from shardpoint.storage.base import LocalStorage, Storage
from shardpoint.storage.safe_io import safe_torch_load

__all__ = [
    "CheckpointFormat",
    "FormatContext",
    "Loaded",
    "read_torch_file",
    "size_difference",
    "unexpected_keys",
    "wanted_keys",
    "wanted_summary",
    "write_file",
    "write_torch_file",
]


@dataclass
class FormatContext:
    """What a format needs to know about the save or load in progress."""

    storage: Storage
    directory: str
    topology: Topology
    strict: bool | str = True  # as the load's (LoadOptions.strict): True, False or "missing"
    thread_count: int = 1
    distributed_optimizer: bool = False
    process_group: Any = None  # for DCP's collectives; None: the control group (a dedicated one for async saves)
    optimizer_reshard: str = "error"  # per-rank state at another layout: "error" or "reinit" (see rank_local)
    rename: Any = None  # saved key -> current key on load: a mapping or a callable (see naming)
    verify: bool = False  # on load: check the checksums of the files a format checks while reading
    plan_cache: Any = None  # saves: the format's cache of the last plan (dist: formats.dist_replay), or None
    # saves: the replica check's verdict (state.replicas.ReplicaReport) when this save ran one: who writes what
    replicas: Any = None
    # loads: the pipeline's checks of the checkpoint's files, for a format whose load runs them in its first
    # agreement round (``checks_in_first_round``), to save a round; None: the pipeline ran them already
    checks: Callable[[], None] | None = None
    # loads: the pipeline's restore of what the read returned (optimizer shards, scheduler, RNG, stateful), for a
    # format whose load runs it as the last step of its last agreement round (``restores_in_last_round``), once
    # every tensor is in place: a failure on one rank then reaches every rank without a round of its own
    restore: Callable[[Loaded], None] | None = None
    # saves: the frozen items earlier checkpoints hold (formats.dedup.StoredItems), or None: write everything
    dedup: Any = None
    for_coordinator: Any = None  # saves: what this rank's save() leaves for the format's finish() on rank 0
    pending: dict[str, Any] = field(default_factory=dict)  # saves: the format's own state from save() to finish()


@dataclass
class Loaded:
    """What a format read besides the tensors it filled in place.

    ``per_rank`` is None when the per-rank state (RNG) could not be matched to
    this rank, e.g. after a change of layout.
    """

    common: dict[str, Any]
    per_rank: dict[str, Any] | None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    checked: set[str] = field(default_factory=set)  # files whose checksum this rank checked while reading
    bytes_read: int = 0  # bytes this rank read from the checkpoint's data files


class CheckpointFormat(Protocol):
    name: str

    def save(self, ctx: FormatContext, flat: FlatState) -> dict[str, FileRecord]:
        """Write this rank's part; return its files (relative to ``ctx.directory``) with size and checksum."""
        ...

    def fingerprint(self, ctx: FormatContext, flat: FlatState) -> str | None:
        """A digest of this rank's part of the structure, for replaying the last plan (None: never replayed)."""
        ...

    def finish(self, ctx: FormatContext, parts: list[Any]) -> dict[str, FileRecord]:
        """Rank 0, after every rank's ``save``: write what needs all of them (``parts``: each ``for_coordinator``)."""
        ...

    def load(self, ctx: FormatContext, flat: FlatState, meta: CheckpointMetadata) -> Loaded:
        """Fill ``flat.tensors`` in place and return the rest (every rank calls this)."""
        ...

    def files_read_by_all(self, meta: CheckpointMetadata) -> list[str]:
        """The files some rank of the job reads on load (the same list on every rank, so nothing is gathered)."""
        ...

    def checksummed_while_reading(self, meta: CheckpointMetadata) -> set[str]:
        """Files whose checksums ``load`` checks as it reads them (only their sizes are checked before)."""
        ...


def write_torch_file(obj: Any, path: str, storage: Storage | None = None) -> FileRecord:
    """``torch.save`` made durable (fsynced, or uploaded) before returning: the marker vouches for it.

    Returns the file's size and checksum, computed while writing.
    """
    with (storage or LocalStorage("/")).open_write(path) as raw, without_zip_crc32():
        writer = HashingWriter(raw)
        torch.save(obj, writer)  # type: ignore[arg-type]  # torch.save takes any writer; its stub says IO[bytes]
        writer.flush()
    return writer.record()


def write_file(data: bytes, path: str, storage: Storage | None = None) -> FileRecord:
    """``data`` written as it is, made durable before returning; its size and checksum, for the marker."""
    with (storage or LocalStorage("/")).open_write(path) as raw:
        writer = HashingWriter(raw)
        writer.write(data)
        writer.flush()
    return writer.record()


def read_torch_file(storage: Storage, path: str, mmap: bool = False) -> Any:
    """A weights-only load from any storage; local files may be memory-mapped (read lazily)."""
    if storage.is_local:
        return safe_torch_load(path, mmap=mmap)
    return safe_torch_load(io.BytesIO(storage.read_bytes(path)), name=path)


def unexpected_keys(saved: set[str], wanted: set[str]) -> list[str]:
    """Saved keys nobody asked for, among the parts that were asked for at all.

    Loading without the optimizer leaves every ``optimizer.*`` key unasked; that is a
    choice, not a mismatch, so only parts (``model``, ``optimizer``) that were asked
    for can hold unexpected keys. Rank-local copies are placed by
    :func:`shardpoint.state.rank_local.resolve`, which decides what each rank reads of them.
    """
    asked_parts = {k.split(".", 1)[0] for k in wanted}
    return sorted(
        k for k in saved - wanted if k.split(".", 1)[0] in asked_parts and not k.startswith(naming.RANK_LOCAL_PREFIX)
    )


def wanted_summary(keys: Iterable[str], saved: Sequence[str]) -> tuple[bytes, list[str]]:
    """The keys one rank wants, as it tells the others: one bit per saved key, and the keys not saved.

    Every rank receives every rank's summary. As key names that is the whole model's
    names from every rank (hundreds of MB at thousands of ranks); as bits over the
    saved keys (``saved``: sorted, the same on every rank) it is a few hundred bytes each.
    """
    at = {key: i for i, key in enumerate(saved)}
    bits = np.zeros(len(saved), dtype=np.bool_)
    missing = []
    for key in keys:
        i = at.get(key)
        if i is None:
            missing.append(key)
        else:
            bits[i] = True
    return np.packbits(bits).tobytes(), sorted(missing)


def wanted_keys(summaries: Iterable[tuple[bytes, list[str]]], saved: Sequence[str]) -> set[str]:
    """Every key some rank wants, from their :func:`wanted_summary`."""
    union = np.zeros((len(saved) + 7) // 8, dtype=np.uint8)
    missing: set[str] = set()
    for bits, absent in summaries:
        union |= np.frombuffer(bits, dtype=np.uint8)
        missing.update(absent)
    wanted = np.flatnonzero(np.unpackbits(union, count=len(saved)))
    return {saved[i] for i in wanted.tolist()} | missing


def size_difference(what: str) -> ShapeMismatchError:
    """The error for a saved tensor whose size differs from the model's at the same layout.

    A size difference is not damage (the checksums say whether bytes are): it is named as
    what it is, with its two usual causes, in every format.
    """
    return ShapeMismatchError(
        f"{what}; the model's tensor has another size than the saved one (its config differs, or a module "
        "whose state changes size on load, which an in-place load cannot resize)"
    )
