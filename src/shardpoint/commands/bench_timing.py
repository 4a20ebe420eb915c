"""How ``shardpoint bench`` times a collective step: every rank starts together, the slowest counts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["slowest", "timed"]


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
