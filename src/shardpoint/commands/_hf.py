"""Lazy access to the Hugging Face bridge (``shardpoint.demo.hf``), which is optional.

``convert --from-hf`` and ``export --to hf`` call it; when the module is not part of
this installation they fail with one sentence instead of an ImportError traceback.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from shardpoint.errors import CheckpointError

__all__ = ["hf_function"]

MODULE = "shardpoint.demo.hf"


def hf_function(name: str) -> Callable[..., Any]:
    """``shardpoint.demo.hf.<name>``, or a CheckpointError saying it is not available."""
    try:
        module = importlib.import_module(MODULE)
    except ModuleNotFoundError as exc:
        if exc.name not in (MODULE, "transformers"):
            raise
        if exc.name == "transformers":
            raise CheckpointError(
                "Hugging Face conversion needs the transformers package; install it (pip install transformers)"
            ) from None
        raise CheckpointError(
            f"Hugging Face conversion is not available: this installation of shardpoint has no {MODULE}"
        ) from None
    function = getattr(module, name, None)
    if function is None:
        raise CheckpointError(f"{MODULE} has no {name}(); this installation's Hugging Face bridge is incomplete")
    return function
