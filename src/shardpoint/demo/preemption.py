"""Leaving training cleanly: on a signal, after a duration, or at an exit interval.

A scheduler preempting a job sends SIGTERM to its processes, perhaps not to all at
the same moment. Megatron's ``--exit-signal-handler`` only records the signal in the
handler; at the next step boundary all ranks all-reduce their flags, so if any rank
was signalled every rank saves the same iteration and exits together. The handler
itself never touches the process group (it may run in the middle of a collective).

``--exit-duration-in-mins`` is decided the same way: each rank's clock may differ, so
the ranks agree with a MAX all-reduce rather than each deciding alone.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ExitSignalHandler", "agree_to_exit"]

log = logging.getLogger(__name__)


class ExitSignalHandler:
    """Record a signal instead of dying of it, while in a ``with`` block.

    Example:
        >>> with ExitSignalHandler() as handler:
        ...     for it in range(start, iters):
        ...         train_step()
        ...         if agree_to_exit(handler.received, ...):
        ...             save_and_break()
    """

    def __init__(self, signum: int = signal.SIGTERM, enabled: bool = True):
        self.signum = signum
        self.enabled = enabled
        self.received = False
        self._previous: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def __enter__(self) -> ExitSignalHandler:
        if self.enabled:
            self._previous = signal.signal(self.signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            signal.signal(self.signum, self._previous)
            if self.received:
                log.info("received %s; training stopped at a step boundary", signal.Signals(self.signum).name)


def agree_to_exit(signalled: bool, started: float, duration_minutes: float | None, device: torch.device) -> str | None:
    """Every rank calls this at the same step boundary; all get the same answer.

    Returns:
        ``"signal"`` if any rank received the exit signal, ``"duration"`` if any rank's
        clock passed ``duration_minutes`` since ``started``, else None.
    """
    over = duration_minutes is not None and (time.time() - started) / 60.0 >= duration_minutes
    flags = torch.tensor([float(signalled), float(over)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0] > 0:
        return "signal"
    if flags[1] > 0:
        return "duration"
    return None
