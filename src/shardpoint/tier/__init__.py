"""Layer 6, tier: the non-persistent local tier with peer replicas (``Checkpointer(local_dir=...)``).

Every ``local_interval`` steps each rank snapshots its state into host memory (the
stall of ``async_save``), writes it into its node's ``local_dir`` and copies it over
shardpoint's own gloo group to ``local_replicas`` ranks on other nodes, in the
background; a load takes the newest iteration complete across all ranks from any
tier: a rank's own node, a peer's replica, or the persistent store.

Modules: which ranks hold whose replicas (:mod:`~shardpoint.tier.placement`, pure),
what a ``local_dir`` holds and how a copy is committed (:mod:`~shardpoint.tier.marker`),
the per-rank file (:mod:`~shardpoint.tier.snapshot`), a save from snapshot to commit
(:mod:`~shardpoint.tier.local_save`), moving files between ranks
(:mod:`~shardpoint.tier.replicate`), ``local_keep`` (:mod:`~shardpoint.tier.retention`),
the collective choice at load (:mod:`~shardpoint.tier.choose`), fetching from peers
(:mod:`~shardpoint.tier.fetch`) and the facade the Checkpointer drives
(:mod:`~shardpoint.tier.local_tier`).

May import every layer below: errors, parallel, storage, catalog, state, formats,
lifecycle. Only :mod:`shardpoint.checkpointer` and the tools above it import this layer.
"""

from shardpoint.tier.local_tier import LocalTier, LocalTierOptions

__all__ = ["LocalTier", "LocalTierOptions"]
