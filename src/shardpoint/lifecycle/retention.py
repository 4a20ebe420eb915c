"""Applying the preservation policies to a checkpoint root (the mechanism; the rules live in policy.py).

Deletion happens only after a newer checkpoint is committed, never touches the
checkpoint the tracker names or ``release/``, and a failure only warns: one
undeletable directory must not fail a save (torchtitan's purge thread makes the
same choice). What failed is tried again at the next run, which lists the root anew.

Deleting a checkpoint takes as long as writing one can on a slow disk, so the
Checkpointer runs it on a worker thread (:class:`BackgroundRetention`) after each
commit: ``save()`` returns without waiting, and the next commit waits for the
previous deletion (not earlier), so deletions never overlap a tracker change.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from shardpoint.catalog.layout import Layout
from shardpoint.errors import CheckpointError
from shardpoint.lifecycle import commit, faults, references
from shardpoint.lifecycle.policy import CheckpointInfo, PreservationPolicy, select_for_deletion
from shardpoint.storage.base import Storage

__all__ = ["BackgroundRetention", "apply_retention"]

log = logging.getLogger(__name__)


def apply_retention(storage: Storage, root: str, layout: Layout, policies: Sequence[PreservationPolicy]) -> list[str]:
    """Delete the committed checkpoints no policy keeps; returns the names deleted."""
    if not policies:
        return []
    removed = []
    try:
        faults.hit("during-retention", 0)
        entries = [e for e in commit.list_checkpoints(storage, root, layout) if e.committed and e.iteration is not None]
        _, tracked = commit.read_tracker(storage, root, layout)
        infos = [CheckpointInfo(e.iteration, e.marker().metrics) for e in entries if e.iteration is not None]
        for iteration in select_for_deletion(infos, policies, {tracked} if tracked is not None else set()):
            name = layout.dir_name(iteration)
            commit.retire(storage, root, name)
            removed.append(name)
            log.info("retention removed %s", storage.join(root, name))
        for name in references.held_dirs(storage, root):
            commit.retire(storage, root, name)  # keeps what is still referred to; gone when nothing is
    except (OSError, CheckpointError) as exc:
        log.warning("retention could not delete old checkpoints under %s: %s", root, exc)
    return removed


class BackgroundRetention:
    """:func:`apply_retention` on a worker thread, one run at a time.

    Call order (rank 0 only): :meth:`wait` before a commit changes the tracker,
    :meth:`start` after it, :meth:`wait` at close.
    """

    def __init__(self, storage: Storage, root: str, layout: Layout, policies: Sequence[PreservationPolicy]):
        self.storage, self.root, self.layout, self.policies = storage, root, layout, tuple(policies)
        self._thread: threading.Thread | None = None
        self.removed: list[str] = []

    def start(self) -> None:
        """Begin deleting what the policies no longer keep; returns at once."""
        if not self.policies:
            return
        self.wait()
        self._thread = threading.Thread(target=self._run, name="shardpoint-retention", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the deletion in progress, if any, is finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        try:
            self.removed += apply_retention(self.storage, self.root, self.layout, self.policies)
        except Exception:  # a deletion must never fail training; the next run tries again
            log.exception("retention under %s failed; retrying after the next save", self.root)
