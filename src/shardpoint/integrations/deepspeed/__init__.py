"""DeepSpeed's engine (and GPT-NeoX, which saves through it) checkpointing through shardpoint.

Two modes, each one line in a training script:

* **Engine mode**, DeepSpeed's files unchanged: :func:`use` (``use(engine)``) sets
  :class:`ShardpointCheckpointEngine` on an initialised engine, and the script's own
  ``engine.save_checkpoint`` / ``engine.load_checkpoint`` calls stay. The files are
  byte-identical to DeepSpeed's own engine (its loader, ``zero_to_fp32`` and GPT-NeoX
  read them); added are a staged tag renamed into place by a collective commit with
  ``shardpoint.json`` (sizes, checksums), an atomic ``latest``, and checked loads that
  run no code (:mod:`.engine`, :mod:`.files`, :mod:`.unpickle`).
* **Reshardable mode**: :func:`save_checkpoint` / :func:`load_checkpoint` with
  DeepSpeed's arguments and return values, writing shardpoint's ``dist`` format under
  the model's global names (each ZeRO rank's fp32 partition and Adam moments as
  ``sp.Shard`` boxes of the flat parameter space), so a run resumes at another
  data-parallel size and ZeRO stage (:mod:`.reshard`).

A preempted job saves and stops at a step boundary with :class:`SaveOnPreemption`
(:mod:`.preemption`).

DeepSpeed is imported when a name of this package is first used, never by
``import shardpoint``; without it, that use raises
:class:`~shardpoint.errors.FrameworkMissingError` naming ``pip install 'shardpoint[deepspeed]'``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EngineOptions",
    "SaveOnPreemption",
    "ShardpointCheckpointEngine",
    "load_checkpoint",
    "save_checkpoint",
    "use",
]

_WHERE = {
    "EngineOptions": "engine",
    "ShardpointCheckpointEngine": "engine",
    "use": "engine",
    "save_checkpoint": "reshard",
    "load_checkpoint": "reshard",
    "SaveOnPreemption": "preemption",
}


def __getattr__(name: str) -> Any:
    """Import the submodule (and DeepSpeed) on first use of one of its names.

    Raises:
        FrameworkMissingError: DeepSpeed is not installed; the message names the extra.
    """
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    try:
        importlib.import_module("deepspeed")
    except ModuleNotFoundError as exc:
        from shardpoint.integrations import missing_framework

        raise missing_framework(exc, "deepspeed", "deepspeed") from exc
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
