"""shardpoint: checkpoints for model-parallel PyTorch training.

Save at one tensor/pipeline/data-parallel layout, resume at another; never lose the
latest checkpoint to a crash mid-save; detect damaged files; never run code from a
checkpoint. See ``Checkpointer`` to start.

The public names load on first use (PEP 562), so ``import shardpoint`` and
``shardpoint --help`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardpoint._version import __version__

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from shardpoint.checkpointer import Checkpointer, LoadResult
    from shardpoint.errors import (
        CheckpointError,
        CheckpointNotFoundError,
        CheckpointTimeoutError,
        ConcurrentSaveError,
        ConfigMismatchError,
        CorruptCheckpointError,
        MissingKeysError,
        NotACheckpointError,
        ReplicaMismatchError,
        ShapeMismatchError,
        ShardingError,
        StorageError,
        TopologyMismatchError,
        UnsafeCheckpointError,
        ValidationError,
    )
    from shardpoint.formats.hf_weights import load_hf_weights, save_hf_weights
    from shardpoint.lifecycle.node_local import NodeLocalError, PartialCheckpointError
    from shardpoint.lifecycle.policy import BestN, EveryNMinutes, EveryNSteps, KeepEvery, LatestN
    from shardpoint.parallel.topology import Topology
    from shardpoint.state.sharding import (
        RankLocal,
        Shard,
        column_parallel,
        divide,
        expert_column_parallel,
        expert_row_parallel,
        global_expert,
        grouped_experts,
        row_parallel,
        shard_along,
        vocab_parallel,
    )
    from shardpoint.state.train_state import TrainState
    from shardpoint.storage.base import ForeignDataError

# public name -> the module that defines it
_EXPORTS = {
    "Checkpointer": "shardpoint.checkpointer",
    "LoadResult": "shardpoint.checkpointer",
    "CheckpointError": "shardpoint.errors",
    "CheckpointNotFoundError": "shardpoint.errors",
    "CheckpointTimeoutError": "shardpoint.errors",
    "ConcurrentSaveError": "shardpoint.errors",
    "ConfigMismatchError": "shardpoint.errors",
    "CorruptCheckpointError": "shardpoint.errors",
    "MissingKeysError": "shardpoint.errors",
    "NotACheckpointError": "shardpoint.errors",
    "ReplicaMismatchError": "shardpoint.errors",
    "ShapeMismatchError": "shardpoint.errors",
    "ShardingError": "shardpoint.errors",
    "StorageError": "shardpoint.errors",
    "TopologyMismatchError": "shardpoint.errors",
    "UnsafeCheckpointError": "shardpoint.errors",
    "ValidationError": "shardpoint.errors",
    "load_hf_weights": "shardpoint.formats.hf_weights",
    "save_hf_weights": "shardpoint.formats.hf_weights",
    "NodeLocalError": "shardpoint.lifecycle.node_local",
    "PartialCheckpointError": "shardpoint.lifecycle.node_local",
    "BestN": "shardpoint.lifecycle.policy",
    "EveryNMinutes": "shardpoint.lifecycle.policy",
    "EveryNSteps": "shardpoint.lifecycle.policy",
    "KeepEvery": "shardpoint.lifecycle.policy",
    "LatestN": "shardpoint.lifecycle.policy",
    "Topology": "shardpoint.parallel.topology",
    "ForeignDataError": "shardpoint.storage.base",
    "RankLocal": "shardpoint.state.sharding",
    "Shard": "shardpoint.state.sharding",
    "column_parallel": "shardpoint.state.sharding",
    "divide": "shardpoint.state.sharding",
    "expert_column_parallel": "shardpoint.state.sharding",
    "expert_row_parallel": "shardpoint.state.sharding",
    "global_expert": "shardpoint.state.sharding",
    "grouped_experts": "shardpoint.state.sharding",
    "row_parallel": "shardpoint.state.sharding",
    "shard_along": "shardpoint.state.sharding",
    "vocab_parallel": "shardpoint.state.sharding",
    "TrainState": "shardpoint.state.train_state",
}

__all__ = [
    "BestN",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "Checkpointer",
    "ConcurrentSaveError",
    "ConfigMismatchError",
    "CorruptCheckpointError",
    "EveryNMinutes",
    "EveryNSteps",
    "ForeignDataError",
    "KeepEvery",
    "LatestN",
    "LoadResult",
    "MissingKeysError",
    "NodeLocalError",
    "NotACheckpointError",
    "PartialCheckpointError",
    "RankLocal",
    "ReplicaMismatchError",
    "ShapeMismatchError",
    "Shard",
    "ShardingError",
    "StorageError",
    "Topology",
    "TopologyMismatchError",
    "TrainState",
    "UnsafeCheckpointError",
    "ValidationError",
    "__version__",
    "column_parallel",
    "divide",
    "expert_column_parallel",
    "expert_row_parallel",
    "global_expert",
    "grouped_experts",
    "load_hf_weights",
    "row_parallel",
    "save_hf_weights",
    "shard_along",
    "vocab_parallel",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first used (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (``shardpoint.checkpointer``), as the eager imports used to bind
        try:
            return importlib.import_module(f"shardpoint.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"shardpoint.{name}":
                raise
            raise AttributeError(f"module 'shardpoint' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
