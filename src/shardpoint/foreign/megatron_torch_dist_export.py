"""Write megatron-core's ``torch_dist`` format: what Megatron-LM's ``--ckpt-format torch_dist`` loads.

The inverse of :mod:`.megatron_torch_dist`: the same key mapping, run backwards, written
through torch.distributed.checkpoint (DCP), which is what Megatron's ``torch_dist``
backend is. The iteration directory holds

* DCP's ``.metadata`` and ``__0_0.distcp``: every tensor whole, under the global keys
  megatron-core 0.16's ``GPTModel.sharded_state_dict()`` asks for (uniform layers stacked
  over a leading ``num_layers`` dim; with ``transformer_impl == "local"`` the layer norms
  under Transformer Engine's fused names). DCP reshards on load, so one whole chunk per
  tensor loads at any tp/pp/dp: the layout lives only in ``common.pt``'s args and in the
  padded vocabulary, which depends on tp;
* the ``ShardedObject`` s Megatron asks for: each layer's linear ``_extra_state`` (``[None]``
  as megatron-core writes it) and, when the source has RNG state, ``rng_state`` per
  (pp, tp) rank (the source's state of that rank, else rank 0's);
* ``common.pt``: ``args``, ``checkpoint_version``, ``iteration``, the optimizer's
  non-tensor state, ``opt_param_scheduler``, ``num_floating_point_operations_so_far`` and
  ``content_metadata`` (what Megatron reads to rebuild the optimizer's sharded state dict);
* ``metadata.json`` naming the ``torch_dist`` backend; ``latest_checkpointed_iteration.txt``
  is written last.

The optimizer is written in the form megatron-core 0.16 loads for it:

* without ``distributed_optimizer``: its FP32 optimizer's, ``optimizer.state.<exp_avg|exp_avg_sq>.<key>``
  sharded like the parameter, the step as ``common.pt``'s ``optimizer.state.common_step``;
* with it: the distributed optimizer's ``fully_reshardable`` form (model space,
  ``optimizer.state.<param|exp_avg|exp_avg_sq>.<key>``, ``param`` the fp32 master weight),
  recorded in ``content_metadata`` so Megatron builds that form on load, at any dp.

Mixture-of-experts models, and fp16/bf16 models without the distributed optimizer (their
optimizer keeps fp32 copies in another structure), are refused by name: the legacy format
(``--ckpt-format torch``) writes the first, ``--distributed-optimizer`` or ``--no-optimizer``
the second.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import secrets
import shutil
from collections import defaultdict
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem

from shardpoint.errors import CheckpointError, TopologyMismatchError
from shardpoint.foreign._types import ForeignCheckpoint
from shardpoint.foreign._unpickle import save_foreign
from shardpoint.foreign.exporter import (
    CHECKPOINT_VERSION,
    megatron_args,
    refuse_moving_a_live_tracker,
    rng_for,
    write_tracker,
)
from shardpoint.foreign.megatron_moe import num_experts
from shardpoint.foreign.megatron_torch_dist import LOCAL_SPEC_NAMES
from shardpoint.foreign.structure import VOCAB_KEYS, repad_vocab
from shardpoint.offline import single_process

__all__ = ["export_megatron_torch_dist"]

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^((?:decoder|encoder)\.)?layers\.(\d+)\.(.+)$")
_EXTRA_STATE_MODULES = re.compile(r"(self_attention\.linear_proj|self_attention\.linear_qkv|mlp\.linear_fc[12])$")
_TO_FUSED_NAMES = {local: fused for fused, local in LOCAL_SPEC_NAMES.items()}
_METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def export_megatron_torch_dist(
    ckpt: ForeignCheckpoint,
    dst: str | os.PathLike[str],
    *,
    tp: int,
    pp: int,
    dp: int = 1,
    distributed_optimizer: bool = False,
) -> str:
    """Write ``ckpt`` into save directory ``dst`` in megatron-core's ``torch_dist`` format; return the iteration dir.

    ``tp``/``pp``/``dp`` are recorded in the args (and set the padded vocabulary); the
    tensors themselves load at any layout.

    Raises:
        TopologyMismatchError: the layers do not divide into ``pp`` stages, or the vocabulary cannot be re-padded.
        CheckpointError: the iteration exists in ``dst``, the source is not a Megatron-LM model, it has
            experts, or its optimizer cannot be written in this format (each named, with what to do).

    Example:
        >>> export_megatron_torch_dist(read_foreign("/data/run-tp2"), "/data/run-tp1-dist", tp=1, pp=1)
    """
    if ckpt.tool != "megatron" or not ckpt.args:
        raise CheckpointError(f"{ckpt.path}: export to Megatron-LM needs a Megatron-LM source (its args)")
    args = megatron_args(ckpt, tp, pp, dp, distributed_optimizer, ckpt_format="torch_dist")
    _refuse_unsupported(ckpt, args, distributed_optimizer)
    layers = _num_layers(ckpt, pp)
    root = os.fspath(dst)
    release = bool(ckpt.extra.get("release"))
    name = "release" if release else f"iter_{ckpt.iteration:07d}"
    final = os.path.join(root, name)
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists already; export into another directory or remove it first")
    refuse_moving_a_live_tracker(root, ckpt.iteration)
    state: dict[str, Any] = dict(_tensors(ckpt, args, layers, distributed_optimizer))
    state.update(_objects(ckpt, layers, tp, pp))
    common = _common(ckpt, args, distributed_optimizer)
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".shardpoint-tmp-{name}-{secrets.token_hex(4)}")
    try:
        os.makedirs(tmp)
        with single_process():
            dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=_Planner(), no_dist=True)
        save_foreign(common, os.path.join(tmp, "common.pt"))
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            json.dump(_METADATA_JSON, f)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_tracker(root, "release" if release else str(ckpt.iteration))
    log.info("wrote Megatron-LM torch_dist checkpoint %s (tp=%d pp=%d dp=%d)", final, tp, pp, dp)
    return final


class _Planner(DefaultSavePlanner):
    """DCP's planner, writing the objects' bytes as they are: megatron-core's own planner does the same."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # DCP's argument names
        return object


