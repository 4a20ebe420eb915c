"""shardpoint: checkpoints for model-parallel PyTorch training.

Save at one tensor/pipeline/data-parallel layout, resume at another; never lose the
latest checkpoint to a crash mid-save; detect damaged files; never run code from a
checkpoint. See ``Checkpointer`` to start.
"""

from shardpoint._version import __version__
from shardpoint.checkpointer import Checkpointer, LoadResult
from shardpoint.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    ConcurrentSaveError,
    ConfigMismatchError,
    CorruptCheckpointError,
    MissingKeysError,
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

__all__ = [
    "BestN",
    "CheckpointError",
    "CheckpointTimeoutError",
    "Checkpointer",
    "ConcurrentSaveError",
    "ConfigMismatchError",
    "CorruptCheckpointError",
    "EveryNMinutes",
    "EveryNSteps",
    "KeepEvery",
    "LatestN",
    "LoadResult",
    "MissingKeysError",
    "NodeLocalError",
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
