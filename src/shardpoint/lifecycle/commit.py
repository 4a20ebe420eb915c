"""The commit protocol: when a checkpoint starts to exist.

A save goes through three states, and only the last one is ever loaded:

1. **partial** — ranks write into ``.shardpoint-tmp-<name>-<token>/`` beside the
   final directory. A crash here leaves a directory no reader looks at; the next
   Checkpointer start removes it. On object storage (no rename) ranks write under
   the final prefix, after rank 0 has put an in-progress object
   (``.shardpoint-in-progress``, naming the save) there: only prefixes holding it are
   ever removed as leftovers, so checkpoints of other tools (Megatron-LM, GPT-NeoX)
   in the same bucket are never touched.
2. **committed** — rank 0 writes ``shardpoint.json`` (the marker, listing every file
   with size and checksum) into the temporary directory, fsyncs, and renames the
   directory to its final name. A directory is a checkpoint if and only if it holds
   a valid marker, so a reader never needs the rename to be atomic with the data.
3. **latest** — only then is the tracker file replaced (temp file, fsync,
   ``os.replace``, fsync of the directory). Killing any rank at any moment leaves
   the tracker naming the previous committed checkpoint.

Both a rename and a marker exist for the reason Orbax gives in ``atomicity.py``:
the rename keeps half-written directories out of listings on filesystems, the
marker is what object stores (which cannot rename) rely on.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass

from shardpoint.catalog.layout import LAYOUTS, RELEASE, Layout
from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.errors import CheckpointError, ConcurrentSaveError, CorruptCheckpointError
from shardpoint.lifecycle import faults, references
from shardpoint.storage.base import Storage, refuse_foreign

__all__ = [
    "CheckpointEntry",
    "begin",
    "clean_leftovers",
    "detect_layout",
    "list_checkpoints",
    "publish",
    "read_marker",
    "read_tracker",
    "retire",
    "write_marker",
    "write_tracker",
]

log = logging.getLogger(__name__)

TMP_PREFIX = ".shardpoint-tmp-"
TRASH_PREFIX = ".shardpoint-trash-"
IN_PROGRESS_NAME = ".shardpoint-in-progress"


@dataclass(frozen=True)
class CheckpointEntry:
    """A directory found under the root: committed when it has a readable marker."""

    name: str
    path: str
    iteration: int | None  # None: release
    meta: CheckpointMetadata | None
    problem: str | None = None

    @property
    def committed(self) -> bool:
        return self.meta is not None


def begin(storage: Storage, root: str, final_name: str) -> str:
    """Create and return the directory ranks write into (rank 0).

    On storage that can rename, a fresh temporary directory. On object storage,
    the final prefix itself: a save of an iteration that already exists there first
    removes the old objects, so no stale file can sit beside the new marker.
    """
    storage.makedirs(root)
    if not storage.supports_rename:
        final = storage.join(root, final_name)
        if storage.exists(final):
            if not _started_by_shardpoint(storage, final):
                raise CheckpointError(
                    f"{final} exists and was not written by shardpoint (no {MARKER_NAME}, no {IN_PROGRESS_NAME}); "
                    "shardpoint never overwrites another tool's checkpoint: save under another prefix"
                )
            log.warning("replacing existing %s", final)
            storage.remove(final)
        note = {"save": final_name, "token": secrets.token_hex(4), "started": time.time()}
        storage.write_atomic(storage.join(final, IN_PROGRESS_NAME), json.dumps(note).encode())
        return final
    refuse_foreign(storage, storage.join(root, final_name))  # before any byte: another tool's data stays
    _refuse_referred(storage, root, final_name)
    tmp = storage.join(root, f"{TMP_PREFIX}{final_name}-{secrets.token_hex(4)}")
    storage.makedirs(tmp)
    return tmp


def publish(storage: Storage, tmp: str, final: str, meta: CheckpointMetadata) -> None:
    """Write the marker into ``tmp`` and move it to ``final``: the checkpoint now exists."""
    write_marker(storage, tmp, meta.to_json().encode())
    storage.publish_dir(tmp, final)
    _drop_in_progress(storage, final)


def write_marker(storage: Storage, directory: str, data: bytes) -> None:
    """Write ``directory``'s marker; on object storage create-only, so that one of two writers commits.

    Locally the directory is private until it is renamed into place. On object storage
    the prefix is the final one: a second job saving the same iteration there would
    otherwise overwrite the first one's marker and both would believe they committed.
    A create that fails because a retried request of this save had already landed is
    recognised by the marker's bytes.

    Raises:
        ConcurrentSaveError: another writer committed ``directory`` first; nothing of this save is committed
            (and what the other writer committed must not be removed as this save's leftovers).
    """
    path = storage.join(directory, MARKER_NAME)
    if storage.supports_rename:
        storage.write_atomic(path, data)
        return
    try:
        storage.write_new(path, data)
    except FileExistsError:
        if storage.read_bytes(path) == data:
            return
        raise ConcurrentSaveError(
            f"{directory} was committed by another writer while this save was writing it (its {MARKER_NAME} "
            "appeared first); this save is not committed and the tracker was not moved by it. Two jobs are saving "
            "into the same directory: give each its own"
        ) from None


def write_tracker(storage: Storage, root: str, layout: Layout, iteration: int | None) -> None:
    """Point the tracker at ``iteration`` (None: release), atomically and durably."""
    storage.write_atomic(storage.join(root, layout.tracker_name), layout.tracker_text(iteration).encode())


def read_tracker(storage: Storage, root: str, layout: Layout) -> tuple[bool, int | None]:
    """``(found, iteration)``; iteration None with found=True means release."""
    path = storage.join(root, layout.tracker_name)
    if not storage.exists(path):
        return False, None
    if storage.is_dir(path):
        raise CorruptCheckpointError(f"tracker {path} is a directory; remove it or point load() at the right root")
    data = storage.read_bytes(path)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise CorruptCheckpointError(
            f"tracker file {path} is not text; write the iteration to load into it, or pass iteration=N"
        ) from None
    return True, layout.parse_tracker(text, path)


def detect_layout(storage: Storage, root: str, preferred: Layout) -> Layout:
    """The layout whose tracker exists under ``root``, ``preferred`` first."""
    for layout in (preferred, *[v for v in LAYOUTS.values() if v != preferred]):
        if storage.exists(storage.join(root, layout.tracker_name)):
            return layout
    names = storage.listdir(root)
    for layout in (preferred, *[v for v in LAYOUTS.values() if v != preferred]):
        if any(layout.parse_dir_name(n) is not None for n in names):
            return layout
    return preferred


def read_marker(storage: Storage, directory: str) -> CheckpointMetadata:
    """The parsed marker of ``directory``, or CorruptCheckpointError saying why not."""
    path = storage.join(directory, MARKER_NAME)
    if not storage.exists(path):
        raise CorruptCheckpointError(
            f"{directory} has no {MARKER_NAME}: it is not a committed checkpoint "
            "(a save into it did not finish); load another iteration"
        )
    return CheckpointMetadata.from_json(storage.read_bytes(path), path)


def list_checkpoints(storage: Storage, root: str, layout: Layout) -> list[CheckpointEntry]:
    """Every iteration directory (and release) under ``root``, oldest first."""
    entries = []
    for name in storage.listdir(root):
        iteration = layout.parse_dir_name(name)
        if iteration is None and name != RELEASE:
            continue
        path = storage.join(root, name)
        if storage.supports_rename and references.is_held(storage, path):
            continue  # retired; kept only for the files other checkpoints refer to
        try:
            meta, problem = read_marker(storage, path), None
        except CorruptCheckpointError as exc:
            meta, problem = None, str(exc)
        entries.append(CheckpointEntry(name, path, iteration, meta, problem))
    return sorted(entries, key=lambda e: (e.iteration is None, e.iteration or 0))


def retire(storage: Storage, root: str, name: str) -> None:
    """Delete the committed checkpoint ``root/name`` so that a crash at any moment leaves nothing loadable half-gone.

    On a filesystem it is first renamed to a temporary name (one atomic step: it stops
    being a checkpoint), then deleted; a crash leaves a temporary directory that the
    next start removes. On object storage its in-progress note is written back and
    the marker deleted first, so a crash leaves a prefix :func:`clean_leftovers` removes.
    A checkpoint whose files others refer to (frozen tensors stored once) keeps those
    files, held until the last referrer is retired (:mod:`~shardpoint.lifecycle.references`).
    """
    path = storage.join(root, name)
    keep = references.referred_files(storage, root, name)
    if keep:
        references.hold(storage, root, name, keep)
        return
    if storage.supports_rename:
        doomed = storage.join(root, f"{TMP_PREFIX}retired-{name}-{secrets.token_hex(4)}")
        storage.publish_dir(path, doomed)
        faults.hit("mid-retention", 0)
        storage.remove(doomed)
        return
    storage.write_atomic(storage.join(path, IN_PROGRESS_NAME), f"retiring {name}".encode())
    storage.remove(storage.join(path, MARKER_NAME))
    faults.hit("mid-retention", 0)
    storage.remove(path)


def clean_leftovers(storage: Storage, root: str) -> list[str]:
    """Remove what saves that died left behind (rank 0, at start-up).

    Temporary directories on local storage; on object storage, where data is written
    in place, iteration prefixes that a shardpoint save started (they hold its
    in-progress object) and that never got their marker. Anything else, such as a
    Megatron-LM or GPT-NeoX checkpoint in the same place, is left alone.
    """
    removed = []
    for name in storage.listdir(root):
        path = storage.join(root, name)
        if name.startswith(TRASH_PREFIX) and _restore_trash(storage, root, name):
            continue
        if name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            storage.remove(path)
            removed.append(name)
        elif not storage.supports_rename and _is_checkpoint_name(name) and _has_in_progress(storage, path):
            if storage.exists(storage.join(path, MARKER_NAME)):
                _drop_in_progress(storage, path)  # committed; the save died before removing its note
                continue
            storage.remove(path)
            removed.append(name)
    if removed:
        log.warning("removed %d partial checkpoint(s) left by an interrupted save: %s", len(removed), removed)
    return removed


def _restore_trash(storage: Storage, root: str, name: str) -> bool:
    """Put back a checkpoint a re-save moved aside, when the save died before its replacement arrived."""
    final = name.removeprefix(TRASH_PREFIX).rsplit("-", 1)[0]
    if not final or storage.exists(storage.join(root, final)):
        return False
    storage.publish_dir(storage.join(root, name), storage.join(root, final))
    log.warning("restored %s, moved aside by a save that did not finish", final)
    return True


def _refuse_referred(storage: Storage, root: str, name: str) -> None:
    """Refuse to replace a directory whose files other checkpoints refer to: replacing it would break them."""
    referred = references.referred_files(storage, root, name)
    if referred:
        referrers = sorted({r for names in referred.values() for r in names})
        raise CheckpointError(
            f"cannot save {name} again under {root}: {len(referred)} of its file(s) hold frozen tensors that "
            f"{', '.join(referrers)} store once and refer to; saving over it would break them. Delete those "
            "checkpoints first (shardpoint prune), or save into another directory"
        )


def _has_in_progress(storage: Storage, path: str) -> bool:
    return storage.exists(storage.join(path, IN_PROGRESS_NAME))


def _started_by_shardpoint(storage: Storage, path: str) -> bool:
    return storage.exists(storage.join(path, MARKER_NAME)) or _has_in_progress(storage, path)


def _drop_in_progress(storage: Storage, path: str) -> None:
    if not storage.supports_rename and _has_in_progress(storage, path):
        storage.remove(storage.join(path, IN_PROGRESS_NAME))


def _is_checkpoint_name(name: str) -> bool:
    return name == RELEASE or any(layout.parse_dir_name(name) is not None for layout in LAYOUTS.values())
