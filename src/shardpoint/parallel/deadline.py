"""Deadlines for shardpoint's collective rounds, and the names of the ranks that missed one.

A rank that is alive but stuck (a frozen NFS mount, a debugger, a dead driver) used to
leave every other rank waiting for the control group's 2-hour timeout with no word of
which rank it was. Now every round on the control group waits at most
:func:`round_timeout` (``Checkpointer(round_timeout=...)``, default
:data:`DEFAULT_ROUND_TIMEOUT`): gloo itself aborts the wait (the group's own timeout
is set to the deadline, so nothing polls), and then each rank that arrived learns
which ranks did not from the c10d store that ``init_process_group`` made:

1. it writes the round it was waiting in under its own key, ``shardpoint/late/<rank>``, and
   closes its side of the group, so that ranks waiting on it fail now, not at their deadline;
2. it waits (on the store, server side) up to :data:`GRACE` for every rank's key;
3. the ranks whose key is missing are stuck outside every round: those are named.

The normal path costs nothing: no key is written unless a round failed, so no cost
grows with the job. Rounds are numbered per group by the order its members make them in, which is
the same on every member (each collective is called by every member at the same point).

After a timeout the control group is unusable (gloo's pairs to the stuck rank are
broken): the next collective raises at once, naming the earlier failure; restart the
job (the tracker and every committed checkpoint are untouched by a failed round, and
the temporary directory of the interrupted save is removed at the next start).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardpoint.errors import CheckpointError, CheckpointTimeoutError

__all__ = [
    "DEFAULT_ROUND_TIMEOUT",
    "GRACE",
    "check_usable",
    "group_timeout",
    "round_timeout",
    "rounds",
    "set_round_timeout",
    "watched",
]

log = logging.getLogger(__name__)

#: seconds a round waits for every rank by default: longer than any single rank's step of a save or load
#: (rank 0 verifying a checkpoint while the others wait), short enough to name a stuck rank in minutes
DEFAULT_ROUND_TIMEOUT = float(os.environ.get("SHARDPOINT_ROUND_TIMEOUT", 300))
#: seconds the ranks that timed out wait for each other's arrival keys before naming the missing ones
GRACE = 5.0

_state: dict[str, Any] = {"timeout": DEFAULT_ROUND_TIMEOUT}
# per group (by its name, the same on every member): rounds made so far, and the failure that broke it
_rounds: dict[str, int] = {}
_broken: dict[str, str] = {}
_lock = threading.Lock()  # the async save and the local tier make rounds on their own groups, from their threads


def set_round_timeout(seconds: float | None) -> None:
    """The deadline of every later round, in seconds (None: only the control group's outer bound).

    Process-wide, as the control group is: the last Checkpointer constructed sets it.
    """
    if seconds is not None and seconds <= 0:
        raise ValueError(f"round_timeout must be a positive number of seconds or None, got {seconds}")
    _state["timeout"] = seconds


def round_timeout() -> float | None:
    return _state["timeout"]


def group_timeout(outer: timedelta) -> timedelta:
    """The timeout to give the control group: the round deadline, never beyond ``outer``."""
    seconds = _state["timeout"]
    return outer if seconds is None else min(outer, timedelta(seconds=seconds))


def rounds(group: Any) -> int:
    """Rounds made on ``group`` so far (the same count on every member)."""
    return _rounds.get(group.group_name, 0)


def check_usable(group: Any) -> None:
    """Raise at once if an earlier round of ``group`` timed out (its pairs to the stuck rank are broken)."""
    broken = _broken.get(group.group_name)
    if broken is not None:
        raise CheckpointError(
            f"shardpoint's control group is unusable since an earlier round timed out ({broken}); "
            "restart the job (committed checkpoints and the tracker are intact)"
        )


@contextmanager
def watched(group: Any, what: str) -> Iterator[None]:
    """One round on ``group``: a gloo failure inside becomes a CheckpointTimeoutError naming the late ranks.

    Raises:
        CheckpointTimeoutError: the round did not complete; ``missing`` lists the ranks that never arrived.
    """
    check_usable(group)
    name = group.group_name
    with _lock:
        number = _rounds.get(name, 0)
        _rounds[name] = number + 1
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        missing = _missing_ranks(group, number)
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        late = f"rank(s) {missing} did not arrive" if missing else "the round broke off (every rank arrived)"
        if missing is None:
            late = "the ranks that did not arrive are unknown (the c10d store did not answer)"
        message = (
            f"{what}: {late} within the round deadline of {_deadline_text()} (round {number}); this rank "
            f"(rank {dist.get_rank()}) was {what}. gloo said: {detail}. The tracker and committed checkpoints "
            "are untouched; restart the job (raise Checkpointer(round_timeout=...) if a rank is only slow)"
        )
        _broken[name] = f"round {number}, {what}: {late}"
        raise CheckpointTimeoutError(message, missing or [], what) from None


def _close(group: Any) -> None:
    """Close this rank's side of a group that can no longer be used, so no peer waits on it until its own deadline."""
    try:
        dist.destroy_process_group(group)
    except Exception:
        log.debug("closing a timed-out group", exc_info=True)


def _deadline_text() -> str:
    seconds = _state["timeout"]
    return "the control group's timeout" if seconds is None else f"{seconds:g} s"


def _missing_ranks(group: Any, number: int) -> list[int] | None:
    """The members of ``group`` that are not waiting in any round (None: the store did not answer).

    Each rank that timed out records the round it was waiting in. Ranks need not
    time out in the same round: where a round completed for some (a gather's senders
    move on to the next round while its root still waits for the stuck rank), they
    time out in the next one. Every rank that wrote a key is alive and inside a round;
    the ranks with no key are stuck outside (stopped, or in I/O). A rank that left
    its last round and went back to training would be named too: shardpoint's last
    round of each operation is an all-gather, which no rank leaves early.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        saved = store.timeout  # type: ignore[attr-defined]  # torch has Store.timeout; its stub lacks it
        store.set_timeout(timedelta(seconds=GRACE))  # a store whose host is the stuck rank must not hang us
    except Exception:  # noqa: BLE001 - no store (not made by init_process_group): nothing to name with
        return None
    try:
        prefix = "shardpoint/late/"  # one key per rank, whichever group it timed out in: it is alive
        members = dist.get_process_group_ranks(group)
        store.set(prefix + str(dist.get_rank()), f"{group.group_name}:{number}")
        _close(group)  # the ranks still waiting on this one fail now, and write their keys within the grace
        keys = {r: prefix + str(r) for r in members}
        try:
            store.wait(list(keys.values()), timedelta(seconds=GRACE))
        except (RuntimeError, dist.DistError):
            pass  # some rank never wrote its key: it is missing
        return [r for r in members if not store.check([keys[r]])]
    except Exception:
        log.debug("could not read the arrival keys of round %d", number, exc_info=True)
        return None
    finally:
        store.set_timeout(saved)
