"""megatron-core's optimizers without ``--use-distributed-optimizer``, as shardpoint optimizer state.

Without the distributed optimizer every data-parallel rank holds the whole optimizer
state of its tensor-parallel piece of each parameter: ``FP32Optimizer`` steps the model's
own fp32 parameters, ``Float16OptimizerWithFloat16Params`` (``--bf16``/``--fp16``) steps
fp32 master copies of the bf16/fp16 parameters. Each parameter's state therefore has the
parameter's own box in the global tensor and the parameter's replica id (data-parallel
ranks hold replicas), and goes under the names the distributed optimizer and ``convert
--from megatron`` use: ``<param>.exp_avg``, ``<param>.exp_avg_sq``, ``<param>.step`` and
``<param>.master_param`` for a master copy. A checkpoint saved with one optimizer
therefore loads into the other, and reshards with its parameter.

The shards are views of the live tensors: a load fills them in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from shardpoint.errors import CheckpointError
from shardpoint.state.sharding import Shard
from shardpoint.state.train_state import find_param, param_shard_index

__all__ = [
    "OptimizerAdapter",
    "PlainOptimizerState",
    "UnsupportedOptimizerError",
    "inner_optimizers",
    "is_distributed",
    "is_plain",
]


class UnsupportedOptimizerError(CheckpointError):
    """A Megatron optimizer whose state shardpoint cannot place (raised before anything is written)."""


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers of a ``ChainedOptimizer`` (or ``[optimizer]``)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def is_distributed(opt: Any) -> bool:
    """megatron-core's ``DistributedOptimizer`` (``--use-distributed-optimizer``)."""
    return hasattr(opt, "model_param_group_index_map")


def is_plain(opt: Any) -> bool:
    """``FP32Optimizer`` or ``Float16OptimizerWithFloat16Params`` over a torch optimizer (or a stub without one)."""
    if is_distributed(opt) or not hasattr(opt, "init_state_fn"):  # not a MegatronOptimizer
        return False
    inner = getattr(opt, "optimizer", None)
    return inner is None or isinstance(inner, torch.optim.Optimizer)


def refuse(optimizer: Any) -> UnsupportedOptimizerError:
    """The error for an optimizer that is neither kind, or a chain that mixes them."""
    kinds = sorted({type(opt).__name__ for opt in inner_optimizers(optimizer)})
    return UnsupportedOptimizerError(
        f"shardpoint's Megatron integration cannot save the state of {'/'.join(kinds)}: it takes megatron-core's "
        "DistributedOptimizer (--use-distributed-optimizer) or its FP32Optimizer / Float16OptimizerWithFloat16Params "
        "over a torch optimizer, not a mix of them (nothing was written; run with --use-distributed-optimizer)"
    )


class OptimizerAdapter:
    """What both Megatron optimizer adapters show the load pipeline: the wrapped optimizer's groups,
    and no plain ``state_dict`` (their state goes through ``sharded_state_dict``)."""

    optimizer: Any

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return {}


class PlainOptimizerState(OptimizerAdapter):
    """megatron-core's (chained) non-distributed optimizer as a shardpoint distributed optimizer.

    ``sharded_state_dict(model_shards)`` and ``load_sharded_state_dict(loaded)`` are the
    two calls :func:`~shardpoint.state.train_state.collect` and the load pipeline make.
    """

    def __init__(self, optimizer: Any, model: Any = None):
        """``model``: the :class:`~.state.MegatronModel` whose shards the state follows (its
        ``resized`` vocabulary tensors, clipped to a checkpoint's rows; see :mod:`.vocab`)."""
        self.optimizer = optimizer
        self.model = model
        self.inner = [opt for opt in inner_optimizers(optimizer) if getattr(opt, "optimizer", None) is not None]
        self._padded: list[tuple[torch.nn.Parameter, torch.nn.Parameter, dict[str, Any], int]] = []

    def sharded_state_dict(self, model_shards: dict[str, Shard]) -> dict[str, Shard]:
        index = {**param_shard_index(model_shards), **(self.model.resized if self.model is not None else {})}
        out: dict[str, Shard] = {}
        self._padded = []
        for opt, model_param, main_param in self._params():
            key, shard = find_param(index, model_param)
            state = _ensure_state(opt, main_param)
            if shard is None or shard.tensor.shape != model_param.shape:  # a vocabulary clipped to saved rows
                self._padded.append((model_param, main_param, state, 0 if shard is None else shard.tensor.shape[0]))
                if shard is None:
                    continue
            for name, value in state.items():
                if not isinstance(value, torch.Tensor):
                    value = state[name] = torch.tensor(value, dtype=torch.float32)
                if value.dim() == 0:  # Adam's step: one scalar that every holder of the parameter agrees on
                    main = shard.replica_id == 0 and not any(shard.global_offset)
                    out[f"{key}.{name}"] = Shard(value, (), (), 0 if main else 1)
                elif value.shape == model_param.shape:
                    out[f"{key}.{name}"] = _like(shard, value)
            if main_param is not model_param:  # fp32 master weights beside bf16/fp16 parameters
                out[f"{key}.master_param"] = _like(shard, main_param.data)
        return out

    def load_sharded_state_dict(self, loaded: dict[str, Shard]) -> None:
        """Nothing to copy (the shards were views of the live state, filled in place), except rows
        past a checkpoint's vocabulary: the model's first, then moments zero and master copies from them."""
        from .vocab import fill_state

        if self.model is not None and self.model.vocab is not None:  # on every tp rank, padded here or not
            self.model.vocab.fill_model()
        for model_param, main_param, state, kept in self._padded:
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.shape == model_param.shape:
                    fill_state(value, kept, model_param.data, master=False)
            if main_param is not model_param:
                fill_state(main_param.data, kept, model_param.data, master=True)

    def _params(self) -> Iterator[tuple[Any, torch.nn.Parameter, torch.nn.Parameter]]:
        """``(optimizer, model parameter, parameter the torch optimizer steps)`` for every trained parameter."""
        for opt in self.inner:
            if hasattr(opt, "float16_groups"):  # Float16OptimizerWithFloat16Params
                for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                    yield from ((opt, p, m) for p, m in zip(model_group, main_group))
                for group in opt.fp32_from_fp32_groups:
                    yield from ((opt, p, p) for p in group)
            else:  # FP32Optimizer: the torch optimizer steps the model's own parameters
                for group in opt.optimizer.param_groups:
                    yield from ((opt, p, p) for p in group["params"])


def _like(shard: Shard, value: torch.Tensor) -> Shard:
    """``value`` (shaped like the parameter) in ``shard``'s box: its leading rows when the shard holds fewer
    (a vocabulary clipped to a checkpoint's rows)."""
    return shard.like(value if value.shape == shard.tensor.shape else value[: shard.tensor.shape[0]])


def _ensure_state(opt: Any, param: torch.nn.Parameter) -> dict[str, Any]:
    """The torch optimizer's state of ``param``, created (zeros, step 0) when it has not stepped yet.

    A load needs targets to fill; a save before the first step stores what a fresh Adam
    would start from. Megatron's own ``init_state_fn`` creates the moments, not the step.
    """
    state = opt.optimizer.state[param]
    if not state and getattr(opt, "init_state_fn", None) is not None:
        opt.init_state_fn(opt.optimizer, getattr(opt, "config", None))
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                if opt.optimizer.state[p]:
                    opt.optimizer.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))
    return state
