"""A Megatron-style GPT trained with real tensor, pipeline and data parallelism.

Used by ``shardpoint demo`` and by the tests as the most realistic workload.
"""
