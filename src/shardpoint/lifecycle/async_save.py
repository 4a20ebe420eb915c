"""Asynchronous saves: the training loop pays for a memory copy, the disk is written behind it.

A save with ``async_save=True`` does three things in the training step:

1. copies every tensor into one host slab that is **reused across saves** (pinned
   memory for GPU tensors; :mod:`shardpoint.lifecycle.staging`). Copying into memory
   that is already mapped costs a fraction of allocating it fresh, where page faults
   dominate (measured here: 1 GiB into a preallocated tensor 0.04 s, a fresh clone 0.27 s);
2. starts a background thread that writes those copies and checksums them;
3. returns.

Commit needs every rank's files to be durable, and waiting for that must never
stall a step. So the next ``maybe_save`` asks all ranks "is your write done?" (one
small collective) and commits only when every rank says yes; ``close()`` waits.
The background DCP save runs its own collectives on a dedicated process group so
they never interleave with the trainer's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardpoint.parallel import devices

__all__ = ["BackgroundWrite"]


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
