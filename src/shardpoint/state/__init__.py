"""Layer 3, state: how training state becomes flat, global keys and back.

:mod:`~shardpoint.state.train_state` (``TrainState``, collect and restore),
:mod:`~shardpoint.state.naming` (canonical keys whatever wraps the model),
:mod:`~shardpoint.state.sharding` (``Shard`` and the tensor-parallel helpers),
:mod:`~shardpoint.state.rank_local` (values that belong to one rank),
:mod:`~shardpoint.state.replicas` (declared replicas checked equal) and
:mod:`~shardpoint.state.rng` (random number generators). No file is touched here.

May import: :mod:`shardpoint.errors`, :mod:`shardpoint.parallel`.
"""
