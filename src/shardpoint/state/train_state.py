"""What a checkpoint holds, and how it is taken from and put back into training objects.

:class:`TrainState` is what the user hands over. :func:`collect` turns it into a
:class:`FlatState`: every tensor under a global key as a :class:`~shardpoint.state.sharding.Shard`
(``model.<key>``, ``optimizer.state.<param key>.<name>``), the state common to all
ranks, and the state of this rank alone (RNG streams). Formats only ever see a
``FlatState``; :func:`restore` puts loaded common state back.

Loading fills the very tensors ``collect`` returned, in place, so no second copy of
the model is ever built.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from shardpoint.errors import CheckpointError
from shardpoint.parallel import comm
from shardpoint.state import naming, resizing, rng
from shardpoint.state.sharding import Shard, flatten_shards, is_dtensor, to_shard

__all__ = [
    "FlatState",
    "ParamIndex",
    "TrainState",
    "add_optimizer_state",
    "collect",
    "load_resized",
    "param_shard_index",
    "restore",
    "restoring",
]

log = logging.getLogger(__name__)

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optimizer.state."


@dataclass
class TrainState:
    """Everything a training job needs to resume.

    Args:
        model: a module; its ``sharded_state_dict()`` is used when defined (Megatron's
            convention: global keys, values are tensors, ``sp.Shard`` or ``DTensor``),
            else ``state_dict()`` with every tensor replicated (or ``DTensor``).
        optimizer: a ``torch.optim.Optimizer`` (its per-parameter state follows the
            sharding of its parameter), or a distributed optimizer defining
            ``sharded_state_dict(model_shards)`` / ``load_sharded_state_dict(...)``.
        scheduler: anything with ``state_dict``/``load_state_dict`` (LR scheduler).
        grad_scaler: a ``torch.amp.GradScaler`` or similar.
        generators: extra ``torch.Generator`` objects (e.g. Megatron's model-parallel
            RNG tracker) whose states are saved per rank.
        stateful: further objects with ``state_dict()``/``load_state_dict()`` whose
            state belongs to this rank (torchtitan's way): a ``torchdata``
            ``StatefulDataLoader``, a data sampler. Saved per rank beside the RNG
            streams and restored at the same layout only (a warning says so otherwise).
            Their state dicts hold plain values and tensors (loading never unpickles objects).
        extra: JSON-like training progress, e.g. ``{"consumed_samples": 1024}``;
            ``consumed_samples`` and ``flops`` are also recorded in ``shardpoint.json``.
    """

    model: torch.nn.Module | None = None
    optimizer: Any = None
    scheduler: Any = None
    grad_scaler: Any = None
    generators: dict[str, torch.Generator] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    stateful: dict[str, Any] = field(default_factory=dict)


@dataclass
class FlatState:
    """A TrainState flattened for a format.

    Attributes:
        tensors: global-key shards; a box held by several ranks is a replica and is
            stored once (see :mod:`shardpoint.state.replicas` for the check that they agree).
        common: small state every rank shares (iteration, hyperparameters, scheduler).
        per_rank: small state of this rank alone (RNG streams).
        rank_local: tensors that belong to this rank only and have no place in a global
            tensor (e.g. Adafactor's factored statistics of a sharded parameter). They
            are stored under this rank's own key and restored only at the same layout.
        shared_if_equal: keys of ``tensors`` whose holders may legitimately disagree
            (optimizer scalars, non-elementwise state of whole parameters): stored once
            when every holder has the same value, moved to ``rank_local`` otherwise.
        resizable: model keys whose tensor is whole on every rank, so that a load may read
            it at its saved size and hand it to the model's ``load_state_dict``
            (:mod:`shardpoint.state.resizing`).
        resized: what a load read that way: key -> (the model's shape, the loaded tensor).
        frozen: model keys of parameters that are not trained (:func:`frozen_keys`), the
            tensors a save may store once for several checkpoints (:mod:`shardpoint.formats.dedup`).
    """

    tensors: dict[str, Shard]
    common: dict[str, Any]
    per_rank: dict[str, Any]
    rank_local: dict[str, torch.Tensor] = field(default_factory=dict)
    shared_if_equal: set[str] = field(default_factory=set)
    resizable: set[str] = field(default_factory=set)
    resized: dict[str, tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)

    def resize(self, key: str, saved_shape: tuple[int, ...]) -> Shard | None:
        """The new target of ``key`` when it may be loaded at its saved size, else None (a size difference)."""
        if key not in self.resizable or key not in self.tensors:
            return None
        old = self.tensors[key]
        self.tensors[key] = new = resizing.resized_target(old, tuple(saved_shape))
        self.resized[key] = (old.global_shape, new.tensor)
        return new

    def nbytes(self) -> int:
        tensors = [s.tensor for s in self.tensors.values()] + list(self.rank_local.values())
        return sum(t.numel() * t.element_size() for t in tensors)


def collect(
    state: TrainState,
    *,
    iteration: int,
    include_optimizer: bool = True,
    include_rng: bool = True,
    init_optimizer: bool = False,
    resizable: bool = False,
) -> FlatState:
    """Flatten ``state`` into global-key shards (views of the live tensors, no copies).

    ``resizable`` (loads): note the model tensors a load may read at their saved size.
    """
    common: dict[str, Any] = {"iteration": iteration, "extra": dict(state.extra)}
    per_rank = {"rng": rng.capture(state.generators)} if include_rng else {}
    if include_rng and state.stateful:
        per_rank["stateful"] = {name: obj.state_dict() for name, obj in state.stateful.items()}
    flat = FlatState({}, common, per_rank)
    if state.model is not None:
        values = naming.model_state(state.model)
        flat.tensors = flatten_shards(values, MODEL_PREFIX, flat.rank_local)
        if resizable:
            flat.resizable = resizing.plain_keys(state.model, values, MODEL_PREFIX)
        flat.frozen = frozen_keys(state.model, flat.tensors, state.optimizer)
    if include_optimizer and state.optimizer is not None:
        if init_optimizer:
            _ensure_optimizer_state(state.optimizer)
        add_optimizer_state(flat, state.optimizer, state.model)
        common["optimizer_param_groups"] = _param_groups(state.optimizer)
        common["distributed_optimizer"] = hasattr(state.optimizer, "sharded_state_dict")
    if include_optimizer and state.scheduler is not None:
        common["scheduler"] = state.scheduler.state_dict()
    if include_optimizer and state.grad_scaler is not None:
        common["grad_scaler"] = state.grad_scaler.state_dict()
    return flat


def frozen_keys(
    model: torch.nn.Module, tensors: Mapping[str, Shard], optimizer: torch.optim.Optimizer | None = None
) -> set[str]:
    """The model keys whose tensor is (the local part of) a parameter that is not trained.

    Not trained: ``requires_grad=False``, or, when ``optimizer`` holds the model's own
    parameters and nothing else (:func:`_holds_model_parameters`), a parameter in none of
    its groups: an optimizer built over the adapters only leaves the
    base unchanged even where nobody set ``requires_grad=False``. These are only
    candidates: the save hashes each and stores it once only while its bytes stay equal
    (:mod:`shardpoint.formats.dedup`), so a parameter changed by other means is written.
    """
    params = [p for p in model.parameters() if _local(p).numel()]
    untrained = [p for p in params if not p.requires_grad]
    if optimizer is not None and _holds_model_parameters(optimizer, {id(p) for p in model.parameters()}):
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        untrained += [p for p in params if p.requires_grad and id(p) not in optimized]
    frozen = {_local(p).data_ptr() for p in untrained}
    if not frozen:
        return set()
    return {k for k, s in tensors.items() if k.startswith(MODEL_PREFIX) and s.tensor.data_ptr() in frozen}


def _holds_model_parameters(optimizer: Any, model_ids: set[int]) -> bool:
    """Whether ``optimizer`` trains the model's own parameters, and only those.

    Not a distributed optimizer (it places its own state), nor one over master copies
    (fp32 copies of bf16 weights: the weights it updates are not the model's tensors).
    """
    if optimizer is None or hasattr(optimizer, "sharded_state_dict"):
        return False
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) and "params" in g for g in groups):
        return False
    held = {id(p) for group in groups for p in group["params"]}
    return bool(held) and held <= model_ids


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def restore(
    state: TrainState,
    common: Mapping[str, Any],
    per_rank: Mapping[str, Any] | None,
    include_optimizer: bool = True,
    where: str = "the checkpoint",
) -> None:
    """Apply loaded common and per-rank state (tensors were already filled in place).

    ``state.extra`` is updated with the saved extra, so ``consumed_samples`` resumes too.
    Without ``include_optimizer`` the scheduler and grad scaler stay as they are too,
    as with Megatron's ``--no-load-optim``.

    Raises:
        CheckpointError: an item rejected its saved state (a scheduler's or stateful's
            ``load_state_dict``, an RNG state of the wrong form), naming the item, this
            rank and ``where``. The load pipeline runs this inside an agreement round,
            so the failure of one rank is raised on every rank (invariant 17).
    """
    state.extra.update(common.get("extra", {}))
    if not include_optimizer:
        common = {k: v for k, v in common.items() if k not in ("optimizer_param_groups", "scheduler", "grad_scaler")}
    keep = "or load with load_optimizer=False to keep the current one"
    if "optimizer_param_groups" in common and state.optimizer is not None:
        with restoring("the optimizer's param groups (optimizer_param_groups)", where, keep):
            _restore_param_groups(state.optimizer, common["optimizer_param_groups"])
    if "scheduler" in common and state.scheduler is not None:
        with restoring("the scheduler (scheduler)", where, keep):
            state.scheduler.load_state_dict(common["scheduler"])
    if "grad_scaler" in common and state.grad_scaler is not None:
        with restoring("the grad scaler (grad_scaler)", where, keep):
            state.grad_scaler.load_state_dict(common["grad_scaler"])
    if per_rank and per_rank.get("rng") is not None:
        with restoring("the RNG state (rng)", where, "or load with load_rng=False to keep the current RNG state"):
            rng.restore(per_rank["rng"], state.generators)
    if per_rank:
        _restore_stateful(state.stateful, per_rank.get("stateful") or {}, where)


@contextmanager
def restoring(item: str, where: str, advice: str) -> Iterator[None]:
    """Turn any failure of restoring ``item`` into a CheckpointError naming it, this rank and ``where``."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # user objects' load_state_dict raise anything
        raise CheckpointError(
            f"{where}: restoring {item} failed on rank {comm.rank()}: {type(exc).__name__}: {exc}. "
            f"The saved state does not fit this job's object: load another checkpoint, {advice}"
        ) from exc


def load_resized(state: TrainState, flat: FlatState) -> None:
    """Hand the model tensors a load read at their saved size to the model (see :mod:`~shardpoint.state.resizing`)."""
    if state.model is not None:
        resizing.load_resized(state.model, flat.resized, MODEL_PREFIX)


def _restore_stateful(objects: Mapping[str, Any], saved: Mapping[str, Any], where: str) -> None:
    skip = "or load with load_rng=False (it skips RNG and TrainState.stateful)"
    for name, obj in objects.items():
        if name in saved:
            with restoring(f"TrainState.stateful[{name!r}]", where, skip):
                obj.load_state_dict(saved[name])
        else:
            log.warning("TrainState.stateful[%r] has no saved state in this checkpoint; it starts afresh", name)


def model_shards(model: torch.nn.Module, rank_local: dict[str, torch.Tensor] | None = None) -> dict[str, Shard]:
    """The model's tensors under ``model.<canonical key>`` (see :mod:`shardpoint.state.naming`).

    :class:`~shardpoint.state.sharding.RankLocal` values go to ``rank_local``.
    """
    return flatten_shards(naming.model_state(model), MODEL_PREFIX, rank_local)


def add_optimizer_state(flat: FlatState, optimizer: Any, model: torch.nn.Module | None = None) -> None:
    """Add per-parameter optimizer state to ``flat``, placed by how it relates to its parameter.

    - elementwise state (Adam's moments: the parameter's shape) takes the parameter's
      box in the global tensor, so it reshards with it; a ``DTensor`` moment is
      converted like any ``DTensor``, by its own placements;
    - scalars (``step``) and any state of a whole (unsharded) parameter mean the same
      thing at every layout: stored once when all ranks holding them agree, per rank
      otherwise (``flat.shared_if_equal``);
    - other state of a sharded parameter (Adafactor's ``row_var``/``col_var``) describes
      this rank's piece only: it is rank-local and never merged with another rank's.

    A distributed optimizer that defines ``sharded_state_dict(model_shards)`` places
    its state itself, with :class:`~shardpoint.state.sharding.Shard`.
    """
    if hasattr(optimizer, "sharded_state_dict"):
        flat.tensors.update(flatten_shards(optimizer.sharded_state_dict(flat.tensors), OPTIM_PREFIX))
        return
    params = ParamIndex(model, flat.tensors)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param not in optimizer.state or not optimizer.state[param]:
                continue
            param_key, param_shard = params.find(param)
            for name, value in optimizer.state[param].items():
                key = f"{OPTIM_PREFIX}{param_key}.{name}"
                if not isinstance(value, torch.Tensor):
                    value = torch.tensor(value)
                    optimizer.state[param][name] = value
                if is_dtensor(value) and value.dim() > 0:
                    flat.tensors[key] = to_shard(value, key)
                elif value.shape == param_shard.tensor.shape:
                    flat.tensors[key] = param_shard.like(value)
                elif value.dim() == 0 or param_shard.is_full:
                    flat.tensors[key] = to_shard(value, key)
                    flat.shared_if_equal.add(key)
                else:
                    flat.rank_local[key] = value


class ParamIndex:
    """Finds the model key and shard of an optimizer's parameter.

    A model read through ``get_model_state_dict`` (no ``sharded_state_dict()``) names
    its parameters itself, so they are matched by identity. A ``sharded_state_dict()``
    chooses its own keys, so there a parameter is found by the storage its shard views
    (the local tensor of a ``DTensor``).
    """

    def __init__(self, model: torch.nn.Module | None, model_tensors: Mapping[str, Shard]):
        self.tensors = model_tensors
        self.by_id: dict[int, str] = {}
        if model is not None and not hasattr(naming.unwrap(model), "sharded_state_dict"):
            self.by_id = naming.parameter_names(model)
        self.by_storage = param_shard_index(model_tensors)

    def find(self, param: torch.Tensor) -> tuple[str, Shard]:
        """``(key without "model.", Shard)`` of ``param``; KeyError naming its shape when absent."""
        name = self.by_id.get(id(param))
        if name is not None and MODEL_PREFIX + name in self.tensors:
            return name, self.tensors[MODEL_PREFIX + name]
        return find_param(self.by_storage, param)

    def lookup(self, param: torch.Tensor) -> str | None:
        try:
            return self.find(param)[0]
        except KeyError:
            return None


def load_optimizer_shards(optimizer: Any, loaded: Mapping[str, Shard]) -> None:
    """Hand loaded values to a distributed optimizer that asked to receive them."""
    if hasattr(optimizer, "load_sharded_state_dict"):
        prefix = len(OPTIM_PREFIX)
        optimizer.load_sharded_state_dict({k[prefix:]: v for k, v in loaded.items() if k.startswith(OPTIM_PREFIX)})


def _param_groups(optimizer: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _restore_param_groups(optimizer: Any, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(optimizer.param_groups):
        log.warning(
            "optimizer has %d param groups but the checkpoint has %d; keeping the current hyperparameters",
            len(optimizer.param_groups),
            len(saved),
        )
        return
    for group, saved_group in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def storage_key(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    if is_dtensor(tensor):
        tensor = tensor._local_tensor
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())


def param_shard_index(model_tensors: Mapping[str, Shard]) -> dict[tuple, tuple[str, Shard]]:
    """Map a parameter's storage to its ``(key without "model.", Shard)``; see :func:`find_param`."""
    return {
        storage_key(shard.tensor): (key[len(MODEL_PREFIX) :], shard)
        for key, shard in model_tensors.items()
        if shard.tensor.numel() > 0
    }


def find_param(by_storage: Mapping[tuple, tuple[str, Shard]], param: torch.Tensor) -> tuple[str, Shard]:
    found = by_storage.get(storage_key(param))
    if found is None:
        raise KeyError(
            f"an optimizer parameter of shape {tuple(param.shape)} is not in the model's state dict; "
            "every optimized parameter must appear (as itself or a view) in model.sharded_state_dict()"
        )
    return found


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Create lazily-initialised optimizer state (Adam's moments) so loading has targets.

    Runs one step with a zero learning rate and zero gradients, as DCP's own
    ``_init_optim_state`` does; the values are overwritten by the load.
    """
    if hasattr(optimizer, "sharded_state_dict") or not isinstance(optimizer, torch.optim.Optimizer):
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    saved_grads = [p.grad for p in params]
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    try:
        optimizer.step()
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, saved_lrs):
            g["lr"] = lr
