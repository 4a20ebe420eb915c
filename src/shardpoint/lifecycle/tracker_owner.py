"""Whose tracker is this: a save or a conversion replaces only a tracker shardpoint wrote.

shardpoint's ``megatron`` and ``neox`` layouts use the names Megatron-LM and DeepSpeed
use (``latest_checkpointed_iteration.txt``, ``latest``), so a save into a directory
holding a Megatron-LM or GPT-NeoX run would replace that run's tracker, and its next
resume would look for a checkpoint shardpoint wrote (invariant 10: shardpoint rewrites
only what it wrote). The iteration directory a save targets is checked already
(:func:`shardpoint.storage.base.refuse_foreign`); this checks the tracker.

A tracker holds a number or a tag and no mark of who wrote it, so the directory it names
decides. shardpoint's tracker only ever names a checkpoint it committed, which holds one
of its markers; another tool's names a directory holding that tool's files. A tracker
naming a directory that is not there proves nothing either way (a checkpoint deleted by
hand, a damaged tracker) and is replaced as before, so a run whose tracker was damaged
can still save. DeepSpeed's ``latest`` may hold any tag (``save_checkpoint(tag=...)``),
so text that is no iteration is taken as a directory name too.

Called by rank 0 before any byte of a save is written, so a refused save leaves the
tree as it was.
"""

from __future__ import annotations

from shardpoint.catalog.layout import Layout
from shardpoint.errors import CorruptCheckpointError
from shardpoint.lifecycle.commit import IN_PROGRESS_NAME
from shardpoint.storage.base import OWN_MARKERS, ForeignDataError, Storage

__all__ = ["refuse_foreign_tracker"]

_SHOWN = 5


def refuse_foreign_tracker(storage: Storage, root: str, layout: Layout) -> None:
    """Raise unless the tracker ``layout`` writes under ``root`` is absent or shardpoint's own.

    Raises:
        ForeignDataError: naming the tracker file, what it says, the directory it names
            and a few of that directory's files, and the fix (save into another directory).
    """
    tracker = storage.join(root, layout.tracker_name)
    if not storage.exists(tracker):
        return
    if storage.is_dir(tracker):
        raise ForeignDataError(
            f"{tracker} is a directory, where shardpoint would write its tracker file; shardpoint never replaces "
            "data it did not write: save into another directory"
        )
    text = _text(storage.read_bytes(tracker))
    named = _named_directory(layout, text, tracker)
    if named is None:
        return
    directory = storage.join(root, named)
    if not storage.is_dir(directory):
        return
    names = storage.listdir(directory)
    if any(marker in names for marker in (*OWN_MARKERS, IN_PROGRESS_NAME)):
        return
    shown = ", ".join(names[:_SHOWN]) + (f", ... ({len(names)} entries)" if len(names) > _SHOWN else "")
    raise ForeignDataError(
        f"{tracker} was not written by shardpoint: it says {text[:60]!r}, naming {directory}, which holds "
        f"{shown or 'nothing'} and no {OWN_MARKERS[0]} (another tool's run, e.g. Megatron-LM or DeepSpeed). "
        "A save here would replace that tracker and that run's resume would find shardpoint's checkpoint: "
        "shardpoint never rewrites data it did not write, so save into another directory"
    )


def _text(data: bytes) -> str:
    try:
        return data.decode().strip()
    except UnicodeDecodeError:
        return ""  # not text: shardpoint's damaged tracker or anyone's, it names nothing


def _named_directory(layout: Layout, text: str, where: str) -> str | None:
    """The directory name the tracker's text points at: the layout's for an iteration, else the text as a tag."""
    try:
        return layout.dir_name(layout.parse_tracker(text, where))
    except (CorruptCheckpointError, ValueError):  # ValueError: past Python's digit limit
        plain = text and "/" not in text and "\\" not in text and text not in (".", "..")
        return text if plain else None
