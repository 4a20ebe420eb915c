"""What every foreign reader returns, and the JSON form of the source's args.

A :class:`ForeignCheckpoint` holds a checkpoint of another tool as full, global
tensors: parameters under the tool's own names with *global* layer numbers, and per
parameter its optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``), however the
tool had split or flattened them. Import writes it as a shardpoint ``dist``
checkpoint; export writes it in a tool's format at another layout.

Args of the source (Megatron's ``argparse.Namespace``, DeepSpeed's client args) are
kept as JSON, so they can sit in ``shardpoint.json``'s ``config``: values JSON cannot
hold are tagged (``{"__dtype__": "float32"}``, ``{"__enum__": "megatron....AttnBackend",
"value": 5}``) and :func:`args_from_json` turns them back for export.
"""

from __future__ import annotations

import argparse
import math
import signal
from dataclasses import dataclass, field
from typing import Any

import torch

from shardpoint.foreign._unpickle import STAND_INS, ForeignEnum, ForeignFunction, ForeignObject

__all__ = ["ForeignCheckpoint", "args_from_json", "args_to_json", "namespace_from_json"]


@dataclass
class ForeignCheckpoint:
    """A checkpoint of Megatron-LM or DeepSpeed, read whole into global tensors.

    Attributes:
        tool: ``"megatron"`` or ``"deepspeed"``.
        format: ``"torch"`` (Megatron legacy), ``"torch_dist"``, ``"deepspeed"``.
        path: the iteration directory read.
        iteration: the iteration (Megatron) or global step (DeepSpeed).
        tp, pp, dp: the layout it was saved at.
        ep: the expert-parallel size it was saved at (1 without experts).
        optimizer_sharding: None, ``"distributed-optimizer"`` (Megatron) or ``"zero-N"``.
        params: full tensors under global names (global layer numbers), model order.
        optimizer: per parameter name, ``{"exp_avg": ..., "exp_avg_sq": ..., "step": ...}``.
        param_groups: the optimizer's hyperparameters per group, each with
            ``"param_names"`` listing its parameters in order.
        scheduler: the LR scheduler's state.
        consumed_samples: training samples consumed so far, when the tool records it.
        args: the source's args as JSON (see :func:`args_to_json`).
        split_dims: per parameter, the tensor-parallel dim (None: replicated).
        buffers: the names in ``params`` that are persistent buffers, not parameters (a MoE
            router's ``expert_bias``): no optimizer state, in no param group.
        extra: other small fields worth keeping (FLOPs so far, checkpoint version, RNG).
    """

    tool: str
    format: str
    path: str
    iteration: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    optimizer_sharding: str | None = None
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    scheduler: dict[str, Any] = field(default_factory=dict)
    consumed_samples: int | None = None
    args: dict[str, Any] = field(default_factory=dict)
    split_dims: dict[str, int | None] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    buffers: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        """A JSON summary (tool, format, iteration, layout, optimizer sharding, counts)."""
        return {
            "tool": self.tool,
            "format": self.format,
            "path": self.path,
            "iteration": self.iteration,
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "optimizer_sharding": self.optimizer_sharding,
            "parameters": len(self.params),
            "with_optimizer_state": sum(1 for v in self.optimizer.values() if v),
            "consumed_samples": self.consumed_samples,
        }


def args_to_json(value: Any) -> Any:
    """The JSON form of args (a Namespace or dict); non-JSON values are tagged."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {str(k): args_to_json(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [args_to_json(v) for v in value]}
    if isinstance(value, list):
        return [args_to_json(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, ForeignEnum):
        return {"__enum__": value.qualname, "value": args_to_json(value.value)}
    if isinstance(value, type) and issubclass(value, ForeignFunction):
        return {"__function__": value.qualname}
    if isinstance(value, ForeignObject):
        return {"__object__": value.qualname}
    if hasattr(value, "name") and hasattr(value, "value") and type(value).__module__ == "signal":
        return {"__signal__": value.name}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):  # numpy scalar
        return value.item()
    return {"__repr__": repr(value)}


def args_from_json(value: Any) -> Any:
    """Inverse of :func:`args_to_json` for a dict of args; returns plain values and stand-ins."""
    if isinstance(value, list):
        return [args_from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(args_from_json(v) for v in value["__tuple__"])
    if "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    if "__enum__" in value and value["__enum__"] in STAND_INS:
        return STAND_INS[value["__enum__"]](args_from_json(value["value"]))
    if "__function__" in value and value["__function__"] in STAND_INS:
        return STAND_INS[value["__function__"]]
    if "__signal__" in value:
        return signal.Signals[value["__signal__"]]
    if "__float__" in value:
        return float(value["__float__"])
    return {k: args_from_json(v) for k, v in value.items()}


def namespace_from_json(args: dict[str, Any]) -> argparse.Namespace:
    """Megatron's ``args`` Namespace from its JSON form."""
    return argparse.Namespace(**{k: args_from_json(v) for k, v in args.items()})
