"""State that belongs to one rank: stored under that rank's own key, restored at the same layout only.

Some tensors have no place in a global tensor: Adafactor's factored statistics of
a tensor-parallel piece (``row_var`` of shape ``(rows / tp, 1)``) describe that piece
only, and an optimizer scalar may differ by rank. Storing them under one global key
would keep one rank's value and hand it to every rank. They are kept per rank
instead (:attr:`~shardpoint.state.train_state.FlatState.rank_local`):

- ``dist`` format: DCP key ``rank_local.<rank, 5 digits>.<key>``, a whole tensor;
- ``torch`` format: a ``rank_local`` list with one dict per data-parallel rank.

At the layout they were saved at, every rank gets its own values back exactly. At
another layout there is no exact answer; :func:`resolve` raises by default, and with
``optimizer_reshard="reinit"`` re-initialises them (zeros, as a fresh optimizer
would start them) with a warning naming each one, so the rest still loads.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from shardpoint.errors import TopologyMismatchError
from shardpoint.parallel import comm
from shardpoint.state.sharding import Shard
from shardpoint.state.train_state import FlatState

__all__ = [
    "RESHARD_POLICIES",
    "RankLocalPlan",
    "reinitialise",
    "resolve",
    "warn_reinit",
    "whole",
]

log = logging.getLogger(__name__)

RESHARD_POLICIES = ("error", "reinit")


def whole(tensor: torch.Tensor) -> Shard:
    """A rank-local tensor as a shard: the whole of a tensor of its own shape."""
    return Shard(tensor, tuple(tensor.shape), (0,) * tensor.dim())


@dataclass
class RankLocalPlan:
    """Where each tensor of a load comes from.

    Attributes:
        shared: global key -> target, read as a box of a global tensor (the usual case).
        own: key -> target, read from this rank's own stored copy.
        reinit: key -> target of states stored per rank at another layout, to zero
            (:func:`reinitialise`) once the rest has loaded.
    """

    shared: dict[str, Shard] = field(default_factory=dict)
    own: dict[str, torch.Tensor] = field(default_factory=dict)
    reinit: dict[str, torch.Tensor] = field(default_factory=dict)


def resolve(
    flat: FlatState,
    saved_shared: Collection[str],
    saved_own: Collection[str],
    saved_per_rank: Collection[str],
    *,
    policy: str,
    where: str,
) -> RankLocalPlan:
    """Decide, for every tensor this rank loads, which stored copy fills it.

    Args:
        flat: the targets (``tensors`` and ``rank_local``).
        saved_shared: keys stored as global tensors.
        saved_own: keys stored per rank for this rank; pass none at another layout.
        saved_per_rank: keys stored per rank for any rank.
        policy: ``"error"`` or ``"reinit"`` for per-rank state at another layout.
        where: the checkpoint, for messages.

    Raises:
        TopologyMismatchError: per-rank state at another layout with ``policy="error"``.
    """
    plan = RankLocalPlan()
    targets = {**flat.tensors, **{key: whole(t) for key, t in flat.rank_local.items()}}
    unplaceable = []
    for key, target in targets.items():
        if key in saved_own:
            plan.own[key] = target.tensor
        elif key in saved_shared or key not in saved_per_rank:
            plan.shared[key] = target  # absent keys are reported as missing by the format
        else:
            unplaceable.append(key)
    if unplaceable and policy != "reinit":
        raise TopologyMismatchError(
            f"{where}: {len(unplaceable)} optimizer state tensor(s) were saved per rank (they describe one "
            f"rank's piece of a parameter and have no global layout) and cannot be resharded exactly to this "
            f"layout: {', '.join(sorted(unplaceable)[:6])}{' ...' if len(unplaceable) > 6 else ''}. Load at the "
            "layout it was saved at, or pass optimizer_reshard='reinit' to load everything else and "
            "re-initialise these states."
        )
    plan.reinit = {key: targets[key].tensor for key in sorted(unplaceable)}
    return plan


def reinitialise(plan: RankLocalPlan) -> None:
    """Zero the states :func:`resolve` could not place; called once everything else has loaded."""
    with torch.no_grad():
        for tensor in plan.reinit.values():
            tensor.zero_()


def warn_reinit(keys: list[str], where: str) -> None:
    """Collective: rank 0 warns once about every rank's re-initialised states."""
    every = sorted(set().union(*comm.all_gather(keys)))
    if every and comm.rank() == 0:
        log.warning(
            "%s was saved at another layout: %d per-rank optimizer state tensor(s) re-initialised to zeros "
            "(optimizer_reshard='reinit'): %s",
            where,
            len(every),
            ", ".join(every),
        )
