"""Files shardpoint writes for other programs get the permissions the user's umask gives.

Some writers create files owner-only (safetensors' ``save_file`` writes 0600), so an
exported model another user or a serving job should read would not be readable. Such files
are set to ``0o666 & ~umask`` before they are renamed into place, as ``open()`` would create them.
"""

from __future__ import annotations

import os
import threading

__all__ = ["as_umask_allows", "current_umask"]

_lock = threading.Lock()


def current_umask() -> int:
    """This process's umask: from ``/proc/self/status`` where Linux lists it, else read and put back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _lock:  # os.umask can only be read by setting it: keep the gap short and in one thread
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def as_umask_allows(path: str) -> None:
    """Give the file at ``path`` the mode a plain ``open(path, "w")`` would have given it."""
    os.chmod(path, 0o666 & ~current_umask())
