"""Where ``shardpoint bench`` writes: a folder per run, and what killed runs left behind.

A bench killed before its clean-up (Ctrl-C twice, the OOM killer, a CI timeout) leaves
whole checkpoints in its folder; in ``/dev/shm`` that is memory, and the next bench
there ran out of it (22 GB left by killed runs once made the next one OOM). Each run's
folder carries its pid, so a new run removes the folders of runs whose process is gone
and leaves those of runs still going.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

from shardpoint.storage.base import LocalStorage, Storage

__all__ = ["default_dirs", "run_dir", "run_root"]

log = logging.getLogger(__name__)


def default_dirs() -> list[str]:
    """Where the bench writes without ``--dir``: ``/dev/shm`` (memory) where it exists, and the current folder."""
    dirs = [os.path.join(os.getcwd(), ".shardpoint-bench")]
    if os.path.isdir("/dev/shm"):
        dirs.insert(0, "/dev/shm/shardpoint-bench")
    return dirs


def run_dir(directory: str, kind: str) -> str:
    """A new folder ``<directory>/<kind>-<pid>`` (created), after removing those of dead runs of ``kind``."""
    os.makedirs(directory, exist_ok=True)
    pattern = re.compile(rf"^{re.escape(kind)}-(\d+)$")
    for name in os.listdir(directory):
        found = pattern.match(name)
        if found and int(found.group(1)) != os.getpid() and not _alive(int(found.group(1))):
            log.warning("removing %s, left by a bench run that is gone", os.path.join(directory, name))
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    path = os.path.join(directory, f"{kind}-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    return path


def run_root(storage: Storage) -> str:
    """The main bench's folder in ``storage``: :func:`run_dir` on a local disk, ``run-<pid>`` elsewhere."""
    if isinstance(storage, LocalStorage):
        return run_dir(storage.root, "run")
    root = storage.join(storage.root, f"run-{os.getpid()}")
    storage.makedirs(root)
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
