"""One writer per checkpoint directory.

Two jobs saving into the same directory would interleave their trackers and
retention and delete each other's checkpoints. The first save takes an exclusive
``flock`` on ``<root>/.shardpoint.lock`` and writes its holder (host, pid, start
time) into it. The kernel drops the lock when the process dies, however it dies, so
a lock left by a dead job is taken over with no stale-lock heuristics; the holder
text only serves the error message of the job that is refused.

Readers (``load``, the CLI) never lock: loading from a directory a job is writing
is safe because of the commit protocol.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from typing import IO

from shardpoint.errors import ConcurrentSaveError, StorageError
from shardpoint.storage.base import describe_os_error

__all__ = ["DirectoryLock", "LockedError"]

LOCK_NAME = ".shardpoint.lock"


class LockedError(ConcurrentSaveError):
    """Another live process holds the directory's writer lock: another job is saving there."""


def _locked(root: str, holder: str) -> LockedError:
    """The error for a lock held by ``holder`` (its JSON), telling this very process from another job."""
    try:
        record = json.loads(holder)
        same = record.get("pid") == os.getpid() and record.get("host") == socket.gethostname()
    except (ValueError, AttributeError):
        same = False
    if same:
        return LockedError(
            f"{root} is being written by this same process (pid {os.getpid()}): another Checkpointer in it (or a "
            "Trainer / Lightning plugin whose fit has not ended) still holds the directory's writer lock; close() "
            "it first, or save into another directory"
        )
    return LockedError(
        f"{root} is being written by another job ({holder}); "
        "two jobs must not save into one directory: stop the other job or choose another save dir"
    )


class DirectoryLock:
    """An exclusive, process-lifetime lock on a checkpoint root (rank 0 only)."""

    def __init__(self, root: str):
        self.path = os.path.join(root, LOCK_NAME)
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`LockedError` naming the holder."""
        if self._file is not None:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            handle = open(self.path, "a+")  # noqa: SIM115 - held open for the lock's lifetime
        except OSError as exc:
            raise StorageError(describe_os_error(exc, self.path)) from exc
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise _locked(os.path.dirname(self.path), holder) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}))
        handle.flush()
        self._file = handle

    def try_acquire(self) -> bool:
        """Take the lock if free and writable; False otherwise (e.g. a read-only archive)."""
        try:
            self.acquire()
        except (LockedError, StorageError):
            return False
        return True

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None
