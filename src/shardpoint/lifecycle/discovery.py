"""Which checkpoint a load means, and where to read it from.

Rank 0 answers "what do I load?" once (tracker, ``iteration=N``, or the newest
committed checkpoint when there is no tracker) and broadcasts the answer, so ranks
never race a tracker that another job may be replacing. With ``fallback`` a damaged
checkpoint is skipped for the newest one that verifies.

In local-first mode (``upload_to``) there are two places to look: :class:`LoadSources`
picks the local directory when it holds the newer committed checkpoint (a restart on
the same nodes) and the object store otherwise (a replaced node has nothing
locally). With node-local directories the object store's tracker alone decides, since
no node holds a whole checkpoint, and each file is read from the node's copy where
it can be (:mod:`shardpoint.lifecycle.node_view`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shardpoint.catalog.integrity import verify_files
from shardpoint.catalog.layout import Layout
from shardpoint.catalog.metadata import CheckpointMetadata
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.lifecycle import commit
from shardpoint.lifecycle.node_local import NodeLocal, PartialCheckpointError, partial_error
from shardpoint.lifecycle.node_view import NodeView, open_view
from shardpoint.storage.base import Storage

__all__ = ["LoadSources", "find_checkpoint"]

LOCAL, REMOTE = "local", "remote"

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
    if fallback:
        return _first_intact(storage, root, layout, path, iteration)
    return path, commit.read_marker(storage, path).to_json()


def _newest_without_tracker(storage: Storage, root: str, layout: Layout) -> tuple[str, str] | None:
    entries = [e for e in commit.list_checkpoints(storage, root, layout) if e.committed]
    if not entries:
        partial = partial_error(storage, root, layout) if storage.is_local else None
        if partial is not None:
            raise partial
        return None
    newest = entries[-1]
    log.warning("no tracker file under %s; loading the newest committed checkpoint %s", root, newest.name)
    return newest.path, newest.marker().to_json()


def _first_intact(storage: Storage, root: str, layout: Layout, path: str, iteration: int | None) -> tuple[str, str]:
    """The newest intact checkpoint from ``path`` (of ``iteration``, None: release) down.

    ``path``'s own marker may be the damaged part (unreadable, not JSON, a number past
    Python's digit limit): it is then skipped like a damaged data file, by the iteration
    its name gives.
    """
    try:
        first: list[tuple[str, CheckpointMetadata | None, str]] = [(path, commit.read_marker(storage, path), "")]
    except CorruptCheckpointError as exc:
        first = [(path, None, str(exc))]
    candidates = first + [
        (e.path, e.meta, "")
        for e in reversed(commit.list_checkpoints(storage, root, layout))
        if e.committed and e.path != path and (iteration is None or (e.iteration or 0) < iteration)
    ]
    for candidate, candidate_meta, problem in candidates:
        if candidate_meta is not None:
            problem = "; ".join(map(str, verify_files(storage, candidate, candidate_meta)))
            if not problem:
                return candidate, candidate_meta.to_json()
        log.warning("skipping damaged checkpoint %s: %s", candidate, problem)
    raise CorruptCheckpointError(f"no checkpoint under {root} passes verification")


@dataclass
class LoadSources:
    """Where a load looks: the save directory, and in local-first mode the object store too.

    ``find`` runs on rank 0 and returns a picklable answer (``(where, directory,
    marker text)``) that is broadcast; ``storage_for`` then runs on every rank.
    """

    local: Storage
    local_root: str
    layout: Layout
    remote: Storage | None = None
    remote_root: str | None = None
    node: NodeLocal | None = None
    view: NodeView | None = None  # the last load's node view; closed by the next load or close()

    def find(self, iteration: int | None, fallback: bool) -> tuple[str, str, str] | None:
        """Rank 0: the checkpoint to load; the newer of local and remote, local on a tie."""
        if self.remote is None or self.remote_root is None:
            found = find_checkpoint(self.local, self.local_root, self.layout, iteration, fallback)
            return None if found is None else (LOCAL, *found)
        local = None
        if self.node is None:
            try:
                local = find_checkpoint(self.local, self.local_root, self.layout, iteration, fallback)
            except PartialCheckpointError:
                local = None  # another job's node-local parts: only the object store holds the whole
            except CheckpointError as exc:
                log.warning("%s; looking in %s", exc, self.remote_root)
        try:
            remote = find_checkpoint(self.remote, self.remote_root, self.layout, iteration, fallback)
        except CheckpointError as exc:
            if local is None:
                raise
            log.warning("cannot read %s (%s); loading the local checkpoint", self.remote_root, exc)
            remote = None
        if local is not None and (remote is None or _newer_or_equal(local[1], remote[1])):
            return (LOCAL, *local)
        return None if remote is None else (REMOTE, *remote)

    def reader(self, where: str, path: str, meta: CheckpointMetadata, verify: bool) -> tuple[Storage, str]:
        """Collective: the storage and directory to read the checkpoint ``find`` chose through.

        In node-local mode a :class:`~shardpoint.lifecycle.node_view.NodeView`, which serves the
        files this node kept from its disk and the rest from the object store.
        """
        if where == LOCAL:
            return self.local, path
        if self.remote is None:
            raise CheckpointError(f"{path} is on the object store, but this load has none (no upload_to)")
        if self.node is None:
            return self.remote, path
        self.close()
        self.view = open_view(self.node, self.remote, path, meta, verify)
        return self.view, self.view.root

    def close(self) -> None:
        """Forget the last load's node view (it registers itself for the life of the process otherwise)."""
        if self.view is not None:
            self.view.close()
            self.view = None


def _newer_or_equal(local_marker: str, remote_marker: str) -> bool:
    local = CheckpointMetadata.from_json(local_marker, "local marker")
    remote = CheckpointMetadata.from_json(remote_marker, "remote marker")
    if local.release or remote.release:
        return local.release or not remote.release
    return local.iteration >= remote.iteration
