"""The reshardable mode: a DeepSpeed engine saved as shardpoint's ``dist`` format under global names.

:func:`save_checkpoint` / :func:`load_checkpoint` take DeepSpeed's arguments and give its
return values, but write what a :class:`~shardpoint.Checkpointer` writes, with the
``neox`` layout (``<save_dir>/global_step<N>/`` and ``latest``):

==================================  =====================================================
DeepSpeed keeps                     stored as
==================================  =====================================================
the module's weights (ZeRO-1/2:     ``model.<name>``, whole tensors (replicas)
whole on every rank)
each ZeRO rank's slice of the fp32  ``optimizer.state.<name>.fp32``, ``.exp_avg``,
master weights and Adam moments     ``.exp_avg_sq``: ``sp.Shard`` boxes of the parameter
(a fragment of a flat partition)    flattened to 1-D, at the fragment's offset in it
Adam's step, global steps/samples   ``TrainState.extra``
the LR scheduler                    ``TrainState.scheduler``
``client_state``                    per rank (``TrainState.stateful``), so every data-
                                    parallel rank gets its own back (GPT-NeoX saves it
                                    from data-parallel rank 0 only)
RNG streams                         per rank, as every shardpoint checkpoint
==================================  =====================================================

The boxes are in each parameter's own coordinates, not in the padded flat space, whose
padding and order depend on the data-parallel size: a load at another data-parallel
size reads, for each parameter, exactly the fragment its new partition holds.

Under ZeRO-3 the weights are gathered whole for the save and the load (DeepSpeed's
``GatheredParameters``: the model's size in memory on every rank for that moment), so
``model.<name>`` holds the same whole tensors at every stage.

A pipeline engine (``PipelineModule``) stores each stage's layers under the module's own
names, which are global: layer ``i`` is ``<i>.<param>`` on whichever stage holds it (the
``layer_<ii>`` of DeepSpeed's files), and tied layers are replicas on the stages that share
them. So a load at another pipeline size (pp=2 dp=1 to pp=1 dp=2, and back) reads each
stage's layers and each ZeRO rank's fragments from the same keys.

Limits (each raises): tensor parallelism and MoE layers (their names are not global yet:
use engine mode), offloaded optimizer states, ``custom_load_fn``, tags that are not
``global_step<N>``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from shardpoint.checkpointer import Checkpointer
from shardpoint.errors import CheckpointError
from shardpoint.integrations import missing_framework

try:
    import deepspeed
except ModuleNotFoundError as exc:
    raise missing_framework(exc, "deepspeed", "deepspeed") from exc

from shardpoint.integrations.deepspeed.files import tag_iteration
from shardpoint.parallel import comm
from shardpoint.parallel.topology import Topology
from shardpoint.state.sharding import Shard
from shardpoint.state.train_state import TrainState

__all__ = ["load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)

_MOMENTS = ("exp_avg", "exp_avg_sq")
_TAG_PREFIX = "global_step"


class _ModelView(torch.nn.Module):
    """The engine's module as ``sharded_state_dict()``: its own names, its live tensors (loaded in place)."""

    def __init__(self, engine: Any):
        super().__init__()
        self._ds = [engine]  # a list: not registered as a submodule (its parameters are not this view's)

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        module = self._ds[0].module
        return dict(module.state_dict(keep_vars=False))


