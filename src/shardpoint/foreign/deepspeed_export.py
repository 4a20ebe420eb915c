"""Write DeepSpeed's own ZeRO-1/2/3 checkpoint files at a chosen data-parallel size (``convert --to deepspeed``).

DeepSpeed's ``load_checkpoint`` reads a ZeRO checkpoint only at the data-parallel size
it was saved at. This writes, from global tensors (:class:`ForeignCheckpoint`: a
checkpoint of :func:`shardpoint.integrations.deepspeed.save_checkpoint`'s reshardable
mode, read by :func:`from_reshardable`; a DeepSpeed, Megatron-LM or Hugging Face
checkpoint read by the importers), what ``engine.save_checkpoint`` would have written
at ``dp`` ranks::

    latest                                               # the tag, written last
    global_step<N>/mp_rank_00_model_states.pt            # module weights, param_shapes, scheduler,
                                                         #   steps, client_state
    global_step<N>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   # rank r's slice of each flat group
    global_step<N>/shardpoint.json                       # sizes and checksums (engine mode reads it checked)

ZeRO-1/2 flatten each optimizer group (its parameters in order), pad the flat vector
with zeros to a multiple of 2 × dp (DeepSpeed's ``nccl_start_alignment_factor``) and
give rank r the r-th of dp equal slices. Per rank and group the file holds the fp32
master slice without the padding (``single_partition_of_fp32_groups``), the base
optimizer's state as ``optimizer.state_dict()`` gives it (Adam's moments over the
padded slice, the step, the group's hyperparameters), the padding on the last rank
(``group_paddings``) and where each parameter's fragment lies in the slice
(``param_slice_mappings``, for ``zero_to_fp32`` and ``ds_to_universal``). ZeRO-3 writes
per-rank model states and partitions each parameter on its own (``_zero3_files``). A
pipeline engine's save is written as its ``PipelineEngine`` writes it, at its saved stages
(``_pipeline_files``: ``layer_<ii>-model_states.pt`` per global layer, ``mp_rank_<ss>``
per stage, optimizer files per stage and dp rank).

The target model's optimizer must have the same groups, in the same order: the source's
groups (recorded by the reshardable mode; a DeepSpeed or Megatron-LM source's own); a
source that does not record them is refused (the stored order is not the model's). A source without
optimizer state (Hugging Face weights) gets the model file only: load it with
``load_checkpoint(..., load_optimizer_states=False)``; DeepSpeed then builds the fp32
masters from the weights.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import OrderedDict
from typing import Any

import torch
import xxhash

from shardpoint import offline
from shardpoint._version import __version__
from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord
from shardpoint.errors import CheckpointError
from shardpoint.foreign._types import ForeignCheckpoint, args_from_json
from shardpoint.foreign._unpickle import STAND_INS, save_foreign
from shardpoint.lifecycle import commit
from shardpoint.state.train_state import MODEL_PREFIX, OPTIM_PREFIX
from shardpoint.storage.base import LocalStorage

__all__ = ["export_deepspeed", "from_reshardable"]

log = logging.getLogger(__name__)

#: DeepSpeed's ``nccl_start_alignment_factor``: a flat group is padded to a multiple of this × dp
ALIGNMENT = 2
_FRAGMENT = STAND_INS["deepspeed.utils.tensor_fragment.fragment_address"]
_MOMENTS = ("exp_avg", "exp_avg_sq")
_STAGE_ENUM = STAND_INS["deepspeed.runtime.zero.config.ZeroStageEnum"]
_SCALER = STAND_INS["deepspeed.runtime.fp16.loss_scaler.LossScaler"]
#: DeepSpeed's default ``zero_optimization.sub_group_size`` (elements per ZeRO-3 sub-group)
_SUB_GROUP_SIZE = 1_000_000_000


def from_reshardable(path: str, iteration: int | None = None) -> ForeignCheckpoint:
    """A checkpoint of the DeepSpeed integration's reshardable mode, as global tensors for :func:`export_deepspeed`.

    Raises:
        CheckpointError: the checkpoint was not written by the reshardable mode (it names the
            ``--from`` to use instead).
    """
    full = offline.read_full(path, iteration)
    extra = dict(full.common.get("extra") or {})
    if "global_steps" not in extra:
        raise CheckpointError(
            f"{full.path} was not saved by shardpoint.integrations.deepspeed.save_checkpoint (no DeepSpeed step "
            "counts in it); convert a DeepSpeed, Megatron-LM or Hugging Face checkpoint with --from deepspeed|"
            "megatron|hf"
        )
    params = {k[len(MODEL_PREFIX) :]: t for k, t in full.tensors.items() if k.startswith(MODEL_PREFIX)}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in full.tensors.items():
        if key.startswith(OPTIM_PREFIX):
            name, _, state_key = key[len(OPTIM_PREFIX) :].rpartition(".")
            states.setdefault(name, {})[state_key] = tensor
    step = extra.get("optimizer_step")
    ckpt = ForeignCheckpoint(
        tool="deepspeed",
        format="dist",
        path=full.path,
        iteration=full.metadata.iteration,
        dp=int(full.metadata.topology.get("dp", 1)),
        params=params,
        scheduler=dict(full.common.get("scheduler") or {}),
        consumed_samples=extra.get("global_samples"),
        param_groups=[dict(group) for group in extra.get("param_groups") or []],
        extra={k: extra.get(k) for k in ("global_steps", "global_samples", "skipped_steps", "client_state")}
        | {"pipeline_stages": extra.get("pipeline_stages"), "pipeline": extra.get("pipeline")},
    )
    for name, state in states.items():
        shape = params[name].shape
        entry = {k: state[k].reshape(shape) for k in _MOMENTS if k in state}
        if "fp32" in state:
            entry["master_param"] = state["fp32"].reshape(shape)
        if step is not None:
            entry["step"] = torch.tensor(float(step))
        ckpt.optimizer[name] = entry
    return ckpt


def export_deepspeed(
    ckpt: ForeignCheckpoint, dst: str | os.PathLike[str], *, dp: int = 1, stage: int = 2, pp: int | None = None
) -> str:
    """Write ``ckpt`` into save directory ``dst`` as DeepSpeed's ZeRO-``stage`` files for ``dp`` ranks; return the tag.

    A checkpoint of a pipeline engine (``PipelineModule``) is written as DeepSpeed's
    ``PipelineEngine`` writes it, at ``pp`` stages (default: the saved number; ZeRO-1/2 only).

    Raises:
        ValueError: ``stage`` is not 1, 2 or 3, or ``dp`` < 1.
        CheckpointError: the tag exists in ``dst`` already, or the groups do not cover the
            parameters with optimizer state (named).

    Example:
        >>> export_deepspeed(from_reshardable("runs/neox"), "/data/neox-dp8", dp=8, stage=1)
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"--zero-stage must be 1, 2 or 3, got {stage}")
    if dp < 1:
        raise ValueError(f"--dp must be at least 1, got {dp}")
    layout = _pipeline(ckpt, pp, stage)
    root = os.path.abspath(os.fspath(dst))
    tag = f"global_step{ckpt.iteration}"
    final = os.path.join(root, tag)
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists already; convert into another directory or remove it first")
    if layout is not None:
        stages = len(layout["groups"])
        _commit(root, tag, _pipeline_files(ckpt, layout, dp, stage), ckpt, dp, stage, pp=stages)
        log.info("wrote DeepSpeed pipeline checkpoint %s (ZeRO-%d, pp=%d, dp=%d)", final, stage, stages, dp)
        return final
    groups = _groups(ckpt)
    if stage == 3:
        files = _zero3_files(ckpt, groups, dp)
    else:
        files = {"mp_rank_00_model_states.pt": _model_states(ckpt, groups, dp, stage)}
        for rank in range(dp if groups else 0):
            zero = {"optimizer_state_dict": _zero_state(ckpt, groups, dp, rank, stage)}
            files[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = zero | _versions(ckpt, stage)
    _commit(root, tag, files, ckpt, dp, stage)
    log.info("wrote DeepSpeed checkpoint %s (ZeRO-%d, dp=%d, %d groups)", final, stage, dp, len(groups))
    return final


def _pipeline(ckpt: ForeignCheckpoint, pp: int | None, stage: int) -> dict[str, Any] | None:
    """The saved pipeline layout to write at ``pp`` stages; None for a checkpoint without a pipeline.

    Raises:
        CheckpointError: the checkpoint predates the recorded layout, ``pp`` differs from the
            saved stages (DeepSpeed's partition of the layers is the engine's), or ZeRO-3 (which
            DeepSpeed's ``PipelineEngine`` does not run).
    """
    stages = ckpt.extra.get("pipeline_stages")
    if not stages:
        if pp not in (None, 1):
            raise CheckpointError(f"{ckpt.path} was not saved from a DeepSpeed pipeline engine; drop --pp {pp}")
        return None
    layout = ckpt.extra.get("pipeline")
    fix = "load it with shardpoint.integrations.deepspeed.load_checkpoint at that layout and save it again"
    if not layout:
        raise CheckpointError(
            f"{ckpt.path} was saved from a DeepSpeed pipeline engine ({stages} stage(s)) without its layer layout "
            f"(an older shardpoint); {fix}, then convert"
        )
    if pp not in (None, stages):
        raise CheckpointError(
            f"{ckpt.path} was saved at pp={stages}; convert --to deepspeed writes a pipeline at its saved stages "
            f"only (which layers each stage holds is DeepSpeed's partition, not recorded for pp={pp}): {fix}"
        )
    if stage == 3:
        raise CheckpointError(f"{ckpt.path}: DeepSpeed's pipeline engine does not run ZeRO-3; use --zero-stage 1|2")
    return dict(layout)


def _pipeline_files(ckpt: ForeignCheckpoint, layout: dict[str, Any], dp: int, stage: int) -> dict[str, Any]:
    """A ``PipelineEngine``'s files: each layer's ``state_dict``, per stage its model and (pp, dp) optimizer files.

    DeepSpeed's ``PipelineModule.save_state_dict`` writes global layer ``i`` (a tied layer on
    every stage that holds it) as ``layer_<ii>-model_states.pt``; its ``PipelineEngine``
    names stage ``s``'s files ``mp_rank_<ss>`` (tp=1), with ``module`` None, and flattens each
    stage's optimizer groups on their own.
    """
    files: dict[str, Any] = {}
    for index, prefix in enumerate(layout["layers"]):
        if prefix is not None:  # buffers are in params too
            state = ((k[len(prefix) :], t.detach().clone()) for k, t in ckpt.params.items() if k.startswith(prefix))
            files[f"layer_{index:02d}-model_states.pt"] = OrderedDict(state)
    pp = len(layout["groups"])
    for s, recorded in enumerate(layout["groups"]):
        groups = [dict(g) for g in recorded]
        model = _model_states(ckpt, groups, dp, stage)
        model.update(module=None, frozen_param_shapes=None, frozen_param_fragments=None, mp_world_size=pp)
        model["checkpoint_parallel_dimensions"] = {"pp_degree": pp, "tp_degree": 1}
        files[f"mp_rank_{s:02d}_model_states.pt"] = model
        for rank in range(dp if groups else 0):
            zero = {"optimizer_state_dict": _zero_state(ckpt, groups, dp, rank, stage)}
            files[f"zero_pp_rank_{rank}_mp_rank_{s:02d}_optim_states.pt"] = zero | _versions(ckpt, stage)
    return files


def _groups(ckpt: ForeignCheckpoint) -> list[dict[str, Any]]:
    """The flat groups to write: hyperparameters and ``param_names``; [] without optimizer state."""
    trained = [n for n in ckpt.params if any(k in ckpt.optimizer.get(n, {}) for k in _MOMENTS)]
    if not trained:
        return []
    groups = [dict(g) for g in ckpt.param_groups if g.get("param_names")]
    if not groups:  # the order DeepSpeed flattens in is the optimizer's, not the stored one: never guessed
        raise CheckpointError(
            f"{ckpt.path} does not record its optimizer's parameter groups (which parameters DeepSpeed flattens "
            "together, in which order); save it again with this version, or convert with --no-optimizer"
        )
    listed = [n for g in groups for n in g["param_names"]]
    missing = sorted(set(trained) - set(listed))
    unknown = sorted(n for n in listed if n not in ckpt.params or not ckpt.optimizer.get(n))
    if missing or unknown or len(set(listed)) != len(listed):
        raise CheckpointError(
            f"{ckpt.path}: the optimizer groups do not match the parameters with optimizer state (not in a group: "
            f"{missing[:3]}, without state: {unknown[:3]}); convert with --no-optimizer to write the weights only"
        )
    return groups


def _layout(ckpt: ForeignCheckpoint, names: list[str], dp: int) -> tuple[int, int, int]:
    """(elements, padded elements, elements per rank) of one flat group."""
    numel = sum(ckpt.params[n].numel() for n in names)
    padded = math.ceil(numel / (ALIGNMENT * dp)) * ALIGNMENT * dp
    return numel, padded, padded // dp


def _flat(ckpt: ForeignCheckpoint, names: list[str], key: str, padded: int) -> torch.Tensor:
    """One state (``master_param``: the fp32 weights) of a group's parameters flattened in order, zero-padded."""
    parts = []
    for name in names:
        state = ckpt.optimizer[name]
        value = state.get(key, ckpt.params[name]) if key == "master_param" else state[key]
        parts.append(value.detach().reshape(-1).to(torch.float32))
    flat = torch.cat(parts)
    return torch.cat([flat, flat.new_zeros(padded - flat.numel())])


def _zero_state(ckpt: ForeignCheckpoint, groups: list[dict[str, Any]], dp: int, rank: int, stage: int) -> dict:
    """Rank ``rank``'s ``optimizer_state_dict``, as DeepSpeed's ZeRO-1/2 ``state_dict()`` returns it."""
    fp32, paddings, mappings, state, param_groups = [], [], [], {}, []
    for g, group in enumerate(groups):
        names = list(group["param_names"])
        numel, padded, size = _layout(ckpt, names, dp)
        start, end = rank * size, (rank + 1) * size
        padding = padded - numel if rank == dp - 1 else 0
        fp32.append(_flat(ckpt, names, "master_param", padded)[start : end - padding].clone())
        paddings.append(padding)
        mappings.append(_fragments(ckpt, names, start, end))
        state[g] = {k: _flat(ckpt, names, k, padded)[start:end].clone() for k in _MOMENTS}
        step = ckpt.optimizer[names[0]].get("step")
        if step is not None:
            state[g] = {"step": torch.as_tensor(step, dtype=torch.float32).clone()} | state[g]
        hyper = {k: tuple(v) if k == "betas" else v for k, v in group.items() if k != "param_names"}
        param_groups.append(hyper | {"params": [g]})
    return {
        "base_optimizer_state": {"state": state, "param_groups": param_groups},
        "single_partition_of_fp32_groups": fp32,
        "zero_stage": stage,
        "group_paddings": paddings,
        "partition_count": [dp] * len(groups),
        "ds_version": _ds_version(ckpt),
        "param_slice_mappings": mappings,
    }


def _fragments(ckpt: ForeignCheckpoint, names: list[str], start: int, end: int) -> OrderedDict[str, Any]:
    """Where each parameter's piece lies in the slice ``[start, end)`` of the flat group (``fragment_address``)."""
    found: OrderedDict[str, Any] = OrderedDict()
    offset = 0
    for name in names:
        numel = ckpt.params[name].numel()
        low, high = max(offset, start), min(offset + numel, end)
        if low < high:
            address = _FRAGMENT()
            address.__dict__.update(numel=high - low, start=low - start)
            found[name] = address
        offset += numel
    return found


def _model_states(ckpt: ForeignCheckpoint, groups: list[dict[str, Any]], dp: int, stage: int) -> dict[str, Any]:
    """``mp_rank_00_model_states.pt`` as ``engine.save_checkpoint`` writes it, with the source's client state."""
    extra = ckpt.extra
    steps = int(extra.get("global_steps") or ckpt.iteration)
    state: dict[str, Any] = {
        "module": OrderedDict((n, t.detach().clone()) for n, t in ckpt.params.items()),
        "buffer_names": list(ckpt.buffers),
        "optimizer": None,
        "param_shapes": [OrderedDict((n, ckpt.params[n].shape) for n in g["param_names"]) for g in groups],
        "frozen_param_shapes": {},
        "shared_params": {},
        "frozen_param_fragments": {},
        "lr_scheduler": ckpt.scheduler or None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(extra.get("skipped_steps") or 0),
        "global_steps": steps,
        "global_samples": int(extra.get("global_samples") or ckpt.consumed_samples or 0),
        "dp_world_size": dp,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": "1", "tp_degree": "1"},
        **_versions(ckpt, stage),
        "iteration": ckpt.iteration,
    }
    client = extra.get("client_state") or {}
    return state | {k: args_from_json(v) for k, v in client.items() if k not in state}


def _zero3_files(ckpt: ForeignCheckpoint, groups: list[dict[str, Any]], dp: int) -> dict[str, Any]:
    """DeepSpeed's ZeRO-3 files for ``dp`` ranks: per rank, its model states and its optimizer states.

    ZeRO-3 partitions each parameter on its own: rank r holds elements ``[r * n, (r + 1) * n)``
    of the flattened parameter (``n = ceil(numel / dp)``, the last rank's piece zero-padded),
    and a sub-group's fp32 partition (``fp32_flat_groups``) is its parameters' pieces one
    after another, without further padding. A group is cut into sub-groups of at least
    ``sub_group_size`` partitioned elements (DeepSpeed's ``_create_fp16_sub_groups``); the
    base optimizer's state is keyed by sub-group, in order. The model states hold the weights
    as DeepSpeed's partitioned placeholders (empty tensors) and each sub-group's full shapes;
    a parameter outside the optimizer (frozen) as this rank's piece in ``frozen_param_fragments``.
    """
    if not groups:  # DeepSpeed's ZeRO-3 engine restores trained weights from the fp32 partitions only
        raise CheckpointError(
            f"{ckpt.path} has no optimizer state, and DeepSpeed's ZeRO-3 engine takes its trained weights from the "
            "optimizer's fp32 partitions; convert with --zero-stage 1 or 2 (weights only)"
        )
    subs = [(g, names) for g, group in enumerate(groups) for names in _sub_groups(ckpt, group, dp)]
    listed = {n for group in groups for n in group["param_names"]}
    frozen = [n for n in ckpt.params if n not in listed and n not in ckpt.buffers]
    files: dict[str, Any] = {}
    for rank in range(dp):
        model = _model_states(ckpt, groups, dp, 3)
        module = model["module"].items()  # buffers are not partitioned: whole
        model["module"] = OrderedDict((n, t if n in ckpt.buffers else t.new_empty(0)) for n, t in module)
        model["param_shapes"] = [OrderedDict((n, ckpt.params[n].shape) for n in names) for _, names in subs]
        # parameters outside the optimizer: each rank's piece (its ds_tensor), which DeepSpeed's load copies back
        model["frozen_param_shapes"] = OrderedDict((n, ckpt.params[n].shape) for n in frozen)
        pieces = ((n, _zero3_piece(ckpt.params[n], dp, rank, ckpt.params[n].dtype)) for n in frozen)
        model["frozen_param_fragments"] = OrderedDict(pieces)
        model["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 1}
        files[f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"] = model
        zero = {"optimizer_state_dict": _zero3_state(ckpt, groups, subs, dp, rank)}
        files[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = zero | _versions(ckpt, 3)
    return files


def _sub_groups(ckpt: ForeignCheckpoint, group: dict[str, Any], dp: int) -> list[list[str]]:
    """A group's ZeRO-3 sub-groups, cut as DeepSpeed's ``_create_fp16_sub_groups`` cuts them."""
    names = list(group["param_names"])
    config = args_from_json(ckpt.args.get("ds_config")) if ckpt.args.get("ds_config") else {}
    size = int((config.get("zero_optimization") or {}).get("sub_group_size", _SUB_GROUP_SIZE))
    pieces = [math.ceil(ckpt.params[n].numel() / dp) for n in names]
    if size >= sum(pieces):
        return [names]
    subs, current, filled = [], [], 0
    for name, piece in zip(names, pieces):
        current.append(name)
        filled += piece
        if filled >= size or name == names[-1]:
            subs.append(current)
            current, filled = [], 0
    return subs


def _zero3_piece(value: torch.Tensor, dp: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s piece of one parameter's flattened state, zero-padded to ``ceil(numel / dp)``."""
    flat = value.detach().reshape(-1).to(dtype)
    size = math.ceil(flat.numel() / dp)
    piece = flat[rank * size : (rank + 1) * size]
    return torch.cat([piece, piece.new_zeros(size - piece.numel())])


def _zero3_state(ckpt: ForeignCheckpoint, groups: list[dict[str, Any]], subs: list, dp: int, rank: int) -> dict:
    """Rank ``rank``'s ``optimizer_state_dict``, as DeepSpeed's ZeRO-3 ``_rigid_state_dict()`` returns it."""
    fp32, state = [], {}
    param_groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items() if k != "param_names"} for g in groups]
    for hyper in param_groups:
        hyper["params"] = []
    for index, (g, names) in enumerate(subs):
        masters = [ckpt.optimizer[n].get("master_param", ckpt.params[n]) for n in names]
        fp32.append(torch.cat([_zero3_piece(v, dp, rank) for v in masters]))
        state[index] = {k: torch.cat([_zero3_piece(ckpt.optimizer[n][k], dp, rank) for n in names]) for k in _MOMENTS}
        step = ckpt.optimizer[names[0]].get("step")
        if step is not None:
            state[index] = {"step": torch.as_tensor(step, dtype=torch.float32).clone()} | state[index]
        param_groups[g]["params"].append(index)
    return {
        "zero_stage": _STAGE_ENUM(3),
        "loss_scaler": _static_scaler(),
        "dynamic_loss_scale": False,
        "overflow": False,
        "partition_count": dp,
        "optimizer_state_dict": {"state": state, "param_groups": param_groups},
        "fp32_flat_groups": fp32,
    }


def _static_scaler() -> Any:
    """DeepSpeed's static ``LossScaler`` at scale 1 (what an fp32 or bf16 run keeps)."""
    scaler = _SCALER()
    scaler.__dict__.update(cur_scale=1.0, dynamic=False)
    return scaler


def _versions(ckpt: ForeignCheckpoint, stage: int) -> dict[str, Any]:
    config = args_from_json(ckpt.args.get("ds_config")) if ckpt.args.get("ds_config") else None
    return {"ds_config": config or {"zero_optimization": {"stage": stage}}, "ds_version": _ds_version(ckpt)}


def _ds_version(ckpt: ForeignCheckpoint) -> str:
    """The DeepSpeed version the files claim: the source's, the installed one, else the one this writer follows."""
    if ckpt.extra.get("ds_version"):
        return str(ckpt.extra["ds_version"])
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("deepspeed")
    except PackageNotFoundError:
        return "0.19.8"


def _commit(
    root: str, tag: str, files: dict[str, Any], ckpt: ForeignCheckpoint, dp: int, stage: int, pp: int = 1
) -> None:
    """The files into a staging directory, renamed into place with ``shardpoint.json``, then ``latest``."""
    os.makedirs(root, exist_ok=True)
    storage = LocalStorage(root)
    staging = commit.begin(storage, root, tag)
    records = {}
    try:
        for name, state in files.items():
            target = os.path.join(staging, name)
            save_foreign(state, target)
            with open(target, "rb") as f:
                data = f.read()
                os.fsync(f.fileno())
            records[name] = FileRecord(len(data), xxhash.xxh3_64_hexdigest(data))
        meta = CheckpointMetadata(
            iteration=ckpt.iteration,
            format="deepspeed",
            topology={"world": dp * pp, "dp": dp, "tp": 1, "pp": pp, "zero_stage": stage},
            layout="neox",
            files=records,
            wall_time=time.time(),
            library_version=__version__,
        )
        commit.publish(storage, staging, os.path.join(root, tag), meta)
    except BaseException:
        commit.discard(storage, staging)
        raise
    storage.write_atomic(os.path.join(root, "latest"), tag.encode())
