r"""torchtitan with shardpoint checkpoints: a config module, chosen with --module/--config.

    torchrun --nproc-per-node 8 -m torchtitan.train \
        --module examples.torchtitan_config --config llama3_debugmodel_shardpoint

torchtitan builds the class that owns ``config.checkpoint``, so one line switches the
checkpoint manager; ``like`` keeps the settings of the config it replaces.
"""

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from shardpoint.integrations.torchtitan import ShardpointCheckpointManager


def llama3_debugmodel_shardpoint() -> Trainer.Config:
    config = llama3_debugmodel()
    config.checkpoint = ShardpointCheckpointManager.Config.like(config.checkpoint)
    return config
