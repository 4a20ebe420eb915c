"""Capture and restore every random stream a training step depends on.

Bit-identical resume needs Python's ``random``, NumPy's global generator, torch's
CPU generator, the CUDA generator of this rank's device and any extra generators the
trainer owns (Megatron's model-parallel RNG tracker). The result holds only tensors,
ints, floats and tuples, so it round-trips through ``torch.load(weights_only=True)``.

Only the *current* device's CUDA state is kept, as Megatron does: each rank owns one
GPU, and the states of every visible GPU (``get_rng_state_all``) make a resume with
another number of visible GPUs fail after the weights loaded (fewer) or restore
only ``cuda:0`` (more), silently losing the other ranks' dropout streams.
Checkpoints written with one state per visible device are still read: the entry of
the current device is restored when it exists.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from shardpoint.errors import CheckpointError

__all__ = ["capture", "restore"]

log = logging.getLogger(__name__)


class _CudaRng:
    """The CUDA generator calls rng needs; tests pass a stand-in with another device count."""

    is_available = staticmethod(lambda: torch.cuda.is_available() and torch.cuda.is_initialized())
    current_device = staticmethod(lambda: torch.cuda.current_device())
    get_rng_state = staticmethod(lambda: torch.cuda.get_rng_state())
    set_rng_state = staticmethod(lambda state: torch.cuda.set_rng_state(state))


CUDA = _CudaRng()


def capture(generators: Mapping[str, torch.Generator] | None = None, cuda: Any = CUDA) -> dict[str, Any]:
    """The state of all global random streams plus the named ``generators``."""
    legacy = np.random.get_state()
    if not isinstance(legacy, tuple):  # a dict: np.random.set_bit_generator replaced the global MT19937
        raise CheckpointError(
            f"numpy's global random state uses {legacy.get('bit_generator')}, not MT19937, so it cannot be saved "
            "with the other random streams; keep numpy's default bit generator (MT19937) for the global stream"
        )
    name, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "generators": {k: g.get_state() for k, g in (generators or {}).items()},
    }
    if cuda.is_available():
        state["cuda"] = cuda.get_rng_state()  # this rank's device only
    return state


def restore(
    state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None, cuda: Any = CUDA
) -> None:
    """Put back what :func:`capture` returned; generators missing on either side are left alone."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["name"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and cuda.is_available():
        _restore_cuda(state["cuda"], cuda)
    for key, generator in (generators or {}).items():
        if key in state.get("generators", {}):
            generator.set_state(state["generators"][key])


def _restore_cuda(saved: Any, cuda: Any) -> None:
    if isinstance(saved, torch.Tensor):
        cuda.set_rng_state(saved)
        return
    device = cuda.current_device()  # an older checkpoint: one state per device visible at the save
    if device < len(saved):
        cuda.set_rng_state(saved[device])
    else:
        log.warning(
            "the checkpoint holds CUDA RNG states of %d device(s), none for current device %d; its stream starts anew",
            len(saved),
            device,
        )
