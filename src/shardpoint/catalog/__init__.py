"""Layer 2, catalog: what a checkpoint directory holds and how it is checked.

:mod:`~shardpoint.catalog.layout` names directories and the tracker (Megatron, NeoX),
:mod:`~shardpoint.catalog.metadata` is ``shardpoint.json`` (the commit marker, JSON only),
:mod:`~shardpoint.catalog.integrity` the per-file sizes and checksums it records.

May import: :mod:`shardpoint.errors`, :mod:`shardpoint.storage`.
"""
