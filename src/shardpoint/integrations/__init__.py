"""Entry points for the frameworks people already train with.

Each submodule imports its framework, so ``import shardpoint`` never needs one and
this package imports none of them:

* :mod:`shardpoint.integrations.transformers`: ``ShardpointTrainer``, the Hugging Face
  ``Trainer`` with shardpoint checkpoints;
* :mod:`shardpoint.integrations.accelerate`: ``save_state`` / ``load_state`` for an
  ``accelerate.Accelerator``;
* :mod:`shardpoint.integrations.lightning` and :mod:`shardpoint.integrations.torchtitan`.

This layer sits above the public API and may use any lower layer; nothing below imports it.
"""
