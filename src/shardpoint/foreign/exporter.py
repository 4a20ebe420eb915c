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

Mixture of experts (``SequentialMLP`` experts, :mod:`.megatron_moe`; a source with the legacy
``GroupedMLP`` experts of ``--moe-grouped-gemm`` is written as ``SequentialMLP``, its args'
``moe_grouped_gemm`` set False) is written at the
expert-parallel size ``ep`` asked for: with ep > 1 one folder per ep rank,
``mp_rank_TT[_PPP]_EEE``, each with the dense weights and the router's ``expert_bias``
buffer, and its ``E / ep`` experts under local ids; the optimizer is then Megatron's
``ChainedOptimizer`` of a dense and an expert optimizer (both in ``model_optim_rng.pt``,
both buffers in ``distrib_optim.pt``). Expert tensor parallelism follows tp (etp = tp);
ep must divide the experts and dp.

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
from shardpoint.foreign.megatron_moe import (
    expert_id,
    expert_module,
    is_buffer,
    is_expert,
    num_experts,
    refuse_moe,
    regroup_for_ep,
    to_local_expert,
)
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

__all__ = [
    "export_megatron",
    "from_shardpoint",
    "holds_megatron_model",
    "megatron_args",
    "refuse_moving_a_live_tracker",
    "rng_for",
    "write_tracker",
]

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
        ep=int(foreign.get("ep", 1) or 1),
        buffers=list(foreign.get("buffers", [])),
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
    order += [n for n in ckpt.params if n not in set(order)]  # buffers (expert_bias) are in no group
    ckpt.params = {n: ckpt.params[n] for n in sorted(ckpt.params, key=_model_rank(order))}
    for hyper, names in zip(full.common.get("optimizer_param_groups", []), foreign.get("param_groups", [])):
        ckpt.param_groups.append(dict(hyper) | {"param_names": list(names)})
    return ckpt


def _model_rank(order: list[str]) -> Any:
    ranked = list(model_order(dict.fromkeys(order, None)))
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
    ep: int | None = None,
) -> str:
    """Write ``ckpt`` into save directory ``dst`` in Megatron-LM's legacy format; return the iteration directory.

    ``ep``: the expert-parallel size of a mixture-of-experts model (required for one; None or 1
    for a dense model).

    Raises:
        TopologyMismatchError: a tensor (named), the layer count, or the experts / dp by ep do not divide.
        CheckpointError: the iteration exists in ``dst`` already, the source lacks Megatron args, or a MoE
            feature this writer does not derive (named).

    Example:
        >>> export_megatron(read_foreign("/data/run-tp2"), "/data/run-tp1", tp=1, pp=1)
    """
    if ckpt.tool != "megatron" or not ckpt.args:
        raise CheckpointError(f"{ckpt.path}: export to Megatron-LM needs a Megatron-LM source (its args)")
    ep = _check_ep(ckpt, dp, ep)
    args = megatron_args(ckpt, tp, pp, dp, distributed_optimizer)
    args.expert_model_parallel_size = ep if num_experts(args) else getattr(args, "expert_model_parallel_size", 1)
    if ep > 1 or num_experts(args):
        ckpt = copy.copy(ckpt)
        ckpt.param_groups = regroup_for_ep(ckpt.param_groups, ep)
    root = os.fspath(dst)
    release = bool(ckpt.extra.get("release"))
    name = "release" if release else f"iter_{ckpt.iteration:07d}"
    final = os.path.join(root, name)
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists already; export into another directory or remove it first")
    refuse_moving_a_live_tracker(root, ckpt.iteration)
    stages = _stage_plan(ckpt, pp, args)
    pieces = _tp_pieces(ckpt, tp, args)
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".shardpoint-tmp-{name}-{secrets.token_hex(4)}")
    try:
        for p, names in enumerate(stages):
            for t in range(tp):
                for e in range(ep):
                    folder = os.path.join(
                        tmp, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                    )
                    os.makedirs(folder)
                    held = _held_by_ep_rank(names, num_experts(args), ep, e)
                    _write_rank(ckpt, args, folder, held, pieces, (t, p, e), distributed_optimizer)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_tracker(root, "release" if release else str(ckpt.iteration))
    log.info("wrote Megatron-LM checkpoint %s (tp=%d pp=%d dp=%d ep=%d)", final, tp, pp, dp, ep)
    return final


def write_tracker(root: str, iteration: str) -> None:
    """``latest_checkpointed_iteration.txt``, replaced atomically: written last, after the iteration is in place."""
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    with open(tracker + ".tmp", "w") as f:
        f.write(iteration)
    os.replace(tracker + ".tmp", tracker)


def _check_ep(ckpt: ForeignCheckpoint, dp: int, ep: int | None) -> int:
    """The expert-parallel size to write; raises naming what cannot be written."""
    args = namespace_from_json(ckpt.args)
    experts = num_experts(args)
    if not experts:
        if ep not in (None, 1):
            raise CheckpointError(f"{ckpt.path}: ep={ep} asked for, but the model has no experts (num_experts unset)")
        return 1
    if ep is None:
        raise CheckpointError(
            f"{ckpt.path}: export of mixture-of-experts models (num_experts={experts}) needs the expert-parallel "
            "size to write: pass ep= (CLI: --ep N)"
        )
    refuse_moe(ckpt.path, args, buckets=False, grouped=True)  # GroupedMLP is written as SequentialMLP
    old_tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or old_tp)
    if etp != old_tp:
        raise CheckpointError(
            f"{ckpt.path}: expert tensor parallelism different from tp (--expert-tensor-parallel-size {etp}, "
            f"tp={old_tp}) is not supported by the export; it writes etp = tp"
        )
    if experts % ep:
        raise TopologyMismatchError(f"num_experts={experts} does not divide into ep={ep} expert-parallel ranks")
    if dp % ep:
        raise TopologyMismatchError(
            f"ep={ep} does not divide dp={dp}: with etp = tp, Megatron needs dp = ep * expert data-parallel size"
        )
    beyond = [n for n in ckpt.params if is_expert(n) and expert_id(n) >= experts]
    if beyond:
        raise CheckpointError(f"{ckpt.path}: {beyond[0]} names an expert beyond num_experts={experts}")
    return ep


