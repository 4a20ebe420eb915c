"""``local_keep``: what a node keeps of the local tier, replicas included.

After each local commit, the node's leader deletes from its ``local_dir`` every
committed copy that (after a load, only the first rule applies):

- belongs to an iteration newer than the one just committed or resumed from (a load
  of the newest, never one of an explicit ``iteration=``): a future that training
  abandoned (a restart from an older checkpoint); after a load, the
  saves that were tried and failed are spared (their intact copies are only pruned
  by the next commit, never because one copy was damaged);
- was saved at another layout (the tier is bound to its layout, nothing could load it);
- is not among the ``local_keep`` newest remaining iterations (the newest is always kept).

Only committed copies of this run are deleted (the run's own directory of
``local_dir``; other runs' are never looked at), never a directory being written
(another rank of the node may already be writing the next save), and each one stops
being a copy in one rename before its bytes go
(:func:`~shardpoint.tier.marker.remove_copy`). The rules are :func:`stale_copies`,
pure; a failed deletion only warns, as persistent retention does. Persistent
checkpoints are never looked at: they are another tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

from shardpoint.lifecycle.policy import CheckpointInfo, LatestN, select_for_deletion
from shardpoint.storage.base import Storage
from shardpoint.tier.marker import HeldCopy, LocalMarker, held_copies, remove_copy

__all__ = ["prune_node", "stale_copies"]

log = logging.getLogger(__name__)


def stale_copies(
    copies: Sequence[HeldCopy],
    latest: int,
    keep: int,
    incompatible: Callable[[LocalMarker], str | None],
    newer_only: bool = False,
    spare: Collection[tuple[int, str]] = (),
) -> list[HeldCopy]:
    """The copies to delete once ``latest`` is committed (or, ``newer_only``, loaded: only the abandoned future,
    less the saves ``(iteration, save_id)`` in ``spare``)."""
    if newer_only:
        return [
            c
            for c in copies
            if c.iteration > latest and incompatible(c.marker) is None and (c.iteration, c.marker.save_id) not in spare
        ]
    usable = [c for c in copies if c.iteration <= latest and incompatible(c.marker) is None]
    infos = [CheckpointInfo(i) for i in sorted({c.iteration for c in usable})]
    doomed = set(select_for_deletion(infos, [LatestN(keep)], {latest}))
    return [c for c in copies if c not in usable or c.iteration in doomed]


def prune_node(
    storage: Storage,
    root: str,
    latest: int,
    keep: int,
    incompatible: Callable[[LocalMarker], str | None],
    newer_only: bool = False,
    spare: Collection[tuple[int, str]] = (),
) -> list[str]:
    """The node's leader: delete the stale copies under ``root``; returns their paths."""
    removed = []
    try:
        for copy in stale_copies(held_copies(storage, root), latest, keep, incompatible, newer_only, spare):
            remove_copy(storage, copy.path)
            removed.append(copy.path)
    except OSError as exc:
        log.warning("could not delete old local-tier copies under %s: %s", root, exc)
    if removed:
        log.info("local tier: removed %d old copies under %s", len(removed), root)
    return removed
