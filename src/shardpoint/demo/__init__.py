"""A Megatron-style GPT trained with real tensor, pipeline and data parallelism.

Used by ``shardpoint demo`` and by the tests as the most realistic workload. One
concept per module:

* :mod:`~shardpoint.demo.parallel`: process groups (tp, dp, pp, embedding) and device;
* :mod:`~shardpoint.demo.tensor_parallel`, :mod:`~shardpoint.demo.cross_entropy`:
  Megatron's tensor-parallel layers and vocabulary-parallel loss;
* :mod:`~shardpoint.demo.rng_tracker`: the dropout streams (shared vs per tp rank);
* :mod:`~shardpoint.demo.model`: the GPT-2 stage with global checkpoint keys;
* :mod:`~shardpoint.demo.pipeline`: the GPipe schedule over send / recv;
* :mod:`~shardpoint.demo.data`: the byte-level corpus and resumable sample stream;
* :mod:`~shardpoint.demo.optim`: the ZeRO-1 ``DistributedAdamW``;
* :mod:`~shardpoint.demo.preemption`, :mod:`~shardpoint.demo.validation`: SIGTERM
  handling and GPT-NeoX's forward-pass validation;
* :mod:`~shardpoint.demo.trainer`: the training loop around a ``shardpoint.Checkpointer``;
* :mod:`~shardpoint.demo.procs`, :mod:`~shardpoint.demo.launch`,
  :mod:`~shardpoint.demo.report`: ``shardpoint demo`` (local ranks, phases, table, plot);
* :mod:`~shardpoint.demo.hf`: export to / import from Hugging Face ``GPT2LMHeadModel``.

Nothing is imported here, so ``import shardpoint`` stays light.
"""

__all__: list[str] = []