def _held_by_ep_rank(names: list[str], experts: int, ep: int, e: int) -> list[str]:
    """The global names one ep rank's folder holds: every dense name, its ``experts / ep`` experts."""
    if ep == 1:
        return names
    per_rank = experts // ep
    return [n for n in names if not is_expert(n) or expert_id(n) // per_rank == e]


def refuse_moving_a_live_tracker(root: str, iteration: int) -> None:
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


def megatron_args(ckpt: ForeignCheckpoint, tp: int, pp: int, dp: int, distopt: bool, ckpt_format: str = "torch") -> Any:
    """The source's args for the written layout: parallel sizes, world size, padded vocabulary, format."""
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
    if expert_module(args) == "GroupedMLP":  # written as SequentialMLP experts: the args say so
        log.warning(
            "%s: the legacy GroupedMLP experts (--moe-grouped-gemm) are written as SequentialMLP experts "
            "(local_experts.<i>.linear_fc1/linear_fc2, their buffer order); the written args have "
            "moe_grouped_gemm False: continue training without --moe-grouped-gemm",
            ckpt.path,
        )
        args.moe_grouped_gemm = False
    if hasattr(args, "ckpt_format"):
        args.ckpt_format = ckpt_format  # what is written, whatever the source was
    if hasattr(args, "use_dist_ckpt"):
        args.use_dist_ckpt = ckpt_format != "torch"
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
    result: dict[str, dict[str, Any]] = {}
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
    ckpt: ForeignCheckpoint,
    args: Any,
    folder: str,
    names: list[str],
    pieces: dict,
    rank: tuple[int, int, int],
    distopt: bool,
) -> None:
    t, p, e = rank
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    offset = min((int(m.group(1)) for n in names if (m := _LAYER.search(n))), default=0)
    first = e * num_experts(args) // ep
    local_names = [to_local_expert(_local(name, offset), first) for name in names]
    model: OrderedDict[str, Any] = OrderedDict()
    for i, (name, local) in enumerate(zip(names, local_names)):
        model[local] = pieces[name]["param"][t]
        module = local.rpartition(".")[0]
        following = local_names[i + 1].rpartition(".")[0] if i + 1 < len(names) else None
        if _EXTRA_STATE_MODULES.search(module) and following != module:
            model[f"{module}._extra_state"] = None
    rank_args = copy.copy(args)
    # the args of the rank that saves this file: (expert) data-parallel rank 0 of (t, p, e), in
    # Megatron's rank order tp-cp-ep-dp-pp
    tp_size = args.tensor_model_parallel_size
    for attr in ("rank", "local_rank"):
        if hasattr(rank_args, attr):
            setattr(rank_args, attr, t + e * tp_size + p * tp_size * args.data_parallel_size)
    state: dict[str, Any] = {
        "args": rank_args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": ckpt.iteration,
        "model": model,
    }
    with_optimizer = any(ckpt.optimizer.get(n) for n in ckpt.params)
    chained = ep > 1  # a dense and an expert optimizer (megatron-core's ChainedOptimizer of two)
    groups = _groups_of(ckpt, names)
    parts = [[g for g in groups if bool(g[0].get("is_expert_parallel")) == x] for x in (False, True)]
    if with_optimizer:  # pretrained weights (a release) have none: Megatron then builds a fresh optimizer
        optimizers = [_optimizer(part, pieces, t, distopt) for part in (parts if chained else [groups])]
        state["optimizer"] = optimizers if chained else optimizers[0]
        state["opt_param_scheduler"] = ckpt.scheduler
    rng = rng_for(ckpt, t, p)
    if rng is not None:
        state["rng_state"] = rng
    state["num_floating_point_operations_so_far"] = ckpt.extra.get("num_floating_point_operations_so_far", 0)
    save_foreign(state, os.path.join(folder, MODEL_FILE))
    if distopt and with_optimizer:
        where = os.path.join(folder, OPTIM_FILE)
        if not chained:
            save_foreign(_distrib_optim([n for n in names if not is_buffer(n)], pieces, t, where), where)
            return
        dense, experts = ([n for _, members in part for n in members] for part in parts)
        # only dense data-parallel rank 0 (ep rank 0) saves the dense buffer; the others write None
        dense_state = _distrib_optim([n for n in names if n in set(dense)], pieces, t, where) if e == 0 else None
        expert_state = _distrib_optim([n for n in names if n in set(experts)], pieces, t, where)
        save_foreign([dense_state, expert_state], where)


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


def _optimizer(groups: list[tuple[dict[str, Any], list[str]]], pieces: dict, t: int, distopt: bool) -> dict[str, Any]:
    names = [n for _, members in groups for n in members]
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


def rng_for(ckpt: ForeignCheckpoint, t: int, p: int) -> Any:
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
