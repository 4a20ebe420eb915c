"""A file the integration commits beside a checkpoint, read back only as the marker lists it."""

from __future__ import annotations

import os

import xxhash

from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.errors import CorruptCheckpointError

__all__ = ["read_checked"]


def read_checked(found: str, name: str, purpose: str) -> bytes | None:
    """The bytes of ``found/name`` checked against the marker's size and XXH3 (invariant 16).

    None when the marker does not list it, or ``found`` has no marker (a local tier's copy).

    Raises:
        CorruptCheckpointError: the file differs from what was saved, naming it and ``purpose``.
    """
    marker = os.path.join(found, MARKER_NAME)
    if not os.path.isfile(marker):  # a node-local tier's copy: the integration's files are not in it
        return None
    with open(marker, "rb") as f:
        meta = CheckpointMetadata.from_json(f.read(), marker)
    record = meta.files.get(name)
    if record is None:
        return None
    with open(os.path.join(found, name), "rb") as f:
        raw = f.read(record.size + 1)
    if len(raw) != record.size or xxhash.xxh3_64(raw).hexdigest() != record.xxh3_64:
        raise CorruptCheckpointError(
            f"{os.path.join(found, name)} differs from what was saved (size {len(raw)}, expected {record.size}, "
            f"or its checksum) while {purpose}: it is damaged; load another checkpoint"
        )
    return raw
