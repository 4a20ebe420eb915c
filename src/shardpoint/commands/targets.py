"""Where a command may write: something new, never into or over what exists (invariant 10).

``export`` and ``convert`` write a new thing: a Hugging Face directory, a save
directory, a safetensors file. Written into a committed shardpoint checkpoint, its files
are not in the marker and ``verify`` reports the checkpoint damaged; written over an
earlier export, two models' files mix; written into another run's directory, its tracker
moves. So each command checks its target here before it reads or writes anything.
(A save directory shardpoint wrote may take another checkpoint: the commit protocol
and :mod:`shardpoint.lifecycle.tracker_owner` guard that case.)
"""

from __future__ import annotations

import os

from shardpoint.errors import CheckpointError
from shardpoint.storage.base import OWN_MARKERS, open_storage

__all__ = ["refuse_export_target", "refuse_inside_checkpoint", "safetensors_path"]


def refuse_export_target(to: str, out: str) -> None:
    """Raise, before anything is read or written, when exporting ``--to`` ``to`` into ``out`` would write into or
    over what exists: ``hf`` and ``release`` need a new or empty directory, ``safetensors`` a name not taken,
    and none may lie inside a shardpoint checkpoint.

    Raises:
        CheckpointError: naming ``out``, what it holds, and the fix (a new or empty directory, another name).
    """
    if to == "safetensors":
        target = safetensors_path(out)
        if os.path.exists(target):
            raise CheckpointError(f"{target} exists already; remove it or choose another output name")
        refuse_inside_checkpoint(os.path.dirname(target), out)
        return
    storage = open_storage(out)
    if storage.exists(storage.root):
        names = storage.listdir(storage.root) if storage.is_dir(storage.root) else None
        if names is None or names:
            what = "a Hugging Face model directory" if to == "hf" else "a save directory with a release checkpoint"
            held = "is a file" if names is None else "holds " + ", ".join(names[:5]) + (", ..." * (len(names) > 5))
            raise CheckpointError(
                f"{storage.root} exists and {held}; export --to {to} writes {what} and never writes into or over "
                "existing files (an earlier export, a checkpoint, another run's tracker): choose a new or empty "
                "directory"
            )
    if storage.is_local:
        refuse_inside_checkpoint(storage.root, out)


def refuse_inside_checkpoint(directory: str, out: str) -> None:
    """Raise when ``directory`` (local) or a folder above it is a shardpoint checkpoint (it holds one of its markers).

    Raises:
        CheckpointError: naming ``out``, the checkpoint and the fix.
    """
    path = os.path.abspath(directory)
    while True:
        found = [m for m in OWN_MARKERS if os.path.exists(os.path.join(path, m))]
        if found:
            raise CheckpointError(
                f"{out} is inside the shardpoint checkpoint {path} (it holds {found[0]}); files written there are "
                "not in its marker, so verify would report it damaged: choose a directory outside any checkpoint"
            )
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def safetensors_path(out: str) -> str:
    """The file ``--to safetensors`` writes: ``out``, or ``out/model.safetensors`` when ``out`` is a directory."""
    path = os.path.join(out, "model.safetensors") if os.path.isdir(out) or out.endswith(os.sep) else out
    return os.path.abspath(path)
