"""The commit protocol: when a checkpoint starts to exist.

A save goes through three states, and only the last one is ever loaded:

1. **partial** — ranks write into ``.shardpoint-tmp-<name>-<token>/`` beside the
   final directory. A crash here leaves a directory no reader looks at; the next
   Checkpointer start removes it. On object storage (no rename) too: the staging
   prefix holds an in-progress note naming the save, and a checkpoint of the same
   name stays as it is until the commit (see "object storage: staged saves" below).
2. **committed** — rank 0 writes ``shardpoint.json`` (the marker, listing every file
   with size and checksum) into the temporary directory, fsyncs, and renames the
   directory to its final name. A directory is a checkpoint if and only if it holds
   a valid marker, so a reader never needs the rename to be atomic with the data.
   On object storage a create-only claim decides which of two saves of one name
   commits, and the staged files are copied into place, marker last.
3. **latest** — only then is the tracker file replaced (temp file, fsync,
   ``os.replace``, fsync of the directory). Killing any rank at any moment leaves
   the tracker naming the previous committed checkpoint.

Both a rename and a marker exist for the reason Orbax gives in ``atomicity.py``:
the rename keeps half-written directories out of listings on filesystems, the
marker is what object stores (which cannot rename) rely on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass

from shardpoint.catalog.layout import LAYOUTS, RELEASE, Layout
from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.errors import CheckpointError, ConcurrentSaveError, CorruptCheckpointError, StorageError
from shardpoint.lifecycle import faults, references
from shardpoint.storage.base import Storage, refuse_foreign
from shardpoint.storage.object_store import ObjectStorage

__all__ = [
    "CheckpointEntry",
    "begin",
    "clean_leftovers",
    "detect_layout",
    "discard",
    "list_checkpoints",
    "marker_digest",
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
CLAIM_PREFIX = ".shardpoint-commit-"  # object storage: <name>/.shardpoint-commit-<digest>, see _switch
LEFTOVER_AGE_ENV = "SHARDPOINT_LEFTOVER_AGE"
DEFAULT_LEFTOVER_AGE = 6 * 3600.0


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

    def marker(self) -> CheckpointMetadata:
        """The marker of a committed checkpoint (callers list committed entries only)."""
        if self.meta is None:
            raise CorruptCheckpointError(f"{self.path} is not a committed checkpoint: {self.problem or 'no marker'}")
        return self.meta


def begin(storage: Storage, root: str, final_name: str, base: str | None = None) -> str:
    """Create and return the directory ranks write into (rank 0): always one of this save's own.

    On storage that can rename, a fresh temporary directory, renamed into place by
    :func:`publish`. On object storage, a fresh staging prefix beside the final one
    (:func:`_begin_staged`): the final prefix is left as it is, so a checkpoint of the
    same name stays loadable until this save commits, and a second job saving the same
    iteration writes none of the same objects. ``base``: the :func:`marker_digest` of the
    final prefix when the save really began (an upload begins after its local save), so
    that a checkpoint another job committed since then is not replaced; None: now.
    """
    storage.makedirs(root)
    if not storage.supports_rename:
        return _begin_staged(storage, root, final_name, base)
    refuse_foreign(storage, storage.join(root, final_name))  # before any byte: another tool's data stays
    _refuse_referred(storage, root, final_name)
    tmp = storage.join(root, f"{TMP_PREFIX}{final_name}-{secrets.token_hex(4)}")
    storage.makedirs(tmp)
    return tmp


def publish(storage: Storage, tmp: str, final: str, meta: CheckpointMetadata) -> None:
    """Write the marker into ``tmp`` and move it to ``final``: the checkpoint now exists.

    On object storage the move is :func:`_switch`: a create-only claim decides which of
    two saves of ``final`` commits, then the staged files are copied into place.

    Raises:
        ConcurrentSaveError: (object storage) another save of ``final`` claimed it first.
    """
    if not storage.supports_rename:
        _switch(storage, tmp, final, meta.to_json().encode(), sorted(meta.files))
        return
    write_marker(storage, tmp, meta.to_json().encode())
    storage.publish_dir(tmp, final)


def discard(storage: Storage, tmp: str) -> None:
    """Remove the directory of a save that failed, unless (object storage) it won its claim.

    A staging prefix whose claim it won may already have replaced some of the old
    checkpoint's files: it is kept, and the next saving job finishes its commit
    (:func:`clean_leftovers`) rather than leave the iteration half-replaced.
    """
    if not storage.supports_rename and _won_claim(storage, tmp):
        log.warning("%s won its claim but did not finish moving into place; the next save finishes it", tmp)
        return
    storage.remove(tmp)


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

    Temporary directories on local storage. On object storage: staging prefixes of
    saves that died (:func:`_clean_staged`: a save that won its claim is finished, one
    that did not is removed once older than :func:`leftover_age`, since a younger one
    may be another job's save in progress), and iteration prefixes that a shardpoint
    upload or retirement marked in progress and that hold no marker. Anything else,
    such as a Megatron-LM or GPT-NeoX checkpoint in the same place, is left alone.
    """
    removed = []
    for name in storage.listdir(root):
        path = storage.join(root, name)
        if name.startswith(TRASH_PREFIX) and _restore_trash(storage, root, name):
            continue
        if not storage.supports_rename and name.startswith(TMP_PREFIX):
            if _clean_staged(storage, root, name):
                removed.append(name)
        elif name.startswith((TMP_PREFIX, TRASH_PREFIX)):
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


