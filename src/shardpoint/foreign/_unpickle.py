"""Reading (and writing back) the pickles of Megatron-LM and DeepSpeed without running their code.

Their checkpoints are ``torch.save`` files whose pickles name classes of those
projects (``argparse.Namespace`` of args, Megatron's enums, DeepSpeed's loss scaler,
numpy RNG state). Neither project needs to be installed to read them here, and no
class of theirs is ever imported: each allowed name is mapped to an inert stand-in
(:class:`ForeignEnum`, :class:`ForeignObject`, :class:`ForeignFunction`) that only
records the data the pickle hands it.

Two doors, as in :mod:`shardpoint.storage.safe_io`:

1. :func:`torch.serialization.get_unsafe_globals_in_checkpoint` lists every global a
   file names, *without unpickling it*; any name outside :data:`ALLOWED` raises
   :class:`~shardpoint.errors.UnsafeCheckpointError` naming the class before a single
   object is built.
2. The file is then read by ``torch.load(weights_only=True)`` (PyTorch's own hardened
   unpickler) with the allow-list added through ``torch.serialization.safe_globals``.

``torch.serialization.safe_globals`` changes a process-wide list while it is active,
so loads are serialised by a lock; the stand-ins it adds are inert, so another thread
loading meanwhile could at most build one of them.

Writing: :func:`save_foreign` pickles stand-ins back under their original names
(``megatron.core.transformer.enums.AttnBackend(5)``), so Megatron-LM reads an exported
``args`` exactly as it wrote it.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import io
import logging
import os
import pickle
import signal
import struct
import threading
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shardpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from shardpoint.storage.safe_io import RestrictedUnpickler, load_dcp_metadata

__all__ = [
    "ALLOWED",
    "PICKLE_DAMAGE",
    "ForeignEnum",
    "ForeignFunction",
    "ForeignObject",
    "GlobalName",
    "load_dcp_metadata_foreign",
    "load_foreign",
    "save_foreign",
]

log = logging.getLogger(__name__)
# numpy 2 moved numpy.core to numpy._core; the package supports numpy >= 1.24
_np_multiarray = importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray")


class GlobalName:
    """A reference to ``module.name`` that :func:`save_foreign` writes as a pickle GLOBAL (never imported)."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # pickle insists on a callable; never called
        raise TypeError(f"{self} is a name for pickling only")

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


class ForeignEnum:
    """A member of an enum of another project, as ``(class name, value)``; compares equal to its value."""

    qualname = "?"  # set per enum class by _enum

    def __init__(self, value: Any):
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        module, _, name = self.qualname.rpartition(".")
        return GlobalName(module, name), (self.value,)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ForeignEnum) and (self.qualname, self.value) == (other.qualname, other.value)

    def __hash__(self) -> int:
        return hash((self.qualname, self.value))

    def __repr__(self) -> str:
        return f"{self.qualname}({self.value!r})"


class ForeignObject:
    """An instance of a small class of another project: its attributes, nothing else.

    Built by the unpickler's NEWOBJ (``__new__``), then BUILD (``__setstate__``).
    """

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k not in ("args", "kwargs")}
        return f"{self.qualname}({fields})"


class ForeignFunction:
    """A function named in args (an activation); recorded by name, never called."""

    qualname = "?"

    def __init__(self, *args: Any) -> None:
        raise UnsafeCheckpointError(f"a checkpoint asks to call {self.qualname}; refusing")


def _stand_in(base: type, qualname: str) -> type:
    return type(qualname.rpartition(".")[2], (base,), {"qualname": qualname, "__module__": __name__})


