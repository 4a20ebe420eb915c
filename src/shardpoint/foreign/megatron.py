"""Megatron-LM's legacy ``torch`` format, read into global tensors.

Layout (``megatron/training/checkpointing.py``)::

    latest_checkpointed_iteration.txt
    iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt     # one per tensor/pipeline rank
    iter_0000100/mp_rank_TT[_PPP]/distrib_optim.pt       # --use-distributed-optimizer

``model_optim_rng.pt`` holds ``args`` (an ``argparse.Namespace``),
``checkpoint_version``, ``iteration``, ``model`` (local names: layer numbers restart
at 0 on each pipeline stage), ``optimizer``, ``opt_param_scheduler``, ``rng_state``.

Reading:

* each rank's layer numbers are made global (offset = layers on earlier stages);
* TP pieces are concatenated along the partition dim (:mod:`.structure`); pieces of
  replicated parameters must agree;
* optimizer state is indexed by position in the optimizer's param groups; positions
  are matched to names by Megatron's grouping rule (1-dim parameters and biases in
  the ``wd_mult == 0`` group, others in the ``wd_mult == 1`` group, model order inside
  each), and every shape is checked;
* the distributed optimizer's ``distrib_optim.pt`` holds, per grad buffer, the whole
  buffer of one model-parallel rank gathered over DP: parameters in reverse order,
  each starting at a multiple of 64 elements, bucket-end padding stripped
  (:func:`buffer_layout` mirrors ``_ParamAndGradBuffer``).

Limits: virtual pipeline stages (``model0``, ``model1``...), fp16/bf16 master
weights (``fp32_from_fp16_params``) and mixture-of-experts models (``--num-experts``:
their expert-parallel ``mp_rank_TT[_PPP]_EEE`` folders; ``torch_dist`` MoE checkpoints
are imported) are refused with an error rather than guessed.
"""

from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from typing import Any

import torch

from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.foreign._types import ForeignCheckpoint, args_to_json
from shardpoint.foreign._unpickle import load_foreign
from shardpoint.foreign.megatron_moe import num_experts
from shardpoint.foreign.structure import glu_from_tp, split_dim

__all__ = ["MODEL_FILE", "OPTIM_FILE", "buffer_layout", "is_legacy_dir", "param_names", "read_legacy"]

log = logging.getLogger(__name__)

MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
_MP_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?$")
_EP_DIR = re.compile(r"mp_rank_\d+_\d+_\d+$")
_LAYER = re.compile(r"(?<![^.])layers\.(\d+)\.")


def is_legacy_dir(directory: str) -> bool:
    """True when ``directory`` holds ``mp_rank_*/model_optim_rng.pt``."""
    return os.path.isdir(directory) and any(
        (_MP_DIR.match(n) or _EP_DIR.match(n)) and os.path.exists(os.path.join(directory, n, MODEL_FILE))
        for n in os.listdir(directory)
    )


