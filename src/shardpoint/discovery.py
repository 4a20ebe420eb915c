"""Which checkpoint a load means, and whether its files are intact.

Rank 0 answers "what do I load?" once (tracker, ``iteration=N``, or the newest
committed checkpoint when there is no tracker) and broadcasts the answer, so ranks
never race a tracker that another job may be replacing. With ``fallback`` a damaged
checkpoint is skipped for the newest one that verifies.
"""

from __future__ import annotations

import logging

from shardpoint import _comm, commit
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.integrity import verify_files
from shardpoint.layout import Layout
from shardpoint.metadata import CheckpointMetadata
from shardpoint.storage import Storage

__all__ = ["find_checkpoint", "verify_share"]

log = logging.getLogger(__name__)


def find_checkpoint(
    storage: Storage, root: str, layout: Layout, iteration: int | None, fallback: bool
) -> tuple[str, str] | None:
    """Rank 0: the directory to load and its marker text, or None for a fresh start.

    Raises:
        CorruptCheckpointError: the tracker or ``iteration`` names a missing or
            uncommitted directory (the message lists the committed ones).
    """
    if not storage.is_dir(root):
        if storage.exists(root):
            raise CheckpointError(f"{root} is a file, not a checkpoint directory; pass the save directory")
        return None
    layout = commit.detect_layout(storage, root, layout)
    if iteration is None:
        found, iteration = commit.read_tracker(storage, root, layout)
        if not found:
            return _newest_without_tracker(storage, root, layout)
    path = storage.join(root, layout.dir_name(iteration))
    if not storage.is_dir(path):
        committed = ", ".join(e.name for e in commit.list_checkpoints(storage, root, layout) if e.committed)
        raise CorruptCheckpointError(
            f"{path} does not exist, but it was asked for (tracker or iteration=); choose one of: {committed or 'none'}"
        )
    meta = commit.read_marker(storage, path)
    if fallback:
        return _first_intact(storage, root, layout, path, meta)
    return path, meta.to_json()


def _newest_without_tracker(storage: Storage, root: str, layout: Layout) -> tuple[str, str] | None:
    entries = [e for e in commit.list_checkpoints(storage, root, layout) if e.committed]
    if not entries:
        return None
    newest = entries[-1]
    log.warning("no tracker file under %s; loading the newest committed checkpoint %s", root, newest.name)
    return newest.path, newest.meta.to_json()


def _first_intact(storage: Storage, root: str, layout: Layout, path: str, meta: CheckpointMetadata) -> tuple[str, str]:
    candidates = [(path, meta)] + [
        (e.path, e.meta)
        for e in reversed(commit.list_checkpoints(storage, root, layout))
        if e.committed and e.path != path and (meta.release or (e.iteration or 0) < meta.iteration)
    ]
    for candidate, candidate_meta in candidates:
        problems = verify_files(storage, candidate, candidate_meta)
        if not problems:
            return candidate, candidate_meta.to_json()
        log.warning("skipping damaged checkpoint %s: %s", candidate, "; ".join(map(str, problems)))
    raise CorruptCheckpointError(f"no checkpoint under {root} passes verification")


def verify_share(storage: Storage, path: str, meta: CheckpointMetadata, names: list[str], checksums: bool) -> None:
    """Check this rank's share of ``names`` (round-robin): presence and size always, checksums if asked."""
    missing_record = [n for n in names if n not in meta.files]
    if missing_record:
        raise CorruptCheckpointError(f"{path}: {missing_record[0]} is not listed in shardpoint.json")
    share = names[_comm.rank() :: _comm.world_size()] if len(names) >= _comm.world_size() else names
    problems = verify_files(storage, path, meta, share, checksums=checksums)
    if problems:
        raise CorruptCheckpointError(
            f"checkpoint {path} is damaged: "
            + "; ".join(map(str, problems))
            + ". Load an earlier iteration (iteration=N or fallback=True), or run `shardpoint verify` for a report"
        )
