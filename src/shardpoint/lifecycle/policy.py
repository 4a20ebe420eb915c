"""When to save and what to keep: small objects with pure methods (Orbax's split).

Nothing here touches storage or process groups, so every rule is testable with
plain values. The Checkpointer asks a :class:`SaveDecisionPolicy` whether to save
at a step, and a list of :class:`PreservationPolicy` objects which committed
checkpoints to keep; a checkpoint is kept when *any* policy keeps it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "AnySaveDecision",
    "BestN",
    "CheckpointInfo",
    "EveryNMinutes",
    "EveryNSteps",
    "KeepEvery",
    "LatestN",
    "PreservationPolicy",
    "SaveDecisionPolicy",
    "preservation_policies",
    "save_decision",
    "select_for_deletion",
]


@dataclass(frozen=True)
class CheckpointInfo:
    """What retention may look at: a committed checkpoint's iteration and metrics."""

    iteration: int
    metrics: dict[str, float] = field(default_factory=dict)


class SaveDecisionPolicy(Protocol):
    def should_save(self, iteration: int, now: float, last_save_time: float) -> bool: ...


@dataclass(frozen=True)
class EveryNSteps:
    """Save when ``iteration % interval == 0`` (Megatron's ``--save-interval``)."""

    interval: int

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"save_interval must be >= 1, got {self.interval}")

    def should_save(self, iteration: int, now: float, last_save_time: float) -> bool:
        return iteration > 0 and iteration % self.interval == 0


@dataclass(frozen=True)
class EveryNMinutes:
    """Save once ``minutes`` have passed since the last save (or since start)."""

    minutes: float

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"save_interval_minutes must be > 0, got {self.minutes}")

    def should_save(self, iteration: int, now: float, last_save_time: float) -> bool:
        return now - last_save_time >= self.minutes * 60


@dataclass(frozen=True)
class AnySaveDecision:
    """Save when any of ``policies`` says so."""

    policies: tuple[SaveDecisionPolicy, ...]

    def should_save(self, iteration: int, now: float, last_save_time: float) -> bool:
        return any(p.should_save(iteration, now, last_save_time) for p in self.policies)


class PreservationPolicy(Protocol):
    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """Iterations to keep among ``checkpoints`` (sorted oldest first)."""
        ...


@dataclass(frozen=True)
class LatestN:
    """Keep the newest ``n`` checkpoints (``keep_last``)."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.n}")

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.iteration for c in checkpoints[-self.n :]}


@dataclass(frozen=True)
class KeepEvery:
    """Keep every checkpoint whose iteration is a multiple of ``k`` forever (``keep_every``)."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"keep_every must be >= 1, got {self.k}")

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.iteration for c in checkpoints if c.iteration % self.k == 0}


@dataclass(frozen=True)
class BestN:
    """Keep the ``n`` checkpoints with the best ``metric`` (``keep_best=(n, metric, mode)``).

    Checkpoints saved without the metric are never counted as best.
    """

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"keep_best mode must be 'min' or 'max', got {self.mode!r}")
        if self.n < 1:
            raise ValueError(f"keep_best count must be >= 1, got {self.n}")

    def should_preserve(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        scored = [
            c
            for c in checkpoints
            if isinstance(c.metrics.get(self.metric), (int, float)) and not math.isnan(c.metrics[self.metric])
        ]
        sign = 1 if self.mode == "min" else -1
        scored.sort(key=lambda c: (sign * c.metrics[self.metric], -c.iteration))
        return {c.iteration for c in scored[: self.n]}


def save_decision(every_steps: int | None, every_minutes: float | None) -> AnySaveDecision:
    """The Checkpointer's ``save_interval`` / ``save_interval_minutes`` as one policy (either one saves)."""
    decisions: list[SaveDecisionPolicy] = [EveryNSteps(every_steps)] if every_steps else []
    if every_minutes:
        decisions.append(EveryNMinutes(every_minutes))
    return AnySaveDecision(tuple(decisions))


def preservation_policies(
    keep_last: int | None, keep_every: int | None, keep_best: tuple[int, str, str] | None
) -> list[PreservationPolicy]:
    """The Checkpointer's ``keep_*`` options as policies; a checkpoint any of them keeps survives."""
    policies = [
        LatestN(keep_last) if keep_last else None,
        KeepEvery(keep_every) if keep_every else None,
        BestN(*keep_best) if keep_best else None,
    ]
    return [p for p in policies if p is not None]


def select_for_deletion(
    checkpoints: Sequence[CheckpointInfo], policies: Sequence[PreservationPolicy], protected: set[int]
) -> list[int]:
    """Iterations that no policy keeps and that are not ``protected`` (e.g. the tracker's target).

    With no policies everything is kept.
    """
    if not policies:
        return []
    ordered = sorted(checkpoints, key=lambda c: c.iteration)
    keep = set(protected)
    for policy in policies:
        keep |= policy.should_preserve(ordered)
    return [c.iteration for c in ordered if c.iteration not in keep]
