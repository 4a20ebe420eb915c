"""Checkpoint keys are the model's own names, whatever wraps the model.

``torch.compile`` puts ``_orig_mod.`` into every ``state_dict`` key, DDP puts
``module.``, FSDP1 ``_fsdp_wrapped_module.``; a checkpoint written under one wrapper
would not load under another, or into the bare model that evaluation and export use.
So keys are canonical when written:

- a model without ``sharded_state_dict()`` is read with PyTorch's own
  ``torch.distributed.checkpoint.state_dict.get_model_state_dict``, which returns the
  fully qualified names without wrapper parts (the mechanism PyTorch uses for DCP);
- a model with ``sharded_state_dict()`` names its keys itself; wrappers around it
  are peeled first (:func:`unwrap`) so the method is found under DDP too.

On load, stored keys are translated to current names (:func:`stored_to_current`):
checkpoints written before keys were canonical (wrapper parts in their keys) are
mapped, and ``load(rename=...)`` maps keys of a checkpoint from before a refactor.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from shardpoint.parallel import comm

__all__ = [
    "RANK_LOCAL_PREFIX",
    "Rename",
    "model_state",
    "parameter_names",
    "split_key",
    "stored_key",
    "stored_to_current",
    "translate",
    "unwrap",
]

log = logging.getLogger(__name__)

Rename = Mapping[str, str] | Callable[[str], str] | None

# what wrappers insert into keys; stripped only from checkpoints that hold them
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
_DDP_ROOT = "module."


# rank-local keys (:mod:`shardpoint.state.rank_local`): ``rank_local.<rank, 5 digits>.<key>``
RANK_LOCAL_PREFIX = "rank_local."


def stored_key(key: str, rank: int) -> str:
    """The ``dist`` format's key for ``key`` as held by ``rank``."""
    return f"{RANK_LOCAL_PREFIX}{rank:05d}.{key}"


def split_key(stored: str) -> tuple[int, str] | None:
    """``(rank, key)`` of a stored rank-local key, or None for any other key."""
    if not stored.startswith(RANK_LOCAL_PREFIX):
        return None
    rank, _, key = stored[len(RANK_LOCAL_PREFIX) :].partition(".")
    return (int(rank), key) if rank.isdigit() and key else None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP, FSDP1, ``torch.compile`` and activation-checkpoint wrappers."""
    while True:
        inner: object
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or _is_fsdp1(model):
            inner = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            inner = model._orig_mod
        else:
            inner = getattr(model, "_checkpoint_wrapped_module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def model_state(model: torch.nn.Module) -> Mapping[str, Any]:
    """The model's tensors under canonical keys (views of the live tensors, no copies)."""
    sharded_state_dict = getattr(unwrap(model), "sharded_state_dict", None)  # Megatron's modules
    if sharded_state_dict is not None:
        return sharded_state_dict()
    return _CANONICAL.state(model)


class _CanonicalNames:
    """``get_model_state_dict``'s keys, computed once per model structure.

    PyTorch's ``get_model_state_dict`` resolves each key's fully qualified name by walking
    the module tree (``_get_fqns``): about 100 µs per tensor, a second at every save of a
    model with 10,000 tensors. Its result is ``model.state_dict()`` with keys renamed, in
    the same order, so the renaming is kept per model and reused while ``state_dict()``'s
    keys stay the same. FSDP1 changes what ``state_dict()`` returns, so it always takes
    PyTorch's path.
    """

    def __init__(self) -> None:
        self._renames: weakref.WeakKeyDictionary[torch.nn.Module, tuple[list[str], list[str]]] = (
            weakref.WeakKeyDictionary()
        )

    def state(self, model: torch.nn.Module) -> Mapping[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if any(_is_fsdp1(m) for m in model.modules()):
            return get_model_state_dict(model)
        raw = model.state_dict()
        cached = self._renames.get(model)
        if cached is not None and cached[0] == list(raw):
            return dict(zip(cached[1], raw.values()))
        canonical = get_model_state_dict(model)
        if _same_tensors(raw.values(), canonical.values()):
            self._renames[model] = (list(raw), list(canonical))
        return canonical


_CANONICAL = _CanonicalNames()


def _same_tensors(a: Iterable[Any], b: Iterable[Any]) -> bool:
    """Whether two sequences hold views of the same tensors, in order."""
    a, b = list(a), list(b)
    return len(a) == len(b) and all(_identity(x) == _identity(y) for x, y in zip(a, b))


def _identity(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return id(value)
    local = value.to_local() if hasattr(value, "to_local") else value
    return (local.data_ptr(), tuple(value.shape), value.dtype, type(value))


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """``{id(parameter): canonical name}``, by PyTorch's own FQN rules (DCP's ``_get_fqns``).

    Optimizers hold the parameter objects themselves, so identity is how their state is
    matched to a name; a wrapper tensor (DTensor) has no storage of its own to compare.
    """
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        fqns = _get_fqns(model, name)
        names.setdefault(id(param), next(iter(fqns)) if len(fqns) == 1 else name)
    return names


def stored_to_current(
    saved: Iterable[str], rename: Rename = None, where: str = "", canonical: bool = False
) -> dict[str, str]:
    """``{stored key: current key}`` for every stored key whose name changed.

    Keys are full checkpoint keys (``model.<name>``, ``optimizer.state.<name>.<state>``,
    and their rank-local copies). Wrapper parts are stripped only from checkpoints
    written before keys were canonical (``canonical=False``): in a canonical one a
    ``module.`` is a real submodule's name. The mapping depends on the stored keys
    only, so every rank computes the same one.
    """

    saved = list(saved)
    model_names = [_model_name(k) for k in saved]
    strip_ddp = (
        not canonical
        and all(name is None or name.startswith(_DDP_ROOT) for name in model_names)
        and any(name is not None for name in model_names)
    )
    rename_fn = _rename_fn(rename)
    mapping: dict[str, str] = {}
    legacy = 0
    for key in saved:
        split = split_key(key)
        inner = split[1] if split else key
        renamed = inner if canonical else _map_name(inner, lambda name: _canonical(name, strip_ddp))
        if renamed != inner:
            legacy += 1
        renamed = _map_name(renamed, rename_fn)
        if renamed != inner:
            mapping[key] = stored_key(renamed, split[0]) if split else renamed
    if legacy and comm.rank() == 0:
        log.info(
            "%s: %d key(s) carry wrapper prefixes (module., _orig_mod., ...) from before keys were canonical; "
            "mapped onto the model's own names",
            where or "checkpoint",
            legacy,
        )
    return mapping


def translate(mapping: Mapping[str, str], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with its keys renamed by ``mapping`` (keys it does not name stay)."""
    return {mapping.get(k, k): v for k, v in values.items()}


def _model_name(key: str) -> str | None:
    return key[len("model.") :] if key.startswith("model.") else None


def _map_name(key: str, fn: Callable[[str], str]) -> str:
    """Apply ``fn`` to the parameter name inside a model or optimizer key."""
    if key.startswith("model."):
        return "model." + fn(key[len("model.") :])
    if key.startswith("optimizer.state."):
        param, _, state = key[len("optimizer.state.") :].rpartition(".")
        return f"optimizer.state.{fn(param)}.{state}" if param else key
    return key


def _canonical(name: str, strip_ddp: bool) -> str:
    if strip_ddp and name.startswith(_DDP_ROOT):
        name = name[len(_DDP_ROOT) :]
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _rename_fn(rename: Rename) -> Callable[[str], str]:
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    table = dict(rename)
    return lambda name: table.get(name, name)


def _is_fsdp1(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(model, FullyShardedDataParallel)