def param_names(model: dict[str, Any]) -> list[str]:
    """Names of the parameters in a Megatron model state dict, in model order (``_extra_state`` skipped)."""
    return [k for k, v in model.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")]


def read_legacy(directory: str) -> ForeignCheckpoint:
    """Read one Megatron legacy iteration directory into a :class:`ForeignCheckpoint`.

    Raises:
        UnsafeCheckpointError: a pickle names a class outside the allow-list.
        CorruptCheckpointError: ranks are missing or pieces do not fit together.
        CheckpointError: a feature this reader does not support (named in the message).
    """
    ranks = _rank_dirs(directory)
    states = {rank: load_foreign(os.path.join(directory, folder, MODEL_FILE)) for rank, folder in ranks.items()}
    args = states[min(states)].get("args")
    if num_experts(args):  # before the folder count: mp_rank_TT_EEE of ep ranks reads like mp_rank_TT_PPP
        raise CheckpointError(
            f"{directory}: legacy torch checkpoints of mixture-of-experts models (--num-experts) are not supported; "
            "save with --ckpt-format torch_dist, which shardpoint imports"
        )
    tp = max(t for t, _ in ranks) + 1
    pp = max(p for _, p in ranks) + 1
    if len(ranks) != tp * pp:
        raise CorruptCheckpointError(
            f"{directory}: expected {tp * pp} mp_rank_* folders for tp={tp} pp={pp}, found {len(ranks)}"
        )
    first = states[(0, 0)]
    for (t, p), state in states.items():
        if "model" not in state:
            keys = [k for k in state if str(k).startswith("model")]
            raise CheckpointError(
                f"{os.path.join(directory, ranks[(t, p)], MODEL_FILE)} holds {keys}: virtual pipeline stages "
                "are not supported yet; convert with Megatron's tools/checkpoint at vpp=1 first"
            )
    offsets = _layer_offsets({p: param_names(states[(0, p)]["model"]) for p in range(pp)})
    swiglu = bool(getattr(args, "swiglu", False))
    distopt = bool(getattr(args, "use_distributed_optimizer", False)) or any(
        os.path.exists(os.path.join(directory, f, OPTIM_FILE)) for f in ranks.values()
    )
    local_opt = {rank: _local_optimizer(directory, ranks[rank], st, args, distopt) for rank, st in states.items()}
    ckpt = ForeignCheckpoint(
        tool="megatron",
        format="torch",
        path=directory,
        iteration=int(first.get("iteration", 0)),
        tp=tp,
        pp=pp,
        dp=int(getattr(args, "data_parallel_size", 1) or 1),
        optimizer_sharding="distributed-optimizer" if distopt else None,
        scheduler=dict(first.get("opt_param_scheduler") or {}),
        consumed_samples=getattr(args, "consumed_train_samples", None),
        args=args_to_json(args) if args is not None else {},
        extra={
            "checkpoint_version": first.get("checkpoint_version"),
            "num_floating_point_operations_so_far": first.get("num_floating_point_operations_so_far", 0),
            "rng_state": {f"{t}_{p}": rng_to_safe(st.get("rng_state")) for (t, p), st in states.items()},
            "release": os.path.basename(os.path.normpath(directory)) == "release",
        },
    )
    for p in range(pp):
        for name in param_names(states[(0, p)]["model"]):
            gname = _globalize(name, offsets[p])
            dim = split_dim(name)
            pieces = [states[(t, p)]["model"][name] for t in range(tp)]
            ckpt.params[gname] = _merge(gname, pieces, dim, swiglu)
            ckpt.split_dims[gname] = dim
            moments = [local_opt[(t, p)].get(name, {}) for t in range(tp)]
            ckpt.optimizer[gname] = {
                key: _merge(f"{gname} ({key})", [m[key] for m in moments], dim if key != "step" else None, swiglu)
                for key in moments[0]
            }
    ckpt.param_groups = _param_groups(first, states, offsets, distopt)
    _drop_tied_copy(ckpt, args)
    return ckpt


def _drop_tied_copy(ckpt: ForeignCheckpoint, args: Any) -> None:
    """With tied embeddings and pp > 1 the last stage keeps a synced copy of the embedding: keep one."""
    tied = not getattr(args, "untie_embeddings_and_output_weights", True)
    copy, embed = "output_layer.weight", "embedding.word_embeddings.weight"
    if tied and copy in ckpt.params and embed in ckpt.params:
        if not torch.equal(ckpt.params[copy], ckpt.params[embed]):
            raise CorruptCheckpointError(f"{ckpt.path}: tied {copy} differs from {embed}; the stages were out of sync")
        del ckpt.params[copy], ckpt.split_dims[copy]
        ckpt.optimizer.pop(copy, None)
        for group in ckpt.param_groups:
            group["param_names"] = [n for n in group["param_names"] if n != copy]


def rng_to_safe(states: Any) -> Any:
    """Megatron's ``rng_state`` list with numpy arrays as tensors (storable in shardpoint's common.pt)."""
    if not isinstance(states, list):
        return None
    result = []
    for state in states:
        state = dict(state)
        np_state = state.get("np_rng_state")
        if isinstance(np_state, tuple) and len(np_state) > 1 and hasattr(np_state[1], "dtype"):
            state["np_rng_state"] = (np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:])
        result.append(state)
    return result


