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

Mixture of experts (``--num-experts``, ``SequentialMLP`` experts; :mod:`.megatron_moe`):
with ep > 1 the folders are ``mp_rank_TT[_PPP]_EEE``, told apart from ``mp_rank_TT_PPP`` by
the args (``expert_model_parallel_size``, ``pipeline_model_parallel_size``); each ep rank's
local experts get their global ids, its dense weights must equal ep rank 0's, and the
``ChainedOptimizer``'s two optimizers (dense, experts) are read from the lists in
``model_optim_rng.pt`` and ``distrib_optim.pt`` (the dense buffer from ep rank 0). The
router's ``expert_bias`` is a buffer: in no optimizer group.

Limits: virtual pipeline stages (``model0``, ``model1``...), fp16/bf16 master
weights (``fp32_from_fp16_params``) and, for MoE, what :func:`.megatron_moe.refuse_moe`
names (grouped-GEMM experts, ...) and expert tensor parallelism other than tp are refused
with an error rather than guessed.
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
from shardpoint.foreign.megatron_moe import (
    expert_parallel,
    is_buffer,
    is_expert,
    num_experts,
    refuse_moe,
    to_local_expert,
)
from shardpoint.foreign.structure import glu_from_tp, split_dim

__all__ = ["MODEL_FILE", "OPTIM_FILE", "buffer_layout", "is_legacy_dir", "param_names", "read_legacy"]

log = logging.getLogger(__name__)

MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
_MP_DIR = re.compile(r"mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")
_LAYER = re.compile(r"(?<![^.])layers\.(\d+)\.")


