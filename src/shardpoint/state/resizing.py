"""Model tensors whose size is data: loaded out of place, then through the model's own ``load_state_dict``.

An in-place load fills the tensors the model already has, so it cannot change a size.
Some modules keep state whose size is data, not config: a sampler's order as a buffer,
a vocabulary that grows, a module that rebuilds itself in ``_load_from_state_dict``. The
Trainer loads those through ``model.load_state_dict``, which gives each module the
chance. shardpoint does the same for tensors that are whole on every rank (a plain
tensor of a model without ``sharded_state_dict()``): the saved tensor is read into a
fresh tensor of its saved size and handed to the model. A sharded tensor, or one a
module does not resize, is still a :class:`~shardpoint.errors.ShapeMismatchError`.

Every rank holds the same whole tensors, so every rank takes the same decision; no
round is needed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from shardpoint.errors import ShapeMismatchError
from shardpoint.state import naming
from shardpoint.state.sharding import Shard, is_dtensor

__all__ = ["load_resized", "plain_keys", "resized_target"]

log = logging.getLogger(__name__)


def plain_keys(model: torch.nn.Module, state: Mapping[str, Any], prefix: str) -> set[str]:
    """Keys (with ``prefix``) of ``state`` that the model's own ``load_state_dict`` may resize."""
    if hasattr(naming.unwrap(model), "sharded_state_dict"):
        return set()  # its keys are its own, not load_state_dict's
    return {prefix + k for k, v in state.items() if isinstance(v, torch.Tensor) and not is_dtensor(v)}


def resized_target(shard: Shard, saved_shape: tuple[int, ...]) -> Shard:
    """A fresh whole tensor of the saved size, like ``shard``'s, for the format to fill."""
    tensor = torch.empty(saved_shape, dtype=shard.tensor.dtype, device=shard.tensor.device)
    return Shard(tensor, saved_shape, (0,) * len(saved_shape))


def load_resized(
    model: torch.nn.Module, resized: Mapping[str, tuple[tuple[int, ...], torch.Tensor]], prefix: str
) -> None:
    """Hand tensors loaded at their saved size to the model's ``load_state_dict`` (``strict=False``).

    ``resized`` maps a key (with ``prefix``) to the model's shape before the load and the
    loaded tensor. A module that does not resize them (the default
    ``_load_from_state_dict`` refuses another size) raises ShapeMismatchError naming
    each key, both sizes and the module's own words.
    """
    if not resized:
        return
    sizes = "; ".join(
        f"tensor {k!r} has global shape {tuple(t.shape)} in the checkpoint but {here} here"
        for k, (here, t) in sorted(resized.items())
    )
    log.info("loading tensors saved at another size through the model's load_state_dict: %s", sizes)
    try:
        naming.unwrap(model).load_state_dict({k[len(prefix) :]: t for k, (_, t) in resized.items()}, strict=False)
    except RuntimeError as exc:
        raise ShapeMismatchError(
            f"{sizes}; the model's tensor has another size than the saved one, and the model's own "
            f"load_state_dict did not take it ({' '.join(str(exc).split())}): its config differs from the saved "
            "one, or the module keeping that state must resize it in its _load_from_state_dict"
        ) from None
