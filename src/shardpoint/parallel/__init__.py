"""Layer 1, parallel: who the ranks are and how they talk.

:mod:`~shardpoint.parallel.topology` names each rank's tensor/pipeline/data-parallel
coordinates and process groups; :mod:`~shardpoint.parallel.comm` holds the collective
helpers (agreement on errors, object broadcasts and gathers) every higher layer uses.

May import: :mod:`shardpoint.errors` only. The layer order lives in one place,
``tests/test_layering.py``, which fails on any import that runs upward.
"""