def _rank_dirs(directory: str) -> dict[tuple[int, int], str]:
    found = {}
    for name in sorted(os.listdir(directory)):
        if _EP_DIR.match(name):
            raise CheckpointError(
                f"{os.path.join(directory, name)}: expert-parallel ranks (mp_rank_TT_PPP_EEE) of a mixture-of-experts "
                "model; legacy torch MoE checkpoints are not supported, save with --ckpt-format torch_dist"
            )
        match = _MP_DIR.match(name)
        if match and os.path.exists(os.path.join(directory, name, MODEL_FILE)):
            found[(int(match.group(1)), int(match.group(2) or 0))] = name
    if not found:
        raise CorruptCheckpointError(f"{directory} has no mp_rank_*/{MODEL_FILE}: not a Megatron legacy checkpoint")
    return found


def _layer_offsets(names_by_stage: dict[int, list[str]]) -> dict[int, int]:
    """Global number of each stage's first layer: the layers held by earlier stages."""
    offsets, total = {}, 0
    for stage in sorted(names_by_stage):
        offsets[stage] = total
        layers = {int(m.group(1)) for n in names_by_stage[stage] if (m := _LAYER.search(n))}
        total += len(layers)
    return offsets


def _globalize(name: str, offset: int) -> str:
    return _LAYER.sub(lambda m: f"layers.{int(m.group(1)) + offset}.", name, count=1) if offset else name


def _merge(name: str, pieces: list[torch.Tensor], dim: int | None, swiglu: bool) -> torch.Tensor:
    if len(pieces) == 1:
        return pieces[0]
    if dim is None or pieces[0].dim() == 0:
        for i, piece in enumerate(pieces[1:], 1):
            if not torch.equal(piece, pieces[0]):
                raise CorruptCheckpointError(f"{name}: replicated on every tensor-parallel rank, but rank {i} differs")
        return pieces[0]
    if swiglu and "linear_fc1" in name:
        return glu_from_tp(pieces)
    return torch.cat(pieces, dim=dim)


def _no_weight_decay(name: str, tensor: torch.Tensor) -> bool:
    """Megatron's default grouping: biases and 1-dim parameters get no weight decay."""
    return name.endswith(".bias") or tensor.dim() == 1


def _assign_groups(where: str, model: dict[str, Any], groups: list[dict[str, Any]]) -> list[list[str]]:
    """Parameter names of each optimizer group, by Megatron's grouping rule; checked against group sizes."""
    names = param_names(model)
    by_wd: dict[bool, list[str]] = defaultdict(list)
    for name in names:
        by_wd[_no_weight_decay(name, model[name])].append(name)
    result = []
    for i, group in enumerate(groups):
        no_wd = float(group.get("wd_mult", 1.0)) == 0.0
        members = by_wd.pop(no_wd, [])
        if "params" in group and len(group["params"]) != len(members):
            raise CheckpointError(
                f"{where}: optimizer group {i} has {len(group['params'])} parameters but the grouping rule "
                f"(no weight decay for biases and 1-dim tensors) gives {len(members)}; this checkpoint uses custom "
                "parameter groups, which the importer cannot match to names"
            )
        result.append(members)
    if any(by_wd.values()):
        raise CheckpointError(
            f"{where}: parameters {[n for names in by_wd.values() for n in names][:3]} belong to no optimizer group"
        )
    return result


def _local_optimizer(
    directory: str, folder: str, state: dict, args: Any, distopt: bool
) -> dict[str, dict[str, torch.Tensor]]:
    """Per local parameter name, its optimizer state on this model-parallel rank."""
    where = os.path.join(directory, folder, MODEL_FILE)
    model, opt = state["model"], state.get("optimizer")
    if not opt:
        return {}
    if distopt:
        return _distributed_state(os.path.join(directory, folder, OPTIM_FILE), model, opt, args)
    inner = opt.get("optimizer", opt)
    if "fp32_from_fp16_params" in opt:
        raise CheckpointError(f"{where}: fp16/bf16 master weights are not supported yet (fp32_from_fp16_params)")
    groups = _assign_groups(where, model, inner["param_groups"])
    result = {}
    for group, members in zip(inner["param_groups"], groups):
        for index, name in zip(group["params"], members):
            entry = inner["state"].get(index, {})
            for key, value in entry.items():
                if key != "step" and tuple(value.shape) != tuple(model[name].shape):
                    raise CorruptCheckpointError(
                        f"{where}: optimizer state {index}.{key} has shape {tuple(value.shape)} but parameter {name} "
                        f"has {tuple(model[name].shape)}; the parameter order does not match"
                    )
            result[name] = {k: (v if isinstance(v, torch.Tensor) else torch.tensor(v)) for k, v in entry.items()}
    return result