# Megatron-LM stores these enums in ``args`` (argparse ``type=`` converters and
# TransformerConfig fields copied into args); the stand-in keeps the value only.
_MEGATRON_ENUMS = [
    f"megatron.core.transformer.enums.{name}"
    for name in ("ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend", "CudaGraphScope")
] + [
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
    "megatron.core.dist_checkpointing.validation.StrictHandling",
    "megatron.model.enums.ModelType",  # Megatron-LM before megatron.core (2022-2023 checkpoints)
    "megatron.model.enums.AttnMaskType",
    "megatron.model.enums.PositionEmbeddingType",
]
# DeepSpeed's ZeRO optimizer state: the stage enum, the static/dynamic loss scaler
# (attributes cur_scale, dynamic, ...), and the fragment address of each parameter in
# a flat partition (numel, start).
_DEEPSPEED_ENUMS = [
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
]
_DEEPSPEED_OBJECTS = [
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
]
# Activation functions Megatron-LM may keep in args; recorded by name, never called.
_FUNCTIONS = [
    "torch.nn.functional.gelu",
    "torch.nn.functional.silu",
    "torch.nn.functional.relu",
    "megatron.core.activations.squared_relu",
    "megatron.core.fusions.fused_bias_geglu.quick_gelu",
]

STAND_INS: dict[str, type] = {
    **{name: _stand_in(ForeignEnum, name) for name in _MEGATRON_ENUMS + _DEEPSPEED_ENUMS},
    **{name: _stand_in(ForeignObject, name) for name in _DEEPSPEED_OBJECTS},
    **{name: _stand_in(ForeignFunction, name) for name in _FUNCTIONS},
}

