"""Which checkpoint a path means: a checkpoint directory, or a save directory and its tracker.

Paths may be local or ``s3://bucket/prefix``: every question goes through the
:class:`~shardpoint.storage.base.Storage` that :func:`~shardpoint.storage.base.open_storage`
picks. Each function takes that storage as an optional argument, so a caller that
asks several questions about one object store opens one client, not one per call.
"""

from __future__ import annotations

import os
import posixpath
import warnings

from shardpoint.catalog.layout import LAYOUTS, RELEASE, Layout
from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from shardpoint.formats.dist import COMMON_FILE
from shardpoint.lifecycle import commit
from shardpoint.offline._common import MP_DIR
from shardpoint.storage.base import Storage, open_storage

__all__ = ["find_layout", "is_checkpoint_dir", "local_path", "looks_like_checkpoint", "resolve"]


def resolve(
    path: str | os.PathLike[str], iteration: int | None = None, *, storage: Storage | None = None
) -> tuple[str, CheckpointMetadata]:
    """The checkpoint directory ``path`` means, and its parsed marker.

    ``path`` is either a checkpoint directory (holding ``shardpoint.json``) or a save
    directory; in a save directory ``iteration`` picks one, else the tracker's, else
    the newest committed one. ``path`` may be local or ``s3://bucket/prefix``.

    Args:
        storage: the storage ``path`` lives on (default: ``open_storage(path)``).

    Raises:
        NotACheckpointError: ``path`` is not a checkpoint nor a directory of checkpoints.
        CorruptCheckpointError: the checkpoint is partial (no marker) or its marker is damaged.
        StorageError: ``path`` is a URL of an unsupported kind, or the object store failed.

    Example:
        >>> directory, meta = resolve("s3://bucket/runs/gpt", iteration=200)
    """
    storage = storage or open_storage(path)
    root = _canonical(storage, path)
    if not storage.is_dir(root):
        what = "is a file" if storage.exists(root) else "does not exist"
        raise NotACheckpointError(f"{root} {what}; pass a checkpoint directory or the directory a job saves into")
    if is_checkpoint_dir(root, storage):
        meta = commit.read_marker(storage, root)
        if iteration is not None and (meta.release or meta.iteration != iteration):
            raise CheckpointError(
                f"{root} is one checkpoint (iteration {meta.iteration}); --iteration {iteration} "
                "applies to the directory above it"
            )
        return root, meta
    layout = find_layout(root, storage)
    if iteration is None:
        found, tracked = commit.read_tracker(storage, root, layout)
        if found:
            return _tracked(storage, root, layout, tracked)
        committed = [e for e in commit.list_checkpoints(storage, root, layout) if e.committed]
        if not committed:
            raise _nothing_here(storage, root, layout)
        return committed[-1].path, committed[-1].marker()
    directory = storage.join(root, layout.dir_name(iteration))
    if not storage.is_dir(directory):
        raise NotACheckpointError(
            f"{directory} does not exist; checkpoints under {root}: {_names(storage, root, layout)}"
        )
    return directory, commit.read_marker(storage, directory)


def local_path(path: str | os.PathLike[str]) -> str:
    """Deprecated: ``open_storage(path).root`` (offline tools now read ``s3://`` paths too).

    Raises:
        StorageError: ``path`` is a URL of an unsupported kind.
    """
    warnings.warn(
        "shardpoint.offline.local_path is deprecated (s3:// paths work now); use "
        "shardpoint.storage.base.open_storage(path).root",
        DeprecationWarning,
        stacklevel=2,
    )
    return open_storage(path).root


def is_checkpoint_dir(directory: str, storage: Storage | None = None) -> bool:
    """One checkpoint's directory (committed, or partial), as opposed to a save directory holding several."""
    storage = storage or open_storage(directory)
    return storage.is_dir(directory) and (
        storage.exists(storage.join(directory, MARKER_NAME)) or looks_like_checkpoint(directory, storage)
    )


def looks_like_checkpoint(directory: str, storage: Storage | None = None) -> bool:
    """A directory named like a checkpoint or holding format files (committed or not)."""
    name = posixpath.basename(directory.rstrip("/"))
    if name == RELEASE or name.startswith(commit.TMP_PREFIX):
        return True
    if any(layout.parse_dir_name(name) is not None for layout in LAYOUTS.values()):
        return True
    try:
        entries = (storage or open_storage(directory)).listdir(directory)
    except OSError:
        return False
    return any(e in (".metadata", COMMON_FILE) or MP_DIR.fullmatch(e) for e in entries)


def find_layout(root: str, storage: Storage | None = None) -> Layout:
    """The layout of a save directory: its tracker's, else its directories'."""
    return commit.detect_layout(storage or open_storage(root), root, LAYOUTS["megatron"])


def _canonical(storage: Storage, path: str | os.PathLike[str]) -> str:
    """``path`` as the storage names it: absolute and normalized locally, without a trailing ``/`` on S3."""
    text = os.fspath(path)
    return os.path.abspath(text.removeprefix("file://")) if storage.is_local else text.rstrip("/")


def _tracked(storage: Storage, root: str, layout: Layout, iteration: int | None) -> tuple[str, CheckpointMetadata]:
    directory = storage.join(root, layout.dir_name(iteration))
    if not storage.is_dir(directory):
        raise CorruptCheckpointError(
            f"the tracker {layout.tracker_name} under {root} names {layout.dir_name(iteration)}, which does not "
            f"exist; pass --iteration with one of: {_names(storage, root, layout)}"
        )
    return directory, commit.read_marker(storage, directory)


def _nothing_here(storage: Storage, root: str, layout: Layout) -> CheckpointError:
    partial = [e.name for e in commit.list_checkpoints(storage, root, layout)]
    if partial:
        return CorruptCheckpointError(
            f"no committed checkpoint under {root}: {', '.join(partial)} "
            f"have no {MARKER_NAME} (their saves did not finish)"
        )
    return NotACheckpointError(
        f"{root} is not a checkpoint: it has no {MARKER_NAME} and no checkpoint "
        "directories (iter_*, global_step*, release) under it"
    )


def _names(storage: Storage, root: str, layout: Layout) -> str:
    names = [e.name for e in commit.list_checkpoints(storage, root, layout) if e.committed]
    return ", ".join(names) or "none"
