"""Asynchronous saves: the training loop pays for a memory copy, the disk is written behind it.

A save with ``async_save=True`` does three things in the training step:

1. copies every tensor into host buffers that are **reused across saves** (pinned
   memory for GPU tensors). Copying into memory that is already mapped costs a
   fraction of allocating it fresh, where page faults dominate (measured here:
   1 GiB into a preallocated tensor 0.04 s, a fresh clone 0.27 s);
2. starts a background thread that writes those copies and checksums them;
3. returns.

Commit needs every rank's files to be durable, and waiting for that must never
stall a step. So the next ``maybe_save`` asks all ranks "is your write done?" (one
small collective) and commits only when every rank says yes; ``close()`` waits.
The background DCP save runs its own collectives on a dedicated process group so
they never interleave with the trainer's.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardpoint.parallel import devices
from shardpoint.state.train_state import FlatState

__all__ = ["BackgroundWrite", "SnapshotBuffers"]

_RANK_LOCAL = "rank_local:"  # buffer names of rank-local tensors, apart from global keys


class SnapshotBuffers:
    """Host buffers, one per tensor key, reused by every snapshot of the same shapes."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def snapshot(self, flat: FlatState) -> FlatState:
        """A copy of ``flat`` that the trainer may change right after this returns."""
        tensors = {key: shard.like(self._copy(key, shard.tensor)) for key, shard in flat.tensors.items()}
        own = {key: self._copy(_RANK_LOCAL + key, t) for key, t in flat.rank_local.items()}
        devices.synchronize([*(s.tensor for s in flat.tensors.values()), *flat.rank_local.values()])
        self._drop_unused({*tensors, *(_RANK_LOCAL + key for key in own)})
        common, per_rank = copy.deepcopy(flat.common), copy.deepcopy(flat.per_rank)
        return FlatState(tensors, common, per_rank, own, set(flat.shared_if_equal))

    def _copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=source.is_cuda)
            self._buffers[key] = buffer
        buffer.copy_(source, non_blocking=source.is_cuda)
        return buffer

    def _drop_unused(self, used: set[str]) -> None:
        for key in set(self._buffers) - used:
            del self._buffers[key]


@dataclass
class BackgroundWrite:
    """One save's write phase running on a thread; its result or error is kept for the commit."""

    work: Callable[[], Any]
    started: float = field(default_factory=time.perf_counter)
    result: Any = None
    error: BaseException | None = None
    finished: float | None = None
    device: torch.device | None = field(default_factory=devices.thread_device)  # the trainer thread's
    _thread: threading.Thread | None = None

    def start(self) -> BackgroundWrite:
        self._thread = threading.Thread(target=self._run, name="shardpoint-async-save", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            devices.bind(self.device)  # before any CUDA work (DCP's loader, pinned copies)
            self.result = self.work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread at the next call
            self.error = exc
        finally:
            self.finished = time.perf_counter()

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    @property
    def seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.started