_NUMPY_DTYPES = {type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG"}
# Real classes and functions whose use by the unpickler cannot run anything else:
_REAL: dict[str, Any] = {
    # Megatron's args: NEWOBJ then a dict update of attributes.
    "argparse.Namespace": argparse.Namespace,
    # args.exit_signal: Signals(15) only looks the member up.
    "signal.Signals": signal.Signals,
    # numpy RNG state ("np_rng_state": ('MT19937', uint32 array, ...)) in Megatron's
    # rng_state and DeepSpeed's model states: builds an array from raw bytes; its
    # dtype classes are needed for the dtype's own BUILD step.
    "numpy._core.multiarray._reconstruct": _np_multiarray._reconstruct,
    "numpy.core.multiarray._reconstruct": _np_multiarray._reconstruct,  # numpy < 2 writes this name
    "numpy._core.multiarray.scalar": _np_multiarray.scalar,  # numpy scalars (a float in args)
    "numpy.core.multiarray.scalar": _np_multiarray.scalar,
    "numpy.ndarray": np.ndarray,
    "numpy.dtype": np.dtype,
    **{f"{cls.__module__}.{cls.__name__}": cls for cls in _NUMPY_DTYPES},
}
ALLOWED: dict[str, Any] = {**_REAL, **STAND_INS}
"""Every global a foreign file may name beyond what ``torch.load(weights_only=True)`` allows."""

_SAFE_GLOBALS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [(o, n) for n, o in ALLOWED.items()]
_LOCK = threading.Lock()


# What the pickle machine and torch's zip reader raise on damaged bytes (a flipped opcode
# gives UnpicklingError, a bad memo index KeyError or IndexError, a cut stream EOFError,
# a bad length struct.error or OverflowError): each means "damaged", not a bug of ours.
PICKLE_DAMAGE: tuple[type[BaseException], ...] = (
    pickle.UnpicklingError,
    ValueError,
    RuntimeError,
    zipfile.BadZipFile,
    EOFError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    OverflowError,
    struct.error,
    MemoryError,
)
_READ_DAMAGE: tuple[type[BaseException], ...] = (*PICKLE_DAMAGE, OSError)  # or the file could not be read


def load_foreign(source: str | os.PathLike[str] | bytes, name: str | None = None) -> Any:
    """Read a Megatron-LM / DeepSpeed ``torch.save`` file (a path or its bytes) without running code.

    Raises:
        UnsafeCheckpointError: the file names a class or function outside :data:`ALLOWED`.
        CorruptCheckpointError: the file is not a readable ``torch.save`` archive.
    """
    where = name or (str(source) if not isinstance(source, bytes) else "<bytes>")
    opened: Any = io.BytesIO(source) if isinstance(source, bytes) else source
    with _LOCK, torch.serialization.safe_globals(_SAFE_GLOBALS):
        try:
            unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(opened))
        except PICKLE_DAMAGE as exc:
            raise CorruptCheckpointError(f"{where} is not a readable torch.save file ({_last_line(exc)})") from None
        if unsafe:
            raise UnsafeCheckpointError(
                f"{where} asks to load {', '.join(unsafe)}, which shardpoint never builds from a checkpoint "
                "(the file may have been crafted to run code); refusing to read it. If the class is harmless "
                "data from Megatron-LM or DeepSpeed, report it so it can be allowed with a stand-in."
            )
        if isinstance(opened, io.BytesIO):
            opened.seek(0)
        try:
            loaded = torch.load(opened, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(f"{where}: refused by the weights-only unpickler ({_last_line(exc)})") from None
        except _READ_DAMAGE as exc:
            raise CorruptCheckpointError(f"{where} cannot be read ({_last_line(exc)}); the file is damaged") from None
    return _as_stand_ins(loaded) if _real_classes_registered() else loaded


def _real_classes_registered() -> bool:
    """Whether this process registered a real class under one of our stand-ins' names.

    megatron-core, once imported, registers its own ``AttnBackend`` and ``ModelType`` with
    torch's safe globals. torch keeps the registry as a set, so which of two entries for
    one name the unpickler uses is chance: without this, a read would give Megatron's enum
    in one process and our stand-in in another, and writing it back would differ.
    """
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        if name in STAND_INS and obj is not STAND_INS[name]:
            return True
    return False


def _as_stand_ins(obj: Any) -> Any:
    """``obj`` with every member of a registered real enum replaced by its stand-in (tensors untouched)."""
    if isinstance(obj, enum.Enum):
        stand_in = STAND_INS.get(f"{type(obj).__module__}.{type(obj).__qualname__}")
        return stand_in(obj.value) if stand_in is not None else obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _as_stand_ins(value)
    elif isinstance(obj, argparse.Namespace):
        for key, value in vars(obj).items():
            setattr(obj, key, _as_stand_ins(value))
    elif isinstance(obj, list):
        obj[:] = [_as_stand_ins(v) for v in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_as_stand_ins(v) for v in obj)
    return obj


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Can only build" in line or "unrecognized" in line:
            return line.strip()[:300]
    return (lines or [type(exc).__name__])[0][:300]


# DCP's metadata as megatron-core writes it: besides the metadata classes shardpoint's
# own reader allows, it caches the save plan (plain dataclasses and an enum of DCP).
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
_EXTRA_DCP = {(_DCP_PLANNER, n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}


class _TorchDistMetadataUnpickler(RestrictedUnpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _EXTRA_DCP:
            return pickle.Unpickler.find_class(self, module, name)
        return super().find_class(module, name)


def load_dcp_metadata_foreign(data: bytes, where: str) -> Any:
    """Unpickle a megatron-core ``torch_dist`` ``.metadata`` with the restricted unpickler."""
    return load_dcp_metadata(data, where, _TorchDistMetadataUnpickler)


# the pure-Python pickler, whose internals driven below (write, memo, memoize, save) typeshed does not describe
_PurePickler: Any = pickle._Pickler


class _ForeignPickler(_PurePickler):
    """Pickles :class:`GlobalName` as a GLOBAL opcode, so stand-ins go back under their own names."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, GlobalName):
            self.write(pickle.GLOBAL + obj.module.encode() + b"\n" + obj.name.encode() + b"\n")
            return
        if isinstance(obj, ForeignObject) and id(obj) not in self.memo:
            # as pickle writes any instance: NEWOBJ of the class, then BUILD with its attributes
            module, _, name = obj.qualname.rpartition(".")
            self.write(pickle.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n")
            self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
            self.memoize(obj)
            super().save({k: v for k, v in obj.__dict__.items() if k not in ("args", "kwargs")})
            self.write(pickle.BUILD)
            return
        if isinstance(obj, type) and issubclass(obj, (ForeignEnum, ForeignObject, ForeignFunction)):
            module, _, name = obj.qualname.rpartition(".")  # a stand-in class itself (a function in args)
            self.write(pickle.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n")
            return
        super().save(obj, save_persistent_id)


class _ForeignPickleModule:
    Pickler = _ForeignPickler
    Unpickler = pickle.Unpickler
    __name__ = "shardpoint.foreign._unpickle"


def save_foreign(obj: Any, path: str | os.PathLike[str] | io.BytesIO) -> None:
    """``torch.save`` that writes stand-ins (enums, objects) back under their original class names."""
    torch.save(obj, path, pickle_module=_ForeignPickleModule)
