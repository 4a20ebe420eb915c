"""A file the integration commits beside a checkpoint, read back only as the marker lists it.

The marker is the checkpoint's ``shardpoint.json``, or, in a node-local tier's copy of
one rank (its own, a replica, or one fetched from a peer), that copy's
``shardpoint-local.json``: the tier writes, replicates and fetches every file it lists.
"""

from __future__ import annotations

import os

import xxhash

from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata, FileRecord
from shardpoint.errors import CorruptCheckpointError
from shardpoint.tier.marker import LOCAL_MARKER, LocalMarker

__all__ = ["read_checked"]


def read_checked(found: str, name: str, purpose: str) -> bytes | None:
    """The bytes of ``found/name`` checked against the marker's size and XXH3 (invariant 16).

    None when the marker does not list it, or ``found`` has no marker.

    Raises:
        CorruptCheckpointError: the file differs from what was saved, naming it and ``purpose``.
    """
    record = _listed(found).get(name)
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


def _listed(found: str) -> dict[str, FileRecord]:
    """The files the marker of ``found`` lists: a persistent checkpoint's, else a local-tier copy's; {} without."""
    for name, parse in ((MARKER_NAME, CheckpointMetadata.from_json), (LOCAL_MARKER, LocalMarker.from_json)):
        marker = os.path.join(found, name)
        if os.path.isfile(marker):
            with open(marker, "rb") as f:
                return dict(parse(f.read(), marker).files)
    return {}