def buffer_layout(
    names: list[str], shapes: dict[str, torch.Size], bucket_size: int | None = None
) -> tuple[dict[str, int], int]:
    """Offsets of parameters in a distributed optimizer's compact gathered buffer, and its length.

    Mirrors ``_ParamAndGradBuffer`` with ``use_distributed_optimizer``: parameters in
    reverse order, each start rounded up to 64 elements, a new bucket once
    ``bucket_size`` elements are reached; the gathered buffer keeps each bucket from
    its start to its last parameter's end (the padding at bucket ends is stripped).
    """
    offsets: dict[str, int] = {}
    compact = start = bucket_start = 0
    end = 0
    for name in reversed(names):
        start = -(-start // 64) * 64
        numel = int(torch.Size(shapes[name]).numel())
        end = start + numel
        offsets[name] = compact + start - bucket_start
        if bucket_size is not None and end - bucket_start >= bucket_size:
            compact += end - bucket_start
            # the next bucket starts at an aligned address after the (stripped) end padding
            bucket_start = start = -(-end // 64) * 64
            continue
        start = end
    return offsets, compact + end - bucket_start


def _distributed_state(path: str, model: dict, opt: dict, args: Any) -> dict[str, dict[str, torch.Tensor]]:
    if not os.path.exists(path):
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint was saved with the distributed optimizer")
    saved = load_foreign(path)
    if not saved.get("buckets_coalesced", False):
        raise CheckpointError(
            f"{path}: per-bucket (non-coalesced) distrib_optim.pt files of older Megatron are not supported"
        )
    buffers = [v for k, v in saved.items() if isinstance(k, int)]
    if len(buffers) != 1 or len(buffers[0]) != 1:
        raise CheckpointError(f"{path}: {len(buffers)} grad buffers; only one buffer of one dtype is supported")
    flat = next(iter(buffers[0].values()))
    names = param_names(model)
    bucket = getattr(args, "ddp_bucket_size", None) if getattr(args, "overlap_grad_reduce", False) else None
    offsets, length = buffer_layout(names, {n: model[n].shape for n in names}, bucket)
    if length != int(flat["numel_unpadded"]):
        raise CorruptCheckpointError(
            f"{path}: the gathered buffer has {flat['numel_unpadded']} elements but the parameters of "
            f"{os.path.dirname(path)} lay out to {length}; bucketing options differ from what the reader assumes"
        )
    steps = [g.get("step") for g in opt.get("optimizer", opt).get("param_groups", [])]
    step = torch.tensor(float(steps[0])) if steps and steps[0] is not None else None
    result = {}
    for name in names:
        shape, start = model[name].shape, offsets[name]
        entry = {
            key: flat[key][start : start + shape.numel()].view(shape).clone()
            for key in flat
            if key not in ("param", "numel_unpadded")
        }
        if not torch.equal(flat["param"][start : start + shape.numel()].view(shape), model[name].float()):
            log.warning("%s: the distributed optimizer's fp32 copy of %s differs from the model weight", path, name)
        if step is not None:
            entry["step"] = step
        result[name] = entry
    return result


def _param_groups(first: dict, states: dict, offsets: dict[int, int], distopt: bool) -> list[dict[str, Any]]:
    """Hyperparameters of each optimizer group with the global names of its parameters."""
    opt = first.get("optimizer") or {}
    inner = opt.get("optimizer", opt)
    groups = inner.get("param_groups", [])
    if not groups:
        return []  # no optimizer saved (a release of pretrained weights)
    result = [{k: v for k, v in g.items() if k not in ("params", "step")} | {"param_names": []} for g in groups]
    pp = max(p for _, p in states) + 1
    for p in range(pp):
        model = states[(0, p)]["model"]
        stage_opt = states[(0, p)].get("optimizer") or {}
        stage_groups = stage_opt.get("optimizer", stage_opt).get("param_groups", groups)
        for i, members in enumerate(_assign_groups(f"pipeline stage {p}", model, stage_groups)):
            if i < len(result):
                result[i]["param_names"] += [_globalize(n, offsets[p]) for n in members]
    return result
