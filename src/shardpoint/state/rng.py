"""Capture and restore every random stream a training step depends on.

Bit-identical resume needs Python's ``random``, NumPy's global generator, torch's
CPU generator, every CUDA device's generator and any extra generators the trainer
owns (Megatron's model-parallel RNG tracker). The result holds only tensors, ints,
floats and tuples, so it round-trips through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["capture", "restore"]


def capture(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """The state of all global random streams plus the named ``generators``."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
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
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
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
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for key, generator in (generators or {}).items():
        if key in state.get("generators", {}):
            generator.set_state(state["generators"][key])