def _refuse_unsupported(ckpt: ForeignCheckpoint, args: Any, distopt: bool) -> None:
    """What this writer does not write, named with the way out, before anything is written."""
    if num_experts(args):
        raise CheckpointError(
            f"{ckpt.path}: a mixture-of-experts model (num_experts={num_experts(args)}) is not written in "
            "torch_dist by this export; write the legacy format (--ckpt-format torch --ep E) instead"
        )
    low_precision = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    if low_precision and not distopt and _with_optimizer(ckpt):
        raise CheckpointError(
            f"{ckpt.path}: a bf16/fp16 model's optimizer is written in torch_dist only as the distributed "
            "optimizer's (add --distributed-optimizer), or drop it with --no-optimizer and start Megatron-LM "
            "with --no-load-optim"
        )


def _with_optimizer(ckpt: ForeignCheckpoint) -> bool:
    return any(ckpt.optimizer.get(n) for n in ckpt.params)


def _num_layers(ckpt: ForeignCheckpoint, pp: int) -> int:
    """The number of transformer layers, checked to be 0..L-1 and to divide into ``pp`` stages."""
    found = sorted({int(m.group(2)) for n in ckpt.params if (m := _LAYER.match(n))})
    if found != list(range(len(found))):
        raise CheckpointError(f"{ckpt.path}: transformer layers {found[:8]} are not numbered 0..L-1")
    if len(found) % pp:
        raise TopologyMismatchError(f"{len(found)} transformer layers do not divide into pp={pp} stages")
    return len(found)


def _key(name: str, local_spec: bool) -> tuple[str, int | None]:
    """A GPTModel parameter name as its ``torch_dist`` key, and its layer (None outside the stacked layers)."""
    match = _LAYER.match(name)
    if not match:
        return name, None
    prefix, layer, rest = match.group(1) or "", int(match.group(2)), match.group(3)
    rest = _TO_FUSED_NAMES.get(rest, rest) if local_spec else rest
    return f"{prefix}layers.{rest}", layer


