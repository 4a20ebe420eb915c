"""``shardpoint bench`` rows of the local tier (``Checkpointer(local_dir=...)``, :mod:`shardpoint.tier`).

Each bench rank plays a node: its local directory is its own (``tier_node<rank>``),
so every local save replicates each rank's file to another rank over gloo, as on a
cluster with node-local disks. Per round:

- ``local tier stall``: what ``maybe_save`` keeps training waiting (the snapshot into
  host memory), the slowest rank's; compared with ``memory copy`` (target <= 1.5x);
- ``local tier replicate``: the background copy of every rank's file to its peer
  (the rows' GB/s is the job's state replicated per second);
- ``local tier load, own node's copy`` and ``local tier load, from a peer replica``
  (odd ranks' directories wiped first, so they fetch over the process group),
  beside ``shardpoint load`` from the persistent store in the same report.
"""

from __future__ import annotations

import shutil
from typing import Any

import torch
import torch.distributed as dist

from shardpoint.commands.bench_timing import slowest, timed

__all__ = ["tier_rounds"]


def tier_rounds(methods: Any, repeat: int) -> dict[str, list[float]]:
    """One rank's local-tier measurements over ``repeat`` rounds (every rank calls this)."""
    import shardpoint as sp

    topo, state = _sharded(methods)
    local_dir = methods.path(f"tier_node{methods.rank}")
    options = {"topology": topo, "local_dir": local_dir, "local_interval": 1, "local_keep": 1}
    ckpt = sp.Checkpointer(methods.path("tier_persistent"), **options)
    times: dict[str, list[float]] = {}
    for iteration in range(1, repeat + 1):
        ckpt.maybe_save(iteration, state)
        stall = ckpt.local_times.last_stall_seconds
        ckpt.wait()
        times.setdefault("local tier stall", []).append(slowest(stall))
        times.setdefault("local tier replicate", []).append(slowest(ckpt.local_times.last_replicate_seconds))
    ckpt.close()
    for _ in range(repeat):
        times.setdefault("local tier load, own node's copy", []).append(timed(lambda: _load(sp, methods, options)))
        if methods.world > 1:
            if methods.rank % 2:
                shutil.rmtree(local_dir, ignore_errors=True)
            dist.barrier()
            times.setdefault("local tier load, from a peer replica", []).append(
                timed(lambda: _load(sp, methods, options))
            )
    return times


def _sharded(methods: Any) -> tuple[Any, Any]:
    import shardpoint as sp

    topo = sp.Topology(methods.world, 1, 1)
    tensors = methods.state

    class Model(torch.nn.Module):
        def sharded_state_dict(self) -> dict[str, Any]:
            return {k: sp.column_parallel(t, topo) for k, t in tensors.items()}

    return topo, sp.TrainState(Model())


def _load(sp: Any, methods: Any, options: dict[str, Any]) -> None:
    _, state = _sharded(methods)
    ckpt = sp.Checkpointer(methods.path("tier_persistent"), **options)
    ckpt.load(state)
    ckpt.close()
