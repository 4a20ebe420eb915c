"""How the ``dist`` format writes a save: plans decided on each rank, ``.metadata`` from compact records.

``dcp.save`` plans centrally: every rank's local plan goes to rank 0, which
deduplicates the replicated boxes, validates the whole and scatters the plans back,
then gathers every item's storage record to build and pickle ``.metadata``. At 4096
ranks × 300 tensors that is tens of seconds and hundreds of MB on rank 0, at the first
save and after every change of structure. shardpoint needs none of it:

* **who writes a replicated box** is already decided on every rank, identically, from
  the boxes the save's start round gathers for the replica check
  (:attr:`~shardpoint.state.replicas.ReplicaReport.written_elsewhere`);
* **validation** is the coverage check of the same round (:mod:`shardpoint.state.coverage`):
  the boxes tile every tensor exactly once;
* **file names** are per rank (``__<rank>_<n>.distcp``, DCP's own naming).

So each rank writes its own plan with DCP's writer and sends rank 0 its
:class:`~shardpoint.formats.metadata_records.RankRecords` in the commit round the save
makes anyway; rank 0 writes ``.metadata`` from them
(:func:`~shardpoint.formats.metadata_records.assemble`), the same ``Metadata`` that
``dcp.save`` writes, read by plain ``dcp.load``. A save of an unchanged structure
replays the cached plan (:mod:`shardpoint.formats.dist_replay`).

Saves without a replica verdict (node-local saves, which plan per node) still run
``dcp.save``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StoragePrefix  # DCP's per-rank file prefix
from torch.distributed.checkpoint.planner import SavePlan

from shardpoint.formats.base import FormatContext
from shardpoint.formats.dist_replay import SavePlanCache, write_metadata, write_with_plan
from shardpoint.formats.metadata_records import RankRecords, assemble, encode
from shardpoint.parallel import comm

__all__ = ["finish", "local_plan", "save_with_dcp", "write"]


def write(
    ctx: FormatContext, writer: Any, planner: Any, state_dict: dict[str, Any], fingerprint: Callable[[], str | None]
) -> None:
    """Every rank: write this rank's items by the cheapest path its save allows (see the module docstring).

    ``fingerprint`` is called only by a planned save, for the cache: a replay compared it already.
    """
    rank, cache = comm.rank(), ctx.plan_cache
    if cache is not None and cache.replay:  # the same structure as the last save: no planning
        results = write_with_plan(writer, planner, state_dict, cache.plan, rank)
        if results != cache.results:
            ctx.for_coordinator = encode(cache.plan.items, results)
            cache.captured["results"] = results
        return
    if cache is None or ctx.replicas is None:
        if cache is not None:
            cache.clear()  # nothing to replay from a save planned by DCP
        save_with_dcp(ctx, writer, planner, state_dict)
        return
    plan = local_plan(planner, ctx.replicas.written_elsewhere, rank)
    results = write_with_plan(writer, planner, state_dict, plan, rank)
    ctx.for_coordinator = encode(plan.items, results)
    cache.captured.update(fingerprint=fingerprint(), plan=plan, results=results)


def save_with_dcp(ctx: FormatContext, writer: Any, planner: Any, state_dict: dict[str, Any]) -> None:
    """``dcp.save`` with its central planning, on the save's group (the control group unless an async one)."""
    dcp.save(
        state_dict,
        storage_writer=writer,
        planner=planner,
        process_group=ctx.process_group or comm.control_group(),
        no_dist=not comm.initialized(),
    )


def local_plan(planner: Any, written_elsewhere: frozenset, rank: int) -> SavePlan:
    """This rank's final plan: its boxes, less the shared ones another rank writes, in files of its own."""
    items = [
        item
        for item in planner.create_local_plan().items
        if (item.index.fqn, tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes), ())
        not in written_elsewhere
    ]
    return SavePlan(items, storage_data=_StoragePrefix(f"__{rank}_"))


def finish(ctx: FormatContext, writer: Any, parts: list[RankRecords | None]) -> bool:
    """Rank 0: write ``.metadata`` from every rank's records (None: unchanged since the cached save).

    Returns False when ``dcp.save`` wrote it already.
    """
    cache: SavePlanCache | None = ctx.plan_cache
    if cache is None or (not cache.replay and ctx.replicas is None):
        return False
    if cache.replay and all(part is None for part in parts):  # storage records as they were: the same bytes
        assert cache.metadata_chunks is not None
        write_metadata(writer, cache.metadata_chunks)
        return True
    records = [new if new is not None else old for new, old in zip(parts, cache.records or parts)]
    chunks = assemble(records)
    write_metadata(writer, chunks)
    cache.captured.update(records=records, metadata_chunks=chunks)
    return True
