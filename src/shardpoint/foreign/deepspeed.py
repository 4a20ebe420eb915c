"""DeepSpeed (and GPT-NeoX) checkpoints, ZeRO stage 1/2, read into global tensors.

Layout of ``engine.save_checkpoint`` (``deepspeed/runtime/engine.py``)::

    latest                                              # the tag, e.g. "global_step200"
    global_step200/mp_rank_XX_model_states.pt           # module weights (None with pipelines),
                                                        #   param_shapes, scheduler, client state
    global_step200/zero_pp_rank_D_mp_rank_XX_optim_states.pt   # ZeRO: data-parallel rank D's
                                                        #   flat fp32 partition and Adam moments
    global_step200/layer_LL-model_states.pt             # pipeline: one file per layer
    global_step200/layer_LL-model_TT-model_states.pt    # (GPT-NeoX with tensor parallelism)

ZeRO-1/2 flatten each parameter group into one fp32 vector and give each DP rank an
equal slice; ``param_slice_mappings`` names, per rank, where each parameter's
fragment lies in that slice (``fragment_address(numel, start)``). Concatenating a
parameter's fragments over the DP ranks, in rank order, gives its full fp32 master
weight, ``exp_avg`` and ``exp_avg_sq``; this is what ``zero_to_fp32.py`` and the
universal-checkpoint converter do, done here without running their scripts.

Names are the engine's own: ``module`` state dict names, and ``<layer>.<name>`` for a
``PipelineModule`` (global layer index, the same at any pipeline size).

Limits: ZeRO stage 3, and tensor parallelism inside DeepSpeed files (mp_world_size > 1
without a pipeline), are refused with an error.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch

from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.foreign._types import ForeignCheckpoint, args_to_json
from shardpoint.foreign._unpickle import ForeignEnum, load_foreign

__all__ = ["is_deepspeed_dir", "read_deepspeed"]

log = logging.getLogger(__name__)

_MODEL = re.compile(r"mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_LAYER = re.compile(r"layer_(\d+)-model(?:_(\d+)-model)?_states\.pt$")


def is_deepspeed_dir(directory: str) -> bool:
    """True when ``directory`` holds ``mp_rank_XX_model_states.pt``."""
    return os.path.isdir(directory) and any(_MODEL.match(n) for n in os.listdir(directory))


def read_deepspeed(directory: str) -> ForeignCheckpoint:
    """Read one DeepSpeed tag directory (``global_stepN``) into a :class:`ForeignCheckpoint`.

    Raises:
        UnsafeCheckpointError: a pickle names a class outside the allow-list.
        CorruptCheckpointError: files are missing or fragments do not add up.
        CheckpointError: ZeRO-3 or tensor parallelism (not supported).
    """
    names = sorted(os.listdir(directory))
    models = {int(m.group(1)): os.path.join(directory, n) for n in names if (m := _MODEL.match(n))}
    if not models:
        raise CorruptCheckpointError(f"{directory} has no mp_rank_XX_model_states.pt: not a DeepSpeed checkpoint")
    states = {mp: load_foreign(path) for mp, path in sorted(models.items())}
    first = states[min(states)]
    layers = {n: m for n in names if (m := _LAYER.match(n))}
    pipeline = bool(layers)
    if not pipeline and int(first.get("mp_world_size", 1) or 1) > 1:
        raise CheckpointError(
            f"{directory}: tensor-parallel DeepSpeed checkpoints (mp_world_size > 1) are not supported yet"
        )
    if any(m.group(2) not in (None, "00") for m in layers.values()):
        raise CheckpointError(f"{directory}: tensor-parallel layer files (layer_LL-model_TT) are not supported yet")
    weights = _pipeline_weights(directory, layers) if pipeline else dict(first["module"] or {})
    args = first.get("args")
    ckpt = ForeignCheckpoint(
        tool="deepspeed",
        format="deepspeed",
        path=directory,
        iteration=int(first.get("iteration", first.get("global_steps", 0)) or 0),
        tp=1,
        pp=len(states) if pipeline else 1,
        dp=int(first.get("dp_world_size", 1) or 1),
        scheduler=dict(first.get("lr_scheduler") or {}),
        consumed_samples=first.get("global_samples"),
        args={
            **(args_to_json(args) if isinstance(args, dict) or hasattr(args, "__dict__") else {}),
            "ds_config": args_to_json(first.get("ds_config") or {}),
        },
        extra={"ds_version": first.get("ds_version"), "skipped_steps": first.get("skipped_steps", 0)},
    )
    for mp in sorted(states):
        shapes = states[mp].get("param_shapes") or []
        optim = _optimizer_files(directory, names, mp)
        if not optim:
            log.warning("%s: no ZeRO optimizer files for mp_rank_%02d; importing weights only", directory, mp)
            continue
        ckpt.optimizer_sharding = f"zero-{_stage(optim[0])}"
        _add_zero_state(ckpt, optim, shapes, weights, f"{directory} (mp_rank_{mp:02d})")
    order = [n for mp in sorted(states) for group in (states[mp].get("param_shapes") or []) for n in group]
    ckpt.params = {n: weights[n] for n in order if n in weights} | {n: t for n, t in weights.items() if n not in order}
    for name in ckpt.params:
        ckpt.optimizer.setdefault(name, {})
        ckpt.split_dims[name] = None
    return ckpt


def _pipeline_weights(directory: str, layers: dict[str, re.Match]) -> dict[str, torch.Tensor]:
    weights = {}
    for file, match in sorted(layers.items(), key=lambda item: int(item[1].group(1))):
        state = load_foreign(os.path.join(directory, file))
        for name, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                weights[f"{int(match.group(1))}.{name}"] = tensor
    return weights


def _optimizer_files(directory: str, names: list[str], mp: int) -> list[dict[str, Any]]:
    files = {int(m.group(1)): n for n in names if (m := _OPTIM.match(n)) and int(m.group(2)) == mp}
    if files and sorted(files) != list(range(len(files))):
        raise CorruptCheckpointError(f"{directory}: ZeRO files of mp_rank_{mp:02d} are missing ranks: {sorted(files)}")
    return [load_foreign(os.path.join(directory, files[d]))["optimizer_state_dict"] for d in sorted(files)]


def _stage(optim: dict[str, Any]) -> int:
    stage = optim.get("zero_stage")
    value = stage.value if isinstance(stage, ForeignEnum) else stage
    if value not in (1, 2):
        raise CheckpointError(f"ZeRO stage {value} checkpoints are not supported yet (stage 1 and 2 are)")
    return int(value)


def _add_zero_state(
    ckpt: ForeignCheckpoint, ranks: list[dict[str, Any]], shapes: list[dict[str, Any]], weights: dict, where: str
) -> None:
    """Reassemble each parameter's fp32 master and moments from the DP ranks' fragments."""
    for group, group_shapes in enumerate(shapes):
        base = ranks[0]["base_optimizer_state"]
        hyper = {k: v for k, v in base["param_groups"][group].items() if k != "params"}
        if group < len(ckpt.param_groups):  # pipeline: stage optimizers have the same groups
            ckpt.param_groups[group]["param_names"] += list(group_shapes)
        else:
            ckpt.param_groups.append(hyper | {"param_names": list(group_shapes)})
        flats = [
            {
                "fp32": r["single_partition_of_fp32_groups"][group],
                **{k: v for k, v in r["base_optimizer_state"]["state"][group].items() if k != "step"},
            }
            for r in ranks
        ]
        step = base["state"][group].get("step")
        for name, shape in group_shapes.items():
            pieces: dict[str, list[torch.Tensor]] = {key: [] for key in flats[0]}
            for rank, flat in zip(ranks, flats):
                address = rank["param_slice_mappings"][group].get(name)
                if address is None:
                    continue
                start, numel = int(address.start), int(address.numel)
                for key in pieces:
                    pieces[key].append(flat[key][start : start + numel])
            full = {key: torch.cat(parts) for key, parts in pieces.items()}
            if full["fp32"].numel() != torch.Size(shape).numel():
                raise CorruptCheckpointError(
                    f"{where}: the fragments of {name} hold {full['fp32'].numel()} elements, its shape {tuple(shape)} "
                    f"needs {torch.Size(shape).numel()}"
                )
            entry = {key: full[key].view(shape).clone() for key in full if key != "fp32"}
            if step is not None:
                entry["step"] = torch.as_tensor(step).clone()
            master = full["fp32"].view(shape).clone()
            weight = weights.get(name)
            if weight is None or weight.dtype != master.dtype:
                entry["master_param"] = master  # the fp32 master beside lower-precision (or absent) module weights
            elif not torch.equal(weight, master):
                log.warning("%s: module weight %s differs from its fp32 master copy; keeping the master", where, name)
                weights[name] = master
            ckpt.optimizer[name] = entry