def leftover_age() -> float:
    """Seconds after its start when an object-store save that did not commit counts as dead.

    Object stores have no lock that dies with its job, so a staging prefix younger than
    this may be another job's save in progress and is left alone. ``SHARDPOINT_LEFTOVER_AGE``
    sets it (default 6 hours: longer than any save should take).
    """
    return float(os.environ.get(LEFTOVER_AGE_ENV, DEFAULT_LEFTOVER_AGE))


# ---------------------------------------------------------------- object storage: staged saves
#
# An object store cannot rename, and a checkpoint must stay loadable while a save of the
# same name is written, so every save writes into a staging prefix of its own
# (``.shardpoint-tmp-<name>-<token>/``, with an in-progress note naming the marker it
# found at ``<name>/``). Its commit (:func:`_switch`):
#
# 1. the staged marker: the staging prefix now holds the whole checkpoint;
# 2. the claim ``<name>/.shardpoint-commit-<digest of the marker found at begin>``, created
#    only if absent: of two saves that began from the same state, exactly one creates it
#    (the other raises ConcurrentSaveError, and removes only its own staging prefix);
# 3. server-side copies of the files the marker lists, then the marker (one PUT): the
#    checkpoint at ``<name>/`` is now this save's;
# 4. the replaced checkpoint's files that the new marker does not list, the staging
#    prefix and the claim are removed.
#
# A crash before 2 leaves the old checkpoint as it was. A crash inside 3 (a moment of a
# few small copies for a re-save) is finished by the next saving job (_clean_staged).


def _begin_staged(storage: Storage, root: str, final_name: str, base: str | None = None) -> str:
    """Object storage: this save's staging prefix, with a note saying what it will replace."""
    final = storage.join(root, final_name)
    if storage.exists(final) and not _started_by_shardpoint(storage, final):
        raise CheckpointError(
            f"{final} exists and was not written by shardpoint (no {MARKER_NAME}, no {IN_PROGRESS_NAME}); "
            "shardpoint never overwrites another tool's checkpoint: save under another prefix"
        )
    tmp = storage.join(root, f"{TMP_PREFIX}{final_name}-{secrets.token_hex(8)}")
    note = {"save": final_name, "started": time.time(), "base": marker_digest(storage, final) if base is None else base}
    storage.write_atomic(storage.join(tmp, IN_PROGRESS_NAME), json.dumps(note).encode())
    return tmp


def _switch(storage: Storage, tmp: str, final: str, marker: bytes, files: list[str]) -> None:
    """Object storage: commit the staged save ``tmp`` as ``final`` (steps 1 to 4 above)."""
    base = _read_note(storage, tmp)["base"]
    storage.write_atomic(storage.join(tmp, MARKER_NAME), marker)
    claim = _claim(storage, tmp, final, base)
    _copy_into_place(storage, tmp, final, marker, files)
    storage.remove(tmp)
    storage.remove(claim)


def _claim(storage: Storage, tmp: str, final: str, base: str) -> str:
    """Create ``final``'s claim for the state this save began from; the path, or ConcurrentSaveError."""
    claim = storage.join(final, CLAIM_PREFIX + base)
    mine = _name_of(tmp).encode()
    try:
        storage.write_new(claim, mine)
    except FileExistsError:
        try:
            own = storage.read_bytes(claim) == mine  # a retried create of this save's own claim
        except FileNotFoundError:
            own = False  # the other save has committed and removed it meanwhile
        if not own:
            raise _concurrent(final) from None
    if marker_digest(storage, final) != base:  # another save committed and removed its claim since
        storage.remove(claim)
        raise _concurrent(final)
    return claim