def _tensors(ckpt: ForeignCheckpoint, args: Any, layers: int, distopt: bool) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, whole, under its ``torch_dist`` key (layers stacked)."""
    local_spec = getattr(args, "transformer_impl", "") == "local"
    vocab, rows = getattr(args, "vocab_size", None), getattr(args, "padded_vocab_size", None)
    stacked: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    state: dict[str, torch.Tensor] = {}
    optimizer = _with_optimizer(ckpt)
    for name, weight in ckpt.params.items():
        values = {"": weight}
        if optimizer and name not in ckpt.buffers:
            values.update(_optimizer_tensors(ckpt, name, weight, distopt))
        key, layer = _key(name, local_spec)
        for prefix, value in values.items():
            if VOCAB_KEYS.search(name) and vocab and rows and value.shape[0] != rows:
                value = repad_vocab(
                    f"{name} {prefix}".strip(), value, vocab, rows, prefix in ("", "optimizer.state.param.")
                )
            if layer is None:
                state[prefix + key] = value.contiguous()
            else:
                stacked[prefix + key][layer] = value
    for key, by_layer in stacked.items():
        if len(by_layer) != layers:
            missing = sorted(set(range(layers)) - set(by_layer))
            raise CheckpointError(f"{ckpt.path}: {key} is missing in layers {missing[:8]}; every layer needs it")
        state[key] = torch.stack([by_layer[i] for i in range(layers)])
    return state


def _optimizer_tensors(ckpt: ForeignCheckpoint, name: str, weight: torch.Tensor, distopt: bool) -> dict[str, Any]:
    """A parameter's moments (and, for the distributed optimizer, its fp32 master) under their key prefixes."""
    entry = ckpt.optimizer.get(name) or {}
    missing = [k for k in ("exp_avg", "exp_avg_sq") if k not in entry]
    if missing:
        raise CheckpointError(
            f"{ckpt.path}: {name} has no {missing[0]}; Megatron's Adam needs both moments of every parameter "
            "(or export the weights only with --no-optimizer)"
        )
    out = {f"optimizer.state.{k}.": entry[k] for k in ("exp_avg", "exp_avg_sq")}
    if distopt:
        out["optimizer.state.param."] = entry.get("master_param", weight).float()
    return out


def _objects(ckpt: ForeignCheckpoint, layers: int, tp: int, pp: int) -> dict[str, io.BytesIO]:
    """megatron-core's ``ShardedObject`` s under their unique keys, as ``torch.save`` bytes of their data list."""
    modules = set()
    for name in ckpt.params:
        match = _LAYER.match(name)
        module = match.group(3).rpartition(".")[0] if match else ""
        if match and _EXTRA_STATE_MODULES.search(module):
            modules.add(f"{match.group(1) or ''}layers.{module}")
    objects = {
        f"{module}._extra_state/shard_{i}_{layers}": _pickled([None])
        for module in sorted(modules)
        for i in range(layers)
    }
    if not ckpt.extra.get("rng_state"):
        if not ckpt.extra.get("release"):
            log.warning("%s has no RNG state to carry over: start Megatron-LM with --no-load-rng", ckpt.path)
        return objects
    states = {(p, t): rng_for(ckpt, t, p) for p in range(pp) for t in range(tp)}
    for (p, t), state in states.items():
        objects[f"rng_state/shard_{p}.{t}_{pp}.{tp}"] = _pickled([state])
    if not all(s.get("rng_tracker_states") for state in states.values() for s in state or [{}]):
        # Megatron-LM's load exits on them (a KeyError), as it does on its own checkpoints without them
        log.warning(
            "%s: the RNG state has no tensor-parallel tracker states: start Megatron-LM with --no-load-rng", ckpt.path
        )
    return objects


def _pickled(data: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    save_foreign(data, buffer)
    buffer.seek(0)
    return buffer


def _common(ckpt: ForeignCheckpoint, args: Any, distopt: bool) -> dict[str, Any]:
    """``common.pt``: everything but the tensors and objects, as megatron-core 0.16's save leaves it."""
    content: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    common: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": ckpt.iteration}
    if _with_optimizer(ckpt):
        step = next((e["step"] for e in ckpt.optimizer.values() if e and "step" in e), None)
        groups = [{k: v for k, v in g.items() if k not in ("param_names", "params", "step")} for g in ckpt.param_groups]
        if distopt:
            content["distrib_optim_sharding_type"] = "fully_reshardable"
            steps = {"step": float(step)} if step is not None else {}
            common["optimizer"] = {
                "optimizer": {"param_groups": [g | steps for g in groups]},
                "param_state_sharding_type": "fully_reshardable",
            }
        else:
            common["optimizer"] = {"param_groups": groups, "state": {} if step is None else {"common_step": step}}
        common["opt_param_scheduler"] = ckpt.scheduler
    common["num_floating_point_operations_so_far"] = ckpt.extra.get("num_floating_point_operations_so_far", 0)
    common["content_metadata"] = content
    return common
