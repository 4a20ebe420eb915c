"""Which ``checkpoint-N`` the Hugging Face Trainer keeps, as a shardpoint retention policy.

``ShardpointTrainer`` promises the Trainer's retention, so it applies the Trainer's own
rule (``transformers.trainer_utils.rotate_checkpoints``, 5.x) rather than an
approximation from ``keep_last`` and ``keep_best``:

* no ``save_total_limit`` (or one ``<= 0``): every checkpoint is kept, whatever the metric;
* otherwise the newest and the best (``state.best_model_checkpoint``, as the Trainer
  computed it) are protected, and the oldest unprotected ones go until
  ``max(save_total_limit, len(protected))`` are left. A best whose folder is gone
  counts in ``len(protected)`` (transformers counts the path) but is no folder left:
  with ``save_total_limit=1`` two folders stay, the newest and the one before it.

The policy only decides; shardpoint's retention deletes (crash-safe, never the tracker's
checkpoint), after each commit. The best step is the one the Trainer named when the
latest save started (:attr:`TrainerRetention.best`), so a background deletion does not
race an evaluation that runs meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardpoint.lifecycle.policy import CheckpointInfo

__all__ = ["TrainerRetention"]


@dataclass
class TrainerRetention:
    """transformers' ``rotate_checkpoints`` as a :class:`~shardpoint.lifecycle.policy.PreservationPolicy`."""

    limit: int | None
    best: int | None = None  # the step of state.best_model_checkpoint at the latest save

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        steps = sorted(c.iteration for c in checkpoints)
        if not self.limit or self.limit <= 0 or len(steps) <= self.limit:
            return set(steps)
        protected = {steps[-1]} | ({self.best} if self.best is not None else set())
        # as transformers counts: a best whose folder is gone still raises how many may stay, but is
        # no folder that stays, so it takes no place from the others
        keep = max(self.limit, len(protected))
        unprotected = [s for s in steps if s not in protected]
        doomed = unprotected[: max(0, len(steps) - keep)]  # oldest first, until ``keep`` are left
        return set(steps) - set(doomed)
