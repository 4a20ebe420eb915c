"""Save and stop when the job is preempted: SIGTERM recorded, agreed at a step boundary, saved, then exit.

DeepSpeed and GPT-NeoX have no exit-signal handler (Megatron's ``--exit-signal-handler``
is the model): a scheduler's SIGTERM kills the job mid-step and the work since the last
save is lost. :class:`SaveOnPreemption` records the signal instead of dying of it; the
handler does nothing else, since it may run in the middle of a collective. At each step
boundary every rank calls :meth:`SaveOnPreemption.check`: the ranks gather their flags
(one small round on shardpoint's own gloo group, never on the trainer's groups), so a
signal that reached one rank first stops every rank at the same step. Then every rank
saves that step, in engine mode (``engine.save_checkpoint``, the tag committed before
``check`` returns, async or not) or in the reshardable mode, and ``check`` returns True::

    with SaveOnPreemption(engine, args.save, client_state=lambda: {"iteration": step}) as preemption:
        for step in range(start, args.train_iters):
            train_step()
            if preemption.check():
                break       # saved and committed: exit, and the restart resumes from it
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from shardpoint.parallel import comm

__all__ = ["SaveOnPreemption"]

log = logging.getLogger(__name__)


class SaveOnPreemption:
    """Within a ``with`` block, a signal (SIGTERM by default) makes the next :meth:`check` save and return True.

    Args:
        engine: the DeepSpeed engine.
        save_dir: where the save goes (tag ``global_step<N>``, DeepSpeed's default).
        client_state: the ``client_state`` to save, or a callable returning it (called at the save).
        reshardable: save with :func:`~shardpoint.integrations.deepspeed.save_checkpoint` (the
            reshardable mode) instead of ``engine.save_checkpoint`` (DeepSpeed's own, or
            engine mode after :func:`~shardpoint.integrations.deepspeed.use`).
        signum: the signal to handle.
    """

    def __init__(
        self,
        engine: Any,
        save_dir: str,
        *,
        client_state: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
        reshardable: bool = False,
        signum: int = signal.SIGTERM,
    ):
        self.engine = engine
        self.save_dir = str(save_dir)
        self.client_state = client_state
        self.reshardable = reshardable
        self.signum = signum
        self.received = False
        self.saved = False
        self._previous: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True  # only recorded: the process group may be in the middle of a collective

    def __enter__(self) -> SaveOnPreemption:
        self._previous = signal.signal(self.signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(self.signum, self._previous)

    def check(self) -> bool:
        """Every rank, at the same step boundary: if any rank was signalled, save this step, committed; then True."""
        if not any(comm.all_gather(self.received, what="asking whether any rank was preempted")):
            return False
        log.info("preempted (%s): saving step %s to %s", signal.Signals(self.signum).name, self._step(), self.save_dir)
        state = self.client_state() if callable(self.client_state) else self.client_state
        state = dict(state or {})
        if self.reshardable:
            from shardpoint.integrations.deepspeed.reshard import save_checkpoint

            save_checkpoint(self.engine, self.save_dir, client_state=state)
        else:
            self.engine.save_checkpoint(self.save_dir, client_state=state)
            wait = getattr(self.engine.checkpoint_engine, "wait", None)
            if callable(wait):
                wait()  # engine mode with async_save or upload_to: committed (and uploaded) before the exit
        self.saved = True
        return True

    def _step(self) -> int:
        return int(getattr(self.engine, "global_steps", 0))
