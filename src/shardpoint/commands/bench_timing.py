"""How ``shardpoint bench`` times a collective step: every rank starts together, the slowest counts."""

from __future__ import annotations

import contextlib
import gc
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PeakMemory", "peak_memory", "slowest", "timed", "traced_peak"]


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes on this rank, between two barriers (so the job's slowest rank decides)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def slowest(value: float) -> float:
    """The largest ``value`` over all ranks (for times measured inside a step, such as a stall)."""
    box = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box)


class PeakMemory:
    """What :func:`peak_memory` found: the process's resident bytes at most above what it held at the start."""

    extra: int = 0


@contextlib.contextmanager
def peak_memory() -> Iterator[PeakMemory]:
    """The peak extra resident memory of the block, from Linux's high-water mark (reset first; no tracing cost).

    ``extra`` stays 0 where ``/proc/self/clear_refs`` cannot be written (not Linux).
    """
    found = PeakMemory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark back to the current size
        before = _status("VmRSS")
    except OSError:
        yield found
        return
    yield found
    found.extra = max(0, _status("VmHWM") - before)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def traced_peak(work: Any) -> int:
    """The peak bytes Python and numpy allocate while ``work()`` runs, what it returns included (tracemalloc).

    Not the resident high-water mark (:func:`~shardpoint.commands.bench_timing.peak_memory`):
    a planner's small objects fill memory the process already holds, which that does not see.
    """
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        kept = work()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del kept
    return peak
