"""Applying the preservation policies to a checkpoint root (the mechanism; the rules live in policy.py).

Deletion happens only after a newer checkpoint is committed, never touches the
checkpoint the tracker names or ``release/``, and a failure only warns: one
undeletable directory must not fail a save (torchtitan's purge thread makes the
same choice).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from shardpoint import commit, faults
from shardpoint.errors import CheckpointError
from shardpoint.layout import Layout
from shardpoint.policy import CheckpointInfo, PreservationPolicy, select_for_deletion
from shardpoint.storage import Storage

__all__ = ["apply_retention"]

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
        infos = [CheckpointInfo(e.iteration, e.meta.metrics) for e in entries]
        for iteration in select_for_deletion(infos, policies, {tracked} if tracked is not None else set()):
            name = layout.dir_name(iteration)
            storage.remove(storage.join(root, name))
            removed.append(name)
            log.info("retention removed %s", storage.join(root, name))
    except (OSError, CheckpointError) as exc:
        log.warning("retention could not delete old checkpoints under %s: %s", root, exc)
    return removed
