"""Layer 5, lifecycle: a checkpoint from first byte to deletion.

The save pipeline (:mod:`~shardpoint.lifecycle.save_pipeline`) and its mirror, the load
pipeline (:mod:`~shardpoint.lifecycle.load_pipeline`); the commit protocol
(:mod:`~shardpoint.lifecycle.commit`), finding what to load
(:mod:`~shardpoint.lifecycle.discovery`), when to save and what to keep
(:mod:`~shardpoint.lifecycle.policy`, pure) and the deleting itself
(:mod:`~shardpoint.lifecycle.retention`), background saves
(:mod:`~shardpoint.lifecycle.async_save`), node-local disks with an object store
(:mod:`~shardpoint.lifecycle.node_local`, :mod:`~shardpoint.lifecycle.node_view`,
:mod:`~shardpoint.lifecycle.upload`) and fault injection for the crash tests
(:mod:`~shardpoint.lifecycle.faults`).

May import every layer below: errors, parallel, storage, catalog, state, formats.
Only :mod:`shardpoint.checkpointer` and the tools above it import this layer.
"""
