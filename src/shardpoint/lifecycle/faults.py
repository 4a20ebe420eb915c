"""Fault injection at named points of a save, driven by tests through the environment.

``SHARDPOINT_FAULT="point=before-marker,rank=0,action=kill"`` makes rank 0 kill
itself with SIGKILL when its save reaches ``before-marker``. Several faults may be
given separated by ``;``. Points, in the order a save reaches them:

``before-data``, ``mid-data``, ``after-data``, ``before-marker``, ``mid-switch`` (object
storage: the claim won, before the staged files are copied into place), ``before-tracker``,
``during-retention``, ``mid-retention`` (a checkpoint being deleted, after it stopped
being one); and in local-first mode ``during-upload`` (each rank's background
upload, before its first object); for the local tier ``local-after-data`` (each rank's
background write, after its own file) and ``local-before-publish`` (after every rank
agreed, before this rank renames its copies into place); and in a load ``mid-load``
(after the files were checked, before this rank reads its tensors).

Actions: ``kill`` (SIGKILL, the process dies on the spot), ``raise`` (an OSError,
as a failing disk would), ``stall`` (sleep ``seconds``, default 30), ``stop``
(SIGSTOP: alive but stuck, as a frozen mount or a debugger leaves a rank, until
someone sends SIGCONT or SIGKILL). Without the
variable every :func:`hit` is a dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal
import time

__all__ = ["POINTS", "hit"]

ENV = "SHARDPOINT_FAULT"
POINTS = (
    "before-data",
    "mid-data",
    "after-data",
    "before-marker",
    "mid-switch",
    "before-tracker",
    "during-retention",
    "mid-retention",
    "during-upload",
    "local-after-data",
    "local-before-publish",
    "mid-load",
)


def hit(point: str, rank: int) -> None:
    """Trigger the fault configured for ``point`` on ``rank``, if any."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for fault in _parse(spec):
        if fault.get("point") == point and int(fault.get("rank", rank)) == rank:
            _trigger(fault, point, rank)


def _parse(spec: str) -> list[dict[str, str]]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        fault = dict(item.split("=", 1) for item in part.split(",") if "=" in item)
        if fault.get("point") not in POINTS:
            raise ValueError(f"{ENV}: unknown point {fault.get('point')!r}; choose from {POINTS}")
        faults.append(fault)
    return faults


def _trigger(fault: dict[str, str], point: str, rank: int) -> None:
    action = fault.get("action", "kill")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        code = getattr(errno, fault.get("errno", "EIO"))
        raise OSError(code, f"injected fault at {point} on rank {rank}: {os.strerror(code)}")
    elif action == "stall":
        time.sleep(float(fault.get("seconds", 30)))
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise ValueError(f"{ENV}: unknown action {action!r}; choose kill, raise, stall or stop")
