"""Write Megatron-LM's legacy ``torch`` format at a new tp/pp (and dp), optimizer included.

The source is a Megatron-LM checkpoint (legacy or ``torch_dist``) or a shardpoint
checkpoint imported from one (:func:`from_shardpoint`). The output is what
``megatron/training/checkpointing.py`` writes, so training continues there:

* ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` per tensor/pipeline rank with
  ``args`` (an ``argparse.Namespace``: the source's args with the parallel sizes,
  world size, padded vocabulary and optimizer flag updated), ``checkpoint_version``,
  ``iteration``, ``model`` (local layer numbers; ``_extra_state`` entries as Megatron
  writes them), ``optimizer``, ``opt_param_scheduler``, ``rng_state`` and
  ``num_floating_point_operations_so_far``;
* with ``distributed_optimizer``, ``distrib_optim.pt`` per model-parallel rank: the
  gathered buffer (parameters in reverse order, 64-aligned; see
  :func:`shardpoint.foreign.megatron.buffer_layout`), independent of the DP size;
* ``latest_checkpointed_iteration.txt``, written last.

A source without optimizer state (a Hugging Face model, ``convert --from hf``) is
written as Megatron's *release* checkpoint, as its loader expects of pretrained
weights: ``release/mp_rank_*/model_optim_rng.pt`` without ``optimizer`` and
``opt_param_scheduler``, and a tracker saying ``release``; Megatron-LM then loads the
weights and starts at iteration 0 with a fresh optimizer (no flags needed).

Re-splitting is structure-aware (:mod:`.structure`): query groups must divide by TP,
gated MLPs are re-interleaved, the vocabulary is re-padded for the new TP, layers are
renumbered per stage, and a tied output layer is added on the last stage when pp > 1.
Any reshape that cannot be exact raises an error naming the tensor.

RNG: each rank gets the source's RNG state of the same (tp, pp) rank when it exists,
else rank 0's (streams cannot correspond across layouts); without any source RNG
(``torch_dist``/imported sources) ``rng_state`` is omitted and Megatron-LM must be
started with ``--no-load-rng``.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import secrets
import shutil
from collections import OrderedDict
from typing import Any

import torch

from shardpoint import offline
from shardpoint.errors import CheckpointError, TopologyMismatchError
from shardpoint.foreign._types import ForeignCheckpoint, namespace_from_json
from shardpoint.foreign._unpickle import save_foreign
from shardpoint.foreign.megatron import MODEL_FILE, OPTIM_FILE, buffer_layout
from shardpoint.foreign.megatron_torch_dist import model_order
from shardpoint.foreign.structure import (
    VOCAB_KEYS,
    glu_to_tp,
    padded_vocab_size,
    repad_vocab,
    split_dim,
    split_for_tp,
)
from shardpoint.state.train_state import MODEL_PREFIX, OPTIM_PREFIX

__all__ = ["export_megatron", "from_shardpoint", "holds_megatron_model"]

log = logging.getLogger(__name__)

_LAYER = re.compile(r"(?<![^.])layers\.(\d+)\.")
_EXTRA_STATE_MODULES = re.compile(r"(linear_proj|linear_qkv|linear_fc1|linear_fc2|output_layer)$")
CHECKPOINT_VERSION = 3.0


# args every Megatron-LM GPT records and shardpoint's own configs lack
_MEGATRON_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "position_embedding_type", "padded_vocab_size")


def holds_megatron_model(common: dict[str, Any], release: bool, config: dict[str, Any]) -> bool:
    """Whether a shardpoint checkpoint holds a Megatron-LM model: imported from one, or its release.

    A release keeps only the weights and ``shardpoint.json``'s config (the Megatron args),
    not the ``foreign`` record of the import, so those args tell it.
    """
    if (common.get("foreign") or {}).get("tool") == "megatron":
        return True
    return release and all(config.get(k) is not None for k in _MEGATRON_ARGS)


def from_shardpoint(path: str, iteration: int | None = None) -> ForeignCheckpoint:
    """A shardpoint checkpoint imported from Megatron-LM or Hugging Face, back as a :class:`ForeignCheckpoint`."""
    full = offline.read_full(path, iteration)
    foreign = full.common.get("foreign") or {}
    if not holds_megatron_model(full.common, full.metadata.release, dict(full.metadata.config)):
        raise CheckpointError(
            f"{full.path} was not imported from Megatron-LM (its common state has no Megatron args); "
            "export to Megatron needs the model's Megatron args"
        )
    ckpt = ForeignCheckpoint(
        tool="megatron",
        format=foreign.get("format", "release" if full.metadata.release else "torch"),
        path=full.path,
        iteration=full.metadata.iteration,
        tp=foreign.get("tp", 1),
        pp=foreign.get("pp", 1),
        dp=foreign.get("dp", 1),
        scheduler=dict(full.common.get("scheduler") or {}),
        consumed_samples=full.metadata.consumed_samples,
        args=dict(full.metadata.config),
        extra={
            "checkpoint_version": foreign.get("checkpoint_version"),
            "rng_state": foreign.get("rng_state"),
            "release": full.metadata.release,
        },
    )
    flops = (full.common.get("extra") or {}).get("flops")
    ckpt.extra["num_floating_point_operations_so_far"] = int(flops) if flops is not None else 0
    for key, tensor in full.tensors.items():
        if key.startswith(MODEL_PREFIX):
            ckpt.params[key[len(MODEL_PREFIX) :]] = tensor
    for key, tensor in full.tensors.items():
        if key.startswith(OPTIM_PREFIX):
            name, _, state_key = key[len(OPTIM_PREFIX) :].rpartition(".")
            ckpt.optimizer.setdefault(name, {})[state_key] = tensor
    order = [n for group in foreign.get("param_groups", []) for n in group]
    ckpt.params = {n: ckpt.params[n] for n in sorted(ckpt.params, key=_model_rank(order or list(ckpt.params)))}
    for hyper, names in zip(full.common.get("optimizer_param_groups", []), foreign.get("param_groups", [])):
        ckpt.param_groups.append(dict(hyper) | {"param_names": list(names)})
    return ckpt


def _model_rank(order: list[str]) -> Any:
    ranked = list(model_order(dict.fromkeys(order, None)))  # type: ignore[arg-type]
    position = {n: i for i, n in enumerate(ranked)}
    return lambda name: position.get(name, len(position))


def export_megatron(
    ckpt: ForeignCheckpoint,
    dst: str | os.PathLike[str],
    *,
    tp: int,
    pp: int,
    dp: int = 1,
    distributed_optimizer: bool = False,
) -> str:
    """Write ``ckpt`` into save directory ``dst`` in Megatron-LM's legacy format; return the iteration directory.

    Raises:
        TopologyMismatchError: a tensor (named) or the layer count does not divide.
        CheckpointError: the iteration exists in ``dst`` already, or the source lacks Megatron args.

    Example:
        >>> export_megatron(read_foreign("/data/run-tp2"), "/data/run-tp1", tp=1, pp=1)
    """
    if ckpt.tool != "megatron" or not ckpt.args:
        raise CheckpointError(f"{ckpt.path}: export to Megatron-LM needs a Megatron-LM source (its args)")
    if ckpt.args.get("num_experts"):
        raise CheckpointError(
            f"{ckpt.path}: export of mixture-of-experts models (num_experts={ckpt.args['num_experts']}) to "
            "Megatron-LM is not supported yet; load the imported checkpoint with shardpoint at any ep instead"
        )
    args = _new_args(ckpt, tp, pp, dp, distributed_optimizer)
    root = os.fspath(dst)
    release = bool(ckpt.extra.get("release"))
    name = "release" if release else f"iter_{ckpt.iteration:07d}"
    final = os.path.join(root, name)
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists already; export into another directory or remove it first")
    _refuse_moving_a_live_tracker(root, ckpt.iteration)
    stages = _stage_plan(ckpt, pp, args)
    pieces = _tp_pieces(ckpt, tp, args)
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".shardpoint-tmp-{name}-{secrets.token_hex(4)}")
    try:
        for p, names in enumerate(stages):
            for t in range(tp):
                folder = os.path.join(tmp, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
                os.makedirs(folder)
                _write_rank(ckpt, args, folder, names, pieces, t, p, distributed_optimizer)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    with open(tracker + ".tmp", "w") as f:
        f.write("release" if release else str(ckpt.iteration))
    os.replace(tracker + ".tmp", tracker)
    log.info("wrote Megatron-LM checkpoint %s (tp=%d pp=%d dp=%d)", final, tp, pp, dp)
    return final


def _refuse_moving_a_live_tracker(root: str, iteration: int) -> None:
    """Never rewind another run: a tracker naming a newer iteration belongs to a run that is still going."""
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    if not os.path.exists(tracker):
        return
    with open(tracker) as f:
        current = f.read().strip()
    if current == "release" or (current.isdigit() and int(current) > iteration):
        raise CheckpointError(
            f"{tracker} names {current}, newer than the exported iteration {iteration}; exporting here would "
            "rewind that run. Export into a new directory"
        )


def _new_args(ckpt: ForeignCheckpoint, tp: int, pp: int, dp: int, distopt: bool) -> Any:
    args = namespace_from_json(ckpt.args)
    old_tp = getattr(args, "tensor_model_parallel_size", 1)
    old_world = getattr(args, "world_size", None)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.data_parallel_size, args.world_size = dp, tp * pp * dp
    if getattr(args, "expert_tensor_parallel_size", None) == old_tp:
        args.expert_tensor_parallel_size = tp
    if getattr(args, "inprocess_active_world_size", None) == old_world:
        args.inprocess_active_world_size = tp * pp * dp
    args.use_distributed_optimizer = distopt
    if hasattr(args, "ckpt_format"):
        args.ckpt_format = "torch"  # what is written here, whatever the source was (torch_dist)
    if hasattr(args, "use_dist_ckpt"):
        args.use_dist_ckpt = False
    if getattr(args, "vocab_size", None) and getattr(args, "make_vocab_size_divisible_by", None):
        args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, tp)
    gbs, mbs = getattr(args, "global_batch_size", None), getattr(args, "micro_batch_size", None)
    if gbs and mbs and gbs % (mbs * dp):
        log.warning(
            "global_batch_size=%d does not divide by micro_batch_size*dp=%d; set it when resuming", gbs, mbs * dp
        )
    return args


def _stage_plan(ckpt: ForeignCheckpoint, pp: int, args: Any) -> list[list[str]]:
    """Global parameter names held by each pipeline stage, in model order."""
    layers = sorted({int(m.group(1)) for n in ckpt.params if (m := _LAYER.search(n))})
    if len(layers) % pp:
        raise TopologyMismatchError(f"{len(layers)} transformer layers do not divide into pp={pp} stages")
    per_stage = len(layers) // pp
    stages: list[list[str]] = [[] for _ in range(pp)]
    tied = not getattr(args, "untie_embeddings_and_output_weights", True)
    for name in ckpt.params:
        match = _LAYER.search(name)
        if match:
            stages[layers.index(int(match.group(1))) // per_stage].append(name)
        elif name.startswith("embedding."):
            stages[0].append(name)
        else:
            stages[-1].append(name)
    if tied and pp > 1 and "output_layer.weight" not in ckpt.params:
        stages[-1].append("output_layer.weight")  # mcore keeps a copy on the last stage, kept in sync
    return stages


def _tp_pieces(ckpt: ForeignCheckpoint, tp: int, args: Any) -> dict[str, dict[str, list[torch.Tensor]]]:
    """Per parameter, its value and each optimizer state cut for every TP rank."""
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    groups = groups or getattr(args, "num_attention_heads", None)
    swiglu = bool(getattr(args, "swiglu", False))
    vocab, rows = getattr(args, "vocab_size", None), getattr(args, "padded_vocab_size", None)
    result = {}
    for name, tensor in ckpt.params.items():
        values = {"param": tensor, **ckpt.optimizer.get(name, {})}
        result[name] = {}
        for key, value in values.items():
            label = name if key == "param" else f"{name} ({key})"
            if VOCAB_KEYS.search(name) and vocab and rows and value.dim() >= 1 and value.shape[0] != rows:
                value = repad_vocab(label, value, vocab, rows, key == "param")
            dim = split_dim(name)
            if value.dim() == 0:
                result[name][key] = [value] * tp
            elif swiglu and dim == 0 and "linear_fc1" in name:
                result[name][key] = glu_to_tp(label, value, tp)
            else:
                result[name][key] = split_for_tp(label, value, dim, tp, groups)
    if "output_layer.weight" not in result and "embedding.word_embeddings.weight" in result:
        result["output_layer.weight"] = result["embedding.word_embeddings.weight"]  # tied, pp > 1
    return result


def _local(name: str, offset: int) -> str:
    return _LAYER.sub(lambda m: f"layers.{int(m.group(1)) - offset}.", name, count=1) if offset else name


def _write_rank(
    ckpt: ForeignCheckpoint, args: Any, folder: str, names: list[str], pieces: dict, t: int, p: int, distopt: bool
) -> None:
    offset = min((int(m.group(1)) for n in names if (m := _LAYER.search(n))), default=0)
    model: OrderedDict[str, Any] = OrderedDict()
    for i, name in enumerate(names):
        local = _local(name, offset)
        model[local] = pieces[name]["param"][t]
        module = local.rpartition(".")[0]
        following = _local(names[i + 1], offset).rpartition(".")[0] if i + 1 < len(names) else None
        if _EXTRA_STATE_MODULES.search(module) and following != module:
            model[f"{module}._extra_state"] = None
    rank_args = copy.copy(args)
    # the args of the rank that saves this file: data-parallel rank 0 of (t, p), Megatron's rank order
    for attr in ("rank", "local_rank"):
        if hasattr(rank_args, attr):
            setattr(rank_args, attr, t + p * args.tensor_model_parallel_size * args.data_parallel_size)
    state: dict[str, Any] = {
        "args": rank_args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": ckpt.iteration,
        "model": model,
    }
    with_optimizer = any(ckpt.optimizer.get(n) for n in ckpt.params)
    if with_optimizer:  # pretrained weights (a release) have none: Megatron then builds a fresh optimizer
        state["optimizer"] = _optimizer(ckpt, names, pieces, t, distopt)
        state["opt_param_scheduler"] = ckpt.scheduler
    rng = _rng_for(ckpt, t, p)
    if rng is not None:
        state["rng_state"] = rng
    state["num_floating_point_operations_so_far"] = ckpt.extra.get("num_floating_point_operations_so_far", 0)
    save_foreign(state, os.path.join(folder, MODEL_FILE))
    if distopt and with_optimizer:
        save_foreign(
            _distrib_optim(names, pieces, t, os.path.join(folder, OPTIM_FILE)), os.path.join(folder, OPTIM_FILE)
        )


def _groups_of(ckpt: ForeignCheckpoint, names: list[str]) -> list[tuple[dict[str, Any], list[str]]]:
    held = set(names)
    result = []
    for group in ckpt.param_groups:
        members = [n for n in group["param_names"] if n in held]
        if (
            "output_layer.weight" in held
            and "output_layer.weight" not in ckpt.params
            and "embedding.word_embeddings.weight" in group["param_names"]
        ):
            members.append("output_layer.weight")
        result.append(({k: v for k, v in group.items() if k != "param_names"}, [n for n in names if n in set(members)]))
    return result


def _optimizer(ckpt: ForeignCheckpoint, names: list[str], pieces: dict, t: int, distopt: bool) -> dict[str, Any]:
    groups = _groups_of(ckpt, names)
    if distopt:
        step = next((pieces[n]["step"][t] for n in names if "step" in pieces[n]), None)
        return {
            "optimizer": {
                "param_groups": [hyper | ({"step": float(step)} if step is not None else {}) for hyper, _ in groups]
            }
        }
    state, param_groups, index = {}, [], 0
    for hyper, members in groups:
        ids = []
        for name in members:
            entry = {k: v[t] for k, v in pieces[name].items() if k in ("step", "exp_avg", "exp_avg_sq")}
            if entry:
                state[index] = {k: entry[k] for k in ("step", "exp_avg", "exp_avg_sq") if k in entry}
            ids.append(index)
            index += 1
        param_groups.append(hyper | {"params": ids})
    return {"state": state, "param_groups": param_groups}


def _distrib_optim(names: list[str], pieces: dict, t: int, where: str) -> dict[Any, Any]:
    shapes = {n: pieces[n]["param"][t].shape for n in names}
    offsets, length = buffer_layout(names, shapes)
    dtype = pieces[names[0]]["param"][t].dtype
    buffers = {key: torch.zeros(length, dtype=torch.float32) for key in ("param", "exp_avg", "exp_avg_sq")}
    for name in names:
        start = offsets[name]
        for key, flat in buffers.items():
            if key not in pieces[name]:
                raise CheckpointError(f"{where}: {name} has no {key}; the distributed optimizer needs every moment")
            value = pieces[name][key][t]
            flat[start : start + value.numel()] = value.reshape(-1).float()
    return {"buckets_coalesced": True, 0: {(dtype, torch.float32): {**buffers, "numel_unpadded": length}}}


def _rng_for(ckpt: ForeignCheckpoint, t: int, p: int) -> Any:
    states = ckpt.extra.get("rng_state") or {}
    found = states.get(f"{t}_{p}")
    if found is None and states:
        found = states.get("0_0")
    if found is None:
        if not ckpt.extra.get("release"):  # a release loads no RNG state
            log.warning("%s has no RNG state to carry over: start Megatron-LM with --no-load-rng", ckpt.path)
        return None
    return _rng_from_safe(found)


def _rng_from_safe(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Megatron's ``rng_state`` list, with the numpy state turned back into a numpy tuple."""
    import numpy as np

    result = []
    for state in states:
        state = dict(state)
        np_state = state.get("np_rng_state")
        if np_state is not None:
            state["np_rng_state"] = (np_state[0], np.asarray(np_state[1].numpy(), dtype=np.uint32), *np_state[2:])
        result.append(state)
    return result