def _copy_into_place(storage: Storage, tmp: str, final: str, marker: bytes, files: list[str]) -> None:
    """Copy the listed files of ``tmp`` over ``final``, then its marker; then drop the replaced files."""
    if not isinstance(storage, ObjectStorage):  # only object storage commits by copying (it cannot rename)
        raise StorageError(f"committing {final} by copying needs object storage, not {type(storage).__name__}")
    replaced = _listed_files(storage, final)
    faults.hit("mid-switch", 0)
    storage.copy_many([(storage.join(tmp, name), storage.join(final, name)) for name in files])
    storage.write_atomic(storage.join(final, MARKER_NAME), marker)
    for name in sorted(replaced - set(files)):  # the old checkpoint's files only: nothing another save wrote
        storage.remove(storage.join(final, name))


def _clean_staged(storage: Storage, root: str, name: str) -> bool:
    """A staging prefix found at start-up: finish its commit if it won its claim, else remove it when dead.

    Returns whether it was removed without being committed.
    """
    tmp = storage.join(root, name)
    try:
        note = _read_note(storage, tmp)
    except (FileNotFoundError, CorruptCheckpointError):
        storage.remove(tmp)  # its note is written first and removed last: a dead save, or one being removed
        return True
    final = storage.join(root, str(note.get("save", "")))
    claim = storage.join(final, CLAIM_PREFIX + str(note.get("base", "")))
    marker = storage.join(tmp, MARKER_NAME)
    if _won_claim(storage, tmp):
        data = storage.read_bytes(marker)
        _copy_into_place(storage, tmp, final, data, sorted(CheckpointMetadata.from_json(data, marker).files))
        storage.remove(tmp)
        storage.remove(claim)
        log.warning("finished committing %s, whose save died while moving it into place", final)
        return False
    started = note.get("started")
    if isinstance(started, (int, float)) and time.time() - started < leftover_age():
        return False  # maybe another job's save in progress
    storage.remove(tmp)
    return True


def _won_claim(storage: Storage, tmp: str) -> bool:
    """Whether the staged save ``tmp`` holds its marker and created its final prefix's claim."""
    try:
        note = _read_note(storage, tmp)
        root, name = tmp.rstrip("/").rsplit("/", 1)
        claim = storage.join(root, str(note.get("save", "")), CLAIM_PREFIX + note["base"])
        return storage.exists(storage.join(tmp, MARKER_NAME)) and storage.read_bytes(claim) == name.encode()
    except (FileNotFoundError, CorruptCheckpointError):
        return False


def _read_note(storage: Storage, tmp: str) -> dict:
    path = storage.join(tmp, IN_PROGRESS_NAME)
    try:
        note = json.loads(storage.read_bytes(path))
    except (ValueError, UnicodeDecodeError):
        note = None
    if not isinstance(note, dict) or not isinstance(note.get("base"), str):
        raise CorruptCheckpointError(f"{path} is not a shardpoint save's note; remove {tmp}")
    return note


def marker_digest(storage: Storage, directory: str) -> str:
    """A short digest of ``directory``'s marker (``none`` without one): the state a save replaces."""
    try:
        data = storage.read_bytes(storage.join(directory, MARKER_NAME))
    except FileNotFoundError:
        return "none"
    return hashlib.sha256(data).hexdigest()[:32]


def _listed_files(storage: Storage, directory: str) -> set[str]:
    """The files ``directory``'s marker lists (none when it has no readable marker)."""
    try:
        return set(read_marker(storage, directory).files)
    except CorruptCheckpointError:
        return set()


def _name_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _concurrent(final: str) -> ConcurrentSaveError:
    return ConcurrentSaveError(
        f"{final} was committed by another writer while this save was writing it (its claim appeared first); "
        "this save is not committed and the tracker was not moved by it. Two jobs are saving into the same "
        "directory: give each its own"
    )


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
    names = storage.listdir(path)
    return any(n in (MARKER_NAME, IN_PROGRESS_NAME) or n.startswith(CLAIM_PREFIX) for n in names)


def _drop_in_progress(storage: Storage, path: str) -> None:
    if not storage.supports_rename and _has_in_progress(storage, path):
        storage.remove(storage.join(path, IN_PROGRESS_NAME))


def _is_checkpoint_name(name: str) -> bool:
    return name == RELEASE or any(layout.parse_dir_name(name) is not None for layout in LAYOUTS.values())