def is_legacy_dir(directory: str) -> bool:
    """True when ``directory`` holds ``mp_rank_*/model_optim_rng.pt``."""
    return os.path.isdir(directory) and any(
        _MP_DIR.match(n) and os.path.exists(os.path.join(directory, n, MODEL_FILE)) for n in os.listdir(directory)
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
    folders = _rank_folders(directory)
    loaded = {name: load_foreign(os.path.join(directory, name, MODEL_FILE)) for name in folders}
    args = loaded[min(loaded)].get("args")
    ranks = _ranks(directory, folders, args)  # mp_rank_TT_EEE of ep ranks reads like mp_rank_TT_PPP: the args tell
    by_rank = {rank: loaded[folder] for rank, folder in ranks.items()}
    tp, pp, ep = (max(rank[i] for rank in ranks) + 1 for i in range(3))
    if len(ranks) != tp * pp * ep:
        raise CorruptCheckpointError(
            f"{directory}: expected {tp * pp * ep} mp_rank_* folders for tp={tp} pp={pp} ep={ep}, found {len(ranks)}"
        )
    for rank, state in by_rank.items():
        if "model" not in state:
            keys = [k for k in state if str(k).startswith("model")]
            raise CheckpointError(
                f"{os.path.join(directory, ranks[rank], MODEL_FILE)} holds {keys}: virtual pipeline stages "
                "are not supported yet; convert with Megatron's tools/checkpoint at vpp=1 first"
            )
    distopt = bool(getattr(args, "use_distributed_optimizer", False)) or any(
        os.path.exists(os.path.join(directory, f, OPTIM_FILE)) for f in ranks.values()
    )
    by_rank_opt = {rank: _local_optimizer(directory, ranks[rank], st, args, distopt) for rank, st in by_rank.items()}
    states, local_opt = {}, {}
    for t in range(tp):
        for p in range(pp):
            where = os.path.join(directory, ranks[(t, p, 0)])
            folders_tp = [by_rank[(t, p, e)] for e in range(ep)]
            states[(t, p)], local_opt[(t, p)] = _merge_ep(
                where, folders_tp, [by_rank_opt[(t, p, e)] for e in range(ep)], num_experts(args)
            )
    first = states[(0, 0)]
    offsets = _layer_offsets({p: param_names(states[(0, p)]["model"]) for p in range(pp)})
    swiglu = bool(getattr(args, "swiglu", False))
    ckpt = ForeignCheckpoint(
        tool="megatron",
        format="torch",
        path=directory,
        iteration=int(first.get("iteration", 0)),
        tp=tp,
        pp=pp,
        ep=ep,
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
    ckpt.buffers = [n for n in ckpt.params if is_buffer(n)]
    _check_experts(directory, ckpt.params, num_experts(args))
    ckpt.param_groups = _param_groups(first, states, offsets, distopt)
    _drop_tied_copy(ckpt, args)
    return ckpt


def _check_experts(directory: str, params: dict[str, torch.Tensor], experts: int) -> None:
    """Every MoE layer holds the args' ``num_experts`` routed experts, ids 0..E-1, once merged over ep ranks."""
    if not experts:
        return
    layers: dict[str, set[int]] = defaultdict(set)
    for name in params:
        if is_expert(name):
            head, _, rest = name.partition("local_experts.")
            layers[head].add(int(rest.partition(".")[0]))
    wrong = {head: ids for head, ids in layers.items() if ids != set(range(experts))}
    if not layers or wrong:
        found = sorted(next(iter(wrong.values()))) if wrong else []
        raise CorruptCheckpointError(
            f"{directory}: the args say num_experts={experts}, but the model holds routed experts {found} "
            f"(mlp.experts.local_experts.<i>) in {next(iter(wrong), 'no layer')}; legacy torch checkpoints of "
            "mixture-of-experts models are read with SequentialMLP experts only, as torch_dist ones are"
        )


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


def _rank_folders(directory: str) -> dict[str, tuple[int, ...]]:
    """Each ``mp_rank_*`` folder holding a model file, with the numbers in its name."""
    found = {}
    for name in sorted(os.listdir(directory)):
        match = _MP_DIR.match(name)
        if match and os.path.exists(os.path.join(directory, name, MODEL_FILE)):
            found[name] = tuple(int(g) for g in match.groups() if g is not None)
    if not found:
        raise CorruptCheckpointError(f"{directory} has no mp_rank_*/{MODEL_FILE}: not a Megatron legacy checkpoint")
    return found


def _ranks(directory: str, folders: dict[str, tuple[int, ...]], args: Any) -> dict[tuple[int, int, int], str]:
    """``(tp rank, pp rank, ep rank)`` of each folder, read by ``get_checkpoint_name``'s rule and the args."""
    experts = num_experts(args)
    if experts:
        refuse_moe(directory, args, buckets=False)
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
        if etp != tp:
            raise CheckpointError(
                f"{directory}: legacy torch checkpoints of mixture-of-experts models with expert tensor parallelism "
                f"other than tp (--expert-tensor-parallel-size {etp}, tp={tp}) are not supported; import the "
                "torch_dist format (--ckpt-format torch_dist) instead"
            )
    pp_named = int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1 if experts else None
    ep = expert_parallel(args)
    result = {}
    for name, numbers in folders.items():
        if experts and len(numbers) != 1 + int(bool(pp_named)) + int(ep > 1):
            raise CheckpointError(
                f"{os.path.join(directory, name)}: the folder name does not fit the args: with "
                f"pipeline_model_parallel_size={getattr(args, 'pipeline_model_parallel_size', 1)} and "
                f"expert_model_parallel_size={ep} Megatron names its ranks mp_rank_TT{'_PPP' if pp_named else ''}"
                f"{'_EEE' if ep > 1 else ''} (expert-parallel ranks (mp_rank_TT_PPP_EEE) need both > 1); the args "
                "and the folders disagree"
            )
        if not experts and len(numbers) == 3:
            raise CheckpointError(
                f"{os.path.join(directory, name)}: expert-parallel ranks (mp_rank_TT_PPP_EEE), but the args have no "
                "--num-experts; the args and the folders disagree"
            )
        t = numbers[0]
        p = numbers[1] if len(numbers) > 1 and (pp_named or pp_named is None) else 0
        e = numbers[-1] if experts and ep > 1 else 0
        result[(t, p, e)] = name
    return result


def _merge_ep(
    where: str, states: list[dict[str, Any]], optimizers: list[dict[str, Any]], experts: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One (tp, pp) rank's ep folders as one: experts under global ids, dense weights (equal on every ep rank) once.

    Returns the merged state (ep rank 0's, with the merged ``model``) and the merged optimizer state.
    """
    if len(states) == 1:
        return states[0], optimizers[0]
    per_rank = experts // len(states)
    base = list(states[0]["model"])
    position = {n: i for i, n in enumerate(base)}
    first: dict[str, int] = {}  # a layer's first expert entry on ep rank 0
    for i, name in enumerate(base):
        if is_expert(name):
            first.setdefault(name.partition("local_experts.")[0], i)
    model: dict[str, Any] = {}
    moments: dict[str, Any] = {}
    for e, (state, optimizer) in enumerate(zip(states, optimizers)):
        for name, value in state["model"].items():
            if is_expert(name):
                model[to_local_expert(name, -e * per_rank)] = value
            elif name not in model:
                model[name] = value
            elif isinstance(value, torch.Tensor) and not torch.equal(value, model[name]):
                raise CorruptCheckpointError(f"{where}: {name} differs between expert-parallel ranks 0 and {e}")
        for name, entry in optimizer.items():
            moments.setdefault(to_local_expert(name, -e * per_rank) if is_expert(name) else name, entry)

    def rank(name: str) -> tuple[int, int, int]:
        if not is_expert(name):
            return (position[name], -1, 0)
        local0 = re.sub(r"local_experts\.\d+\.", "local_experts.0.", name, count=1)
        expert = int(name.partition("local_experts.")[2].partition(".")[0])
        return (first[name.partition("local_experts.")[0]], expert, position[local0])

    merged = dict(states[0]) | {"model": {n: model[n] for n in sorted(model, key=rank)}}
    return merged, moments


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


def _assign_groups(
    where: str, model: dict[str, Any], groups: list[dict[str, Any]], names: list[str] | None = None
) -> list[list[str]]:
    """Parameter names of each optimizer group, by Megatron's grouping rule; checked against group sizes.

    ``names``: the parameters the optimizer holds (default: all of ``model`` but buffers), in model order.
    """
    names = [n for n in param_names(model) if not is_buffer(n)] if names is None else names
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
    trained = [n for n in param_names(model) if not is_buffer(n)]
    if not isinstance(opt, list):
        saved = _load_optim(os.path.join(directory, folder, OPTIM_FILE)) if distopt else None
        return _one_optimizer(where, model, trained, opt, saved, args)
    # megatron-core's ChainedOptimizer (ep > 1): a dense and an expert optimizer
    parts = [[n for n in trained if not is_expert(n)], [n for n in trained if is_expert(n)]]
    saved = _load_optim(os.path.join(directory, folder, OPTIM_FILE)) if distopt else [None] * len(opt)
    if len(opt) != 2 or not isinstance(saved, list) or len(saved) != 2:
        raise CheckpointError(
            f"{where}: a chained optimizer of {len(opt)} optimizers; only mixture of experts' two (dense, experts) "
            "are read"
        )
    result: dict[str, dict[str, torch.Tensor]] = {}
    for sub, names, flat in zip(opt, parts, saved):
        if distopt and flat is None:
            continue  # the dense buffer outside ep rank 0: ep rank 0's folder holds it
        result |= _one_optimizer(where, model, names, sub, flat, args)
    return result


def _load_optim(path: str) -> Any:
    if not os.path.exists(path):
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint was saved with the distributed optimizer")
    return load_foreign(path)


def _one_optimizer(
    where: str, model: dict, names: list[str], opt: dict, saved: Any, args: Any
) -> dict[str, dict[str, torch.Tensor]]:
    """The state of one optimizer over ``names``: a torch optimizer's, or a distributed one's (``saved``)."""
    if saved is not None:
        return _distributed_state(os.path.join(os.path.dirname(where), OPTIM_FILE), saved, model, names, opt, args)
    inner = opt.get("optimizer", opt)
    if "fp32_from_fp16_params" in opt:
        raise CheckpointError(f"{where}: fp16/bf16 master weights are not supported yet (fp32_from_fp16_params)")
    groups = _assign_groups(where, model, inner["param_groups"], names)
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


def _distributed_state(
    path: str, saved: Any, model: dict, names: list[str], opt: dict, args: Any
) -> dict[str, dict[str, torch.Tensor]]:
    if not isinstance(saved, dict) or not saved.get("buckets_coalesced", False):
        raise CheckpointError(
            f"{path}: per-bucket (non-coalesced) distrib_optim.pt files of older Megatron are not supported"
        )
    buffers = [v for k, v in saved.items() if isinstance(k, int)]
    if len(buffers) != 1 or len(buffers[0]) != 1:
        raise CheckpointError(f"{path}: {len(buffers)} grad buffers; only one buffer of one dtype is supported")
    flat = next(iter(buffers[0].values()))
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
    """Hyperparameters of each optimizer group with the global names of its parameters.

    A chained optimizer (mixture of experts at ep > 1) gives the dense optimizer's groups,
    then the expert optimizer's, as the ``torch_dist`` importer does.
    """
    result = []
    for i, opt in enumerate(_chained(first.get("optimizer"))):
        inner = opt.get("optimizer", opt)
        groups = inner.get("param_groups", [])
        part = [{k: v for k, v in g.items() if k not in ("params", "step")} | {"param_names": []} for g in groups]
        pp = max(p for _, p in states) + 1
        for p in range(pp):
            model = states[(0, p)]["model"]
            stage_opt = _chained(states[(0, p)].get("optimizer"))[i]
            stage_groups = stage_opt.get("optimizer", stage_opt).get("param_groups", groups)
            trained = [n for n in param_names(model) if not is_buffer(n)]
            if len(_chained(first.get("optimizer"))) > 1:
                trained = [n for n in trained if is_expert(n) == bool(i)]
                if i:  # the model holds every ep rank's experts, a group one rank's (checked per folder)
                    stage_groups = [{k: v for k, v in g.items() if k != "params"} for g in stage_groups]
            for j, members in enumerate(_assign_groups(f"pipeline stage {p}", model, stage_groups, trained)):
                if j < len(part):
                    part[j]["param_names"] += [_globalize(n, offsets[p]) for n in members]
        result += part
    return result  # empty without an optimizer (a release of pretrained weights)


def _chained(opt: Any) -> list[dict[str, Any]]:
    """The optimizers' state dicts: megatron-core's ChainedOptimizer saves a list of them."""
    if not opt:
        return []
    return list(opt) if isinstance(opt, list) else [opt]
