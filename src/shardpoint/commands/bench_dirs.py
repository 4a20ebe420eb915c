"""Where ``shardpoint bench`` writes: a folder per run, and what killed runs left behind.

A bench killed before its clean-up (Ctrl-C twice, the OOM killer, a CI timeout) leaves
whole checkpoints in its folder; in ``/dev/shm`` that is memory, and the next bench
there ran out of it (22 GB left by killed runs once made the next one OOM). Each run's
folder carries its pid, so a new run removes the folders of runs whose process is gone
and leaves those of runs still going.

A name proves nothing: ``--dir experiments`` may hold a user's ``run-2024/``. So the
bench writes :data:`BENCH_MARKER` (its pid) into a folder before anything else, and a
later run removes only a folder that holds a marker naming that folder's own dead pid.
A bench killed between ``mkdir`` and the marker leaves an empty folder, which stays.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from shardpoint.storage.base import LocalStorage, Storage

__all__ = ["BENCH_MARKER", "default_dirs", "run_dir", "run_root"]

log = logging.getLogger(__name__)

BENCH_MARKER = ".shardpoint-bench-run"


def default_dirs() -> list[str]:
    """Where the bench writes without ``--dir``: ``/dev/shm`` (memory) where it exists, and the current folder."""
    dirs = [os.path.join(os.getcwd(), ".shardpoint-bench")]
    if os.path.isdir("/dev/shm"):
        dirs.insert(0, "/dev/shm/shardpoint-bench")
    return dirs


def run_dir(directory: str, kind: str) -> str:
    """A new folder ``<directory>/<kind>-<pid>`` (created, marked), after removing those dead bench runs left.

    Only folders holding :data:`BENCH_MARKER` with the folder's own pid are removed: any
    other ``<kind>-<digits>`` folder is not the bench's and stays, whatever its name.
    """
    os.makedirs(directory, exist_ok=True)
    pattern = re.compile(rf"^{re.escape(kind)}-(\d+)$")
    for name in os.listdir(directory):
        found = pattern.match(name)
        path = os.path.join(directory, name)
        if found and int(found.group(1)) != os.getpid() and _left_by_dead_bench(path, int(found.group(1))):
            log.warning("removing %s, left by a bench run that is gone", path)
            shutil.rmtree(path, ignore_errors=True)
    path = os.path.join(directory, f"{kind}-{os.getpid()}")
    _create(path)
    return path


def _create(path: str) -> None:
    """Make ``path`` and write the marker that makes it the bench's, before any data goes into it.

    A folder of that name that this process did not mark (a user's ``run-2024/`` when
    the bench's pid is 2024) is refused: the bench removes its folder when done.
    """
    try:
        os.mkdir(path)
    except FileExistsError:
        if _marker_pid(path) != str(os.getpid()):
            raise SystemExit(
                f"shardpoint bench: {path} exists and is not this bench's (no {BENCH_MARKER} naming pid "
                f"{os.getpid()}); the bench deletes its folder when done, so it will not use this one: "
                "give another --dir"
            ) from None
        return
    Path(path, BENCH_MARKER).write_text(str(os.getpid()))


def run_root(storage: Storage) -> str:
    """The main bench's folder in ``storage``: :func:`run_dir` on a local disk, ``run-<pid>`` elsewhere."""
    if isinstance(storage, LocalStorage):
        return run_dir(storage.root, "run")
    root = storage.join(storage.root, f"run-{os.getpid()}")
    storage.makedirs(root)
    return root


def _left_by_dead_bench(path: str, pid: int) -> bool:
    """``path`` holds the marker of bench process ``pid``, and that process is gone."""
    return _marker_pid(path) == str(pid) and not _alive(pid)


def _marker_pid(path: str) -> str | None:
    """The pid written in ``path``'s marker; None without one (then the folder is not provably the bench's)."""
    try:
        return Path(path, BENCH_MARKER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
