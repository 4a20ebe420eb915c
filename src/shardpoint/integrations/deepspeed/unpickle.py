"""Reading DeepSpeed's ``torch.save`` files into a live engine without running code from them.

DeepSpeed's own engine reads them with ``torch.load(weights_only=False)``: a crafted
``mp_rank_00_model_states.pt`` runs anything. Here, as in :mod:`shardpoint.storage.safe_io`,
there are two doors:

1. :func:`torch.serialization.get_unsafe_globals_in_checkpoint` lists every global the
   file names, without unpickling it; a name outside :data:`ALLOWED` raises
   :class:`~shardpoint.errors.UnsafeCheckpointError` before an object is built;
2. ``torch.load(weights_only=True)`` (PyTorch's hardened unpickler) with exactly those
   names added.

Unlike the offline readers (:mod:`shardpoint.foreign`), which build inert stand-ins, the
engine needs DeepSpeed's real classes back (its ZeRO optimizer calls the loss scaler it
loads), so the allowed names resolve to the real, installed classes. Each is data only:
an enum looked up by value, a dataclass or a plain object whose attributes are set.
"""

from __future__ import annotations

import importlib
import pickle
import threading
import zipfile
from typing import Any, BinaryIO

import torch

from shardpoint.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["ALLOWED", "load_restricted"]

#: every global a DeepSpeed / GPT-NeoX checkpoint may name beyond what weights-only loading allows
ALLOWED = (
    # ZeRO's optimizer state: the stage, the offload device, the loss scaler, each parameter's fragment
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    # client_state: GPT-NeoX keeps args and numpy's RNG state there
    "argparse.Namespace",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray.scalar",
    "numpy.core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
)
_NUMPY_DTYPE_CODES = "?bBhHiIlLqQefdgFDG"
_LOCK = threading.Lock()  # torch.serialization.safe_globals changes a process-wide list while active
_RESOLVED: dict[str, Any] = {}


def _resolve() -> dict[str, Any]:
    """``{name: object}`` of :data:`ALLOWED` (and numpy's dtype classes), imported once; absent modules skipped."""
    if _RESOLVED:
        return _RESOLVED
    import numpy as np

    for name in ALLOWED:
        module, _, attr = name.rpartition(".")
        try:
            _RESOLVED[name] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue  # e.g. numpy.core under numpy 2, or DeepSpeed not installed (reshardable mode only)
    for code in _NUMPY_DTYPE_CODES:
        cls = type(np.dtype(code))
        _RESOLVED[f"{cls.__module__}.{cls.__name__}"] = cls
    return _RESOLVED


def load_restricted(source: str | BinaryIO, where: str, map_location: Any = None) -> Any:
    """``torch.load`` of a DeepSpeed file (path or binary file) allowing only :data:`ALLOWED` beyond tensors.

    Raises:
        UnsafeCheckpointError: the file names another class or function (naming it).
        CorruptCheckpointError: the file is not a readable ``torch.save`` archive.
    """
    allowed = _resolve()
    with _LOCK:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
        except (ValueError, RuntimeError, zipfile.BadZipFile, EOFError, KeyError, pickle.UnpicklingError) as exc:
            raise CorruptCheckpointError(f"{where} is not a readable torch.save file ({_first_line(exc)})") from None
        unsafe = sorted(set(names) - set(allowed))
        if unsafe:
            raise UnsafeCheckpointError(
                f"{where} asks to load {', '.join(unsafe)}, which shardpoint never builds from a checkpoint (the "
                "file may have been crafted to run code); refusing to read it. If it is harmless data DeepSpeed "
                "writes, report it so it can be allowed."
            )
        if hasattr(source, "seek"):
            source.seek(0)
        with torch.serialization.safe_globals([(obj, name) for name, obj in allowed.items()]):
            try:
                return torch.load(source, map_location=map_location, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointError(
                    f"{where}: refused by the weights-only unpickler ({_first_line(exc)})"
                ) from None
            except (RuntimeError, zipfile.BadZipFile, EOFError, OSError) as exc:
                raise CorruptCheckpointError(
                    f"{where} cannot be read ({_first_line(exc)}); the file is damaged"
                ) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
