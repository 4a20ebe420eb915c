"""Files that other checkpoints refer to: what deleting a checkpoint must keep.

A save that stores a frozen tensor once (:mod:`shardpoint.formats.dedup`) lists, in
its marker, files of the earlier checkpoint that wrote those bytes
(``../iter_0000010/__0_0.distcp``). Retention may still retire ``iter_0000010``: it
stops being a checkpoint at once (its marker goes), but the files others refer to stay
in its directory, which is then *held*: it holds :data:`HELD_NOTE` and no marker, is
never listed or loaded, and is emptied and removed once nothing refers to it.

Every step is safe to die after, since the marker's presence is what decides:

1. the note is written (atomically) while the marker is still there: still a checkpoint;
2. the marker is removed: held, every file still present;
3. the files no one refers to are deleted, one at a time: held, the referred ones intact.

A later retention run (:func:`held_dirs`) finishes whatever step 3 left, and removes
the directory once its last referrer is gone. Who refers to what is read from the
markers each time, never stored apart from them, so it cannot go stale.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict

from shardpoint.catalog.metadata import HELD_NOTE, MARKER_NAME, CheckpointMetadata, referred_dir
from shardpoint.errors import CorruptCheckpointError
from shardpoint.lifecycle import faults
from shardpoint.storage.base import Storage

__all__ = ["HELD_NOTE", "held_dirs", "hold", "is_held", "referred_files"]

log = logging.getLogger(__name__)


def referred_files(storage: Storage, root: str, name: str) -> dict[str, list[str]]:
    """The files of ``root/name`` that committed checkpoints beside it refer to: file -> their names.

    Only filesystems are looked at: references are written only to local saves (object
    stores do not resolve ``../`` in a key).
    """
    if not storage.supports_rename or not storage.is_dir(root):
        return {}
    referred: dict[str, list[str]] = defaultdict(list)
    for other in storage.listdir(root):
        meta = _marker(storage, storage.join(root, other)) if other != name and not other.startswith(".") else None
        for file in meta.files if meta is not None else ():
            if referred_dir(file) == name:
                referred[file.split("/", 2)[2]].append(other)
    return dict(referred)


def hold(storage: Storage, root: str, name: str, keep: dict[str, list[str]]) -> None:
    """Retire ``root/name`` but keep the files in ``keep`` (see the module docstring for the order)."""
    path = storage.join(root, name)
    referrers = sorted({r for names in keep.values() for r in names})
    storage.write_atomic(storage.join(path, HELD_NOTE), json.dumps({"referred_by": referrers}).encode())
    storage.remove(storage.join(path, MARKER_NAME))
    faults.hit("mid-retention", 0)
    removed = _prune(storage, path, "", set(keep))
    log.info("retired %s, keeping %d file(s) that %s refer to (%d removed)", path, len(keep), referrers, removed)


def is_held(storage: Storage, path: str) -> bool:
    """A retired checkpoint kept for the files others refer to: never a checkpoint itself."""
    return storage.exists(storage.join(path, HELD_NOTE)) and not storage.exists(storage.join(path, MARKER_NAME))


def held_dirs(storage: Storage, root: str) -> list[str]:
    """The names of the held directories under ``root``."""
    if not storage.supports_rename or not storage.is_dir(root):
        return []
    return [n for n in storage.listdir(root) if not n.startswith(".") and is_held(storage, storage.join(root, n))]


def _prune(storage: Storage, path: str, prefix: str, keep: set[str]) -> int:
    """Delete every file under ``path`` not in ``keep`` (names relative to the checkpoint); count them."""
    removed = 0
    for entry in storage.listdir(path):
        rel, full = f"{prefix}{entry}", storage.join(path, entry)
        if rel == HELD_NOTE or rel in keep:
            continue
        if storage.is_dir(full):
            removed += _prune(storage, full, f"{rel}/", keep)
            if not storage.listdir(full):
                storage.remove(full)
            continue
        storage.remove(full)
        removed += 1
    return removed


def _marker(storage: Storage, path: str) -> CheckpointMetadata | None:
    marker = storage.join(path, MARKER_NAME)
    if not storage.exists(marker):
        return None
    try:
        return CheckpointMetadata.from_json(storage.read_bytes(marker), marker)
    except CorruptCheckpointError:
        return None  # a damaged marker is no checkpoint; it keeps nothing alive