class _ZeroView:
    """A ZeRO optimizer as ``sharded_state_dict()``: each parameter's fragment of this rank's partition.

    ZeRO-1/2: ``param._hp_mapping`` (DeepSpeed's link from a model parameter to its slice
    of the flat fp32 partition) gives the slice's offset in the flattened parameter and
    views of the fp32 master and of each Adam moment there. ZeRO-3 partitions every
    parameter on its own: rank r holds elements ``[r * n, (r + 1) * n)`` of it (``n`` its
    ``partition_numel()``, the last partition padded), and DeepSpeed's
    ``get_local_fp32_param`` gives views of the master and moments. Loading fills the
    views in place.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self.optimizer = engine.optimizer
        self.param_groups = self.optimizer.param_groups
        self.stage3 = int(engine.zero_optimization_stage()) == 3

    def _flats(self) -> list[torch.Tensor]:
        if self.stage3:
            return list(self.optimizer.fp32_partitioned_groups_flat)
        return list(self.optimizer.single_partition_of_fp32_groups)

    def link(self) -> None:
        """Make sure Adam's moments exist and every parameter's mapping has views of them.

        A fresh engine has none yet (torch's Adam creates them at its first step), and
        DeepSpeed links the views once, lazily: linked before the first step they stay
        empty. So: one step of the base optimizer with zero gradients and a zero learning
        rate (as DCP's ``_init_optim_state`` does; the parameters do not move, the load
        overwrites the moments and the step count), then link again.
        """
        base = self.optimizer.optimizer
        flats = self._flats()
        if any(not base.state.get(flat) for flat in flats):
            self._zero_step(base, flats)
        if not self.stage3:
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()

    def _zero_step(self, base: torch.optim.Optimizer, flats: list[torch.Tensor]) -> None:
        """One step of ``base`` over ``flats`` with zero gradients and learning rate: Adam creates its moments.

        ZeRO-3 keeps its base optimizer's groups empty between steps and steps each
        sub-group alone (DeepSpeed's ``_optimizer_step``); so does this.
        """
        lrs = [group["lr"] for group in base.param_groups]
        owners = [self.optimizer.sub_group_to_group_id[i] if self.stage3 else i for i in range(len(flats))]
        saved = [list(group["params"]) for group in base.param_groups]
        try:
            for group in base.param_groups:
                group["lr"] = 0.0
            for flat, owner in zip(flats, owners):
                flat.grad = torch.zeros_like(flat)
                if self.stage3:
                    base.param_groups[owner]["params"] = [flat]
                base.step()
                if self.stage3:
                    base.param_groups[owner]["params"] = []
                flat.grad = None
        finally:
            for group, lr, params in zip(base.param_groups, lrs, saved):
                group["lr"] = lr
                group["params"] = params
            for flat in flats:
                flat.grad = None

    def sharded_state_dict(self, model_shards: Mapping[str, Shard]) -> dict[str, Shard]:
        self.link()
        if self.stage3:
            return self._stage3_boxes()
        boxes: dict[str, Shard] = {}
        for name, param in self.engine.module.named_parameters():
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:
                continue  # frozen, or no fragment on this rank
            address = mapping.lp_fragment_address
            shape, offset = (param.numel(),), (int(address.start),)
            boxes[f"{name}.fp32"] = Shard(mapping.get_hp_fragment(), shape, offset)
            for key in _MOMENTS:
                if key in mapping.get_optim_state_keys():
                    boxes[f"{name}.{key}"] = Shard(mapping.get_hp_fragment(key), shape, offset)
        return boxes

    def _stage3_boxes(self) -> dict[str, Shard]:
        rank = torch.distributed.get_rank(group=self.optimizer.dp_process_group) if comm.initialized() else 0
        boxes: dict[str, Shard] = {}
        for name, param in self.engine.module.named_parameters():
            if not param.requires_grad:
                continue
            size, total = param.partition_numel(), param.ds_numel
            start = rank * size
            length = max(0, min(size, total - start))
            if length == 0:
                continue  # this rank's partition is all padding
            views = {"fp32": self.optimizer.get_local_fp32_param(param)}
            views.update({key: self.optimizer.get_local_fp32_param(param, key) for key in _MOMENTS})
            for key, view in views.items():
                boxes[f"{name}.{key}"] = Shard(view.narrow(0, 0, length), (total,), (start,))
        return boxes

    def load_sharded_state_dict(self, loaded: Mapping[str, Shard]) -> None:
        """Nothing to copy: the views were filled in place."""

    def step_count(self) -> int | None:
        for state in self.optimizer.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
        return None

    def set_step_count(self, step: int) -> None:
        for state in self.optimizer.optimizer.state.values():
            if "step" in state:
                value = state["step"]
                state["step"] = torch.tensor(float(step), dtype=value.dtype) if torch.is_tensor(value) else step


class _ClientState:
    """``client_state`` of this rank, stored per rank (numpy arrays and argparse Namespaces as plain data)."""

    def __init__(self, value: Mapping[str, Any] | None = None):
        self.value = dict(value or {})

    def state_dict(self) -> dict[str, Any]:
        return _to_plain(self.value)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = _from_plain(dict(state))


def _to_plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {"__numpy__": torch.from_numpy(value.copy())}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, argparse.Namespace):
        return {"__namespace__": _to_plain(vars(value))}
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_plain(v) for v in value)
    return value


def _from_plain(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__numpy__"}:
            return value["__numpy__"].numpy()
        if set(value) == {"__namespace__"}:
            return argparse.Namespace(**_from_plain(value["__namespace__"]))
        return {k: _from_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_from_plain(v) for v in value)
    return value


def _plain_json(value: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``value`` that JSON holds as they are (numbers, strings, lists and dicts of them)."""
    import json

    plain = {}
    for key, item in value.items():
        try:
            if json.loads(json.dumps(item)) == item:
                plain[str(key)] = item
        except (TypeError, ValueError):
            continue
    return plain


def _param_groups(engine: Any) -> list[dict[str, Any]]:
    """Each flat ZeRO group's hyperparameters and its parameters' names in flattening order.

    What ``shardpoint convert --to deepspeed`` needs to lay DeepSpeed's flat partitions
    out again. ZeRO-1/2 flatten each optimizer group in ``round_robin_bit16_groups``
    order; ZeRO-3 cuts each optimizer group into sub-groups (``fp16_groups``, each
    with its group's id in ``sub_group_to_group_id``), joined again here in order.
    """
    names = {id(p): n for n, p in engine.module.named_parameters()}
    base = engine.optimizer.optimizer.param_groups
    flat_groups = getattr(engine.optimizer, "round_robin_bit16_groups", None)
    if flat_groups is None:  # ZeRO-3
        flat_groups = [[] for _ in base]
        for index, sub_group in enumerate(engine.optimizer.fp16_groups):
            flat_groups[engine.optimizer.sub_group_to_group_id[index]].extend(sub_group)
    groups = []
    for params, group in zip(flat_groups, base):
        hyper = {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}
        groups.append(_plain_json(hyper) | {"param_names": [names[id(p)] for p in params]})
    return groups


def _scaler_state(engine: Any) -> dict[str, Any]:
    """The loss scaler's numbers (scale, dynamic-scaling counters): plain values, kept in ``extra``."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return {}
    return {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float)) and not k.startswith("_")}


def _restore_scaler(engine: Any, saved: Mapping[str, Any]) -> None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in saved.items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, value)


def _check_supported(engine: Any) -> None:
    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2, 3):
        raise CheckpointError(
            f"the reshardable DeepSpeed mode needs a ZeRO optimizer (stage 1, 2 or 3; this engine runs stage "
            f"{stage}); use engine mode (shardpoint.integrations.deepspeed.use(engine)) for this run"
        )
    if engine.zero_cpu_offload():
        raise CheckpointError("the reshardable DeepSpeed mode does not support offloaded optimizer states yet")
    # tensor-parallel pieces have names of their own that are not global yet: stored under one
    # key they would be taken for replicas (DESIGN invariant 8). Pipeline stages are fine: a
    # PipelineModule names each layer by its global index ("4.weight" is DeepSpeed's layer_04).
    parallel = {"tensor-parallel size": _tensor_parallel(engine)}
    parallel["MoE layers"] = 2 if getattr(engine, "has_moe_layers", False) else 1
    beyond = [name for name, size in parallel.items() if size > 1]
    if beyond:
        raise CheckpointError(
            f"the reshardable DeepSpeed mode handles data parallelism only; this engine has {', '.join(beyond)}: "
            "use engine mode (shardpoint.integrations.deepspeed.use(engine)) for this run"
        )


def _tensor_parallel(engine: Any) -> int:
    """The tensor-parallel size: a pipeline engine's ``mp_world_size`` counts its stages too (pp × tp)."""
    if getattr(engine, "pipeline_parallelism", False):
        return int(engine.grid.get_slice_parallel_world_size())
    return int(getattr(engine, "mp_world_size", 1))


def _iteration(engine: Any, tag: Any) -> int:
    if tag is None:
        return int(engine.global_steps)
    tag = str(tag)
    if not tag.startswith(_TAG_PREFIX) or not tag[len(_TAG_PREFIX) :].isdigit():
        raise CheckpointError(
            f"tag {tag!r}: the reshardable mode names checkpoints global_step<N> (GPT-NeoX's and DeepSpeed's "
            "default); pass tag=None or a tag of that form"
        )
    return tag_iteration(tag, int(engine.global_steps))


def _whole_parameters(engine: Any, loading: bool) -> Any:
    """ZeRO-3: every parameter whole on every rank for the block (a load's values are re-partitioned from rank 0)."""
    if int(engine.zero_optimization_stage()) != 3:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0 if loading else None)


def _pipeline_layout(engine: Any) -> dict[str, Any] | None:
    """A pipeline engine's layers and each stage's flat groups, gathered from every rank (a collective).

    What ``convert --to deepspeed --pp`` needs to write DeepSpeed's per-layer files and each
    stage's optimizer files: the stage boundaries (``parts``), the key prefix of each global
    layer's ``state_dict`` (``"3."``, ``"tied_modules.io."``; None for a layer DeepSpeed does
    not save, a function) and each stage's :func:`_param_groups`.
    """
    if not getattr(engine, "pipeline_parallelism", False):
        return None
    module, start = engine.module, int(engine.module.parts[engine.stage_id])
    tied = {id(m): f"tied_modules.{key}." for key, m in module.tied_modules.items()}
    layers: dict[int, str | None] = {}
    for index, layer in enumerate(module.forward_funcs):  # DeepSpeed saves what has a state_dict
        saved = hasattr(layer, "state_dict")
        layers[start + index] = (tied.get(id(layer)) or f"{start + index}.") if saved else None
    mine: dict[str, Any] = {"stage": int(engine.stage_id), "layers": layers, "groups": _param_groups(engine)}
    gathered: list[Any] = [mine]
    if comm.initialized():
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
    stages: dict[int, Any] = {}
    prefixes: dict[int, Any] = {}
    for item in gathered:
        stages.setdefault(item["stage"], item["groups"])
        prefixes.update(item["layers"])
    parts = [int(p) for p in module.parts]
    return {
        "parts": parts,
        "layers": [prefixes[i] for i in range(parts[-1])],
        "groups": [stages[s] for s in sorted(stages)],
    }


def _stages(engine: Any) -> int:
    """The engine's pipeline stages (1 without a pipeline)."""
    return int(getattr(engine, "num_stages", 1)) if getattr(engine, "pipeline_parallelism", False) else 1


def _topology(engine: Any) -> Topology:
    """pp × dp as DeepSpeed's ``PipeDataParallelTopology`` orders them (data fastest), which is ``Topology``'s order.

    The layout decides whether per-rank state (client_state, RNG) is restored: only at the
    pp and dp it was saved at.
    """
    world = comm.world_size() if comm.initialized() else 1
    stages = _stages(engine)
    return Topology(pp_size=stages, dp_size=world // stages)


def _checkpointer(engine: Any, directory: str, options: Mapping[str, Any]) -> Checkpointer:
    return Checkpointer(str(directory), topology=_topology(engine), layout="neox", format="dist", **options)


def _train_state(engine: Any, client: _ClientState, optimizer: bool, scheduler: bool) -> TrainState:
    return TrainState(
        model=_ModelView(engine),
        optimizer=_ZeroView(engine) if optimizer else None,
        scheduler=engine.lr_scheduler if scheduler and optimizer else None,
        stateful={"client_state": client},
    )


def save_checkpoint(
    engine: Any,
    save_dir: str,
    tag: Any = None,
    client_state: Mapping[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    *,
    checkpointer_options: Mapping[str, Any] | None = None,
) -> bool:
    """``engine.save_checkpoint(...)`` as a reshardable shardpoint checkpoint; every rank calls it. Returns True.

    ``save_latest=False`` is not honoured (the tracker always moves to a committed save:
    it is what makes a crash safe), nor ``exclude_frozen_parameters`` (frozen tensors are
    stored once across checkpoints anyway); each logs a warning.
    ``checkpointer_options`` go to :class:`~shardpoint.Checkpointer` (``keep_last``,
    ``config``, ``upload_to``, ...).

    Example::

        save_checkpoint(engine, args.save, tag=f"global_step{step}", client_state={"iteration": step})
    """
    _check_supported(engine)
    if not save_latest or exclude_frozen_parameters:
        log.warning("save_latest=False and exclude_frozen_parameters are not applied by the reshardable mode")
    iteration = _iteration(engine, tag)
    view = _ZeroView(engine)
    state = _train_state(engine, _ClientState(client_state), optimizer=True, scheduler=True)
    state.extra.update(
        global_steps=int(engine.global_steps),
        global_samples=int(engine.global_samples),
        skipped_steps=int(engine.skipped_steps),
        optimizer_step=view.step_count(),
        loss_scaler=_scaler_state(engine),
        # what of client_state is plain data, for a load at another layout (where per-rank state is not restored)
        client_state=_plain_json(client_state or {}),
        param_groups=_param_groups(engine),
        # a pipeline engine's (1 at pp=1), and its layers and each stage's groups (convert --to deepspeed --pp)
        pipeline_stages=_stages(engine) if getattr(engine, "pipeline_parallelism", False) else None,
        pipeline=_pipeline_layout(engine),
    )
    with _whole_parameters(engine, loading=False), _checkpointer(engine, save_dir, checkpointer_options or {}) as ckpt:
        ckpt.save(iteration, state)
    return True


def load_checkpoint(
    engine: Any,
    load_dir: str,
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn: Any = None,
    *,
    checkpointer_options: Mapping[str, Any] | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """``engine.load_checkpoint(...)`` from a checkpoint :func:`save_checkpoint` wrote, at any data-parallel size.

    Returns ``(load_path, client_state)`` as DeepSpeed does, ``(None, None)`` when there
    is nothing to load. ``client_state`` is this rank's own (saved per rank).

    Raises:
        CheckpointError: ``custom_load_fn`` given, or an unsupported engine; any load failure, on every rank.
    """
    if custom_load_fn is not None:
        raise CheckpointError("custom_load_fn is not supported by the reshardable mode: it loads DeepSpeed's files")
    _check_supported(engine)
    optimizer = load_optimizer_states and not load_module_only
    client = _ClientState()
    state = _train_state(engine, client, optimizer=optimizer, scheduler=load_lr_scheduler_states)
    iteration = None if tag is None else _iteration(engine, tag)
    with _whole_parameters(engine, loading=True), _checkpointer(engine, load_dir, checkpointer_options or {}) as ckpt:
        rng = not load_module_only
        strict = load_module_strict
        result = ckpt.load(state, iteration=iteration, load_optimizer=optimizer, load_rng=rng, strict=strict)
    if result is None:
        return None, None
    extra = result.extra or {}
    if optimizer:
        if extra.get("optimizer_step") is not None:
            _ZeroView(engine).set_step_count(int(extra["optimizer_step"]))
    else:
        engine.optimizer.refresh_fp32_params()  # the fp32 masters follow the loaded weights
    if optimizer:
        _restore_scaler(engine, extra.get("loss_scaler") or {})
    if not client.value and extra.get("client_state"):
        client.value = dict(extra["client_state"])  # saved at another layout: rank 0's plain part, as DeepSpeed
    if not load_module_only:
        engine.global_steps = int(extra.get("global_steps", result.iteration))
        engine.global_samples = int(extra.get("global_samples", engine.global_samples))
        engine.skipped_steps = int(extra.get("skipped_steps", engine.skipped_steps))
    return result.path, client.value
