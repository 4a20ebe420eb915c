"""Names on storage: iteration directories and the tracker file.

Five layouts are supported, each as its original project writes it:

* ``megatron``: ``iter_0000100/`` and ``latest_checkpointed_iteration.txt`` holding
  ``100`` or ``release``;
* ``neox``: ``global_step100/`` and ``latest`` holding the tag ``global_step100``
  (DeepSpeed's convention), or ``release``;
* ``hf``: ``checkpoint-100/``, the name the Hugging Face ``Trainer`` writes and
  ``transformers.trainer_utils.get_last_checkpoint`` finds, and ``latest_checkpoint.txt``
  holding that tag;
* ``accelerate``: ``checkpoint_100/``, Accelerate's automatic checkpoint naming, and
  ``latest_accelerate_checkpoint.txt`` holding that tag;
* ``torchtitan``: ``step-100/``, the name torchtitan's checkpoint manager writes and
  looks for, and ``latest_step.txt`` holding that tag (torchtitan itself keeps no tracker).

A layout only names things; it never touches storage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardpoint.errors import CorruptCheckpointError

__all__ = ["LAYOUTS", "RELEASE", "Layout", "NamedLayout", "named"]

RELEASE = "release"


@dataclass(frozen=True)
class Layout:
    """How one convention names checkpoints.

    Args:
        name: ``megatron``, ``neox``, ``hf``, ``accelerate`` or ``torchtitan``.
        tracker_name: file beside the checkpoints naming the latest one.
        dir_format: ``str.format`` pattern of an iteration directory.
        dir_pattern: regex with one group, the iteration, matching such a directory.
        tracker_holds_tag: the tracker stores the directory name, not the bare number.
    """

    name: str
    tracker_name: str
    dir_format: str
    dir_pattern: str
    tracker_holds_tag: bool

    def dir_name(self, iteration: int | None) -> str:
        """Directory of ``iteration``; ``None`` is the release checkpoint."""
        return RELEASE if iteration is None else self.dir_format.format(iteration)

    def parse_dir_name(self, name: str) -> int | None:
        """Iteration of a directory name, or None when it is not one of ours."""
        match = re.fullmatch(self.dir_pattern, name)
        # an iteration has at most 18 digits (int64): longer is no name of ours, and int() of
        # thousands of digits raises a ValueError that would escape as a generic error
        return int(match.group(1)) if match and len(match.group(1)) <= MAX_DIGITS else None

    def tracker_text(self, iteration: int | None) -> str:
        if iteration is None:
            return RELEASE
        return self.dir_name(iteration) if self.tracker_holds_tag else str(iteration)

    def parse_tracker(self, text: str, where: str) -> int | None:
        """Iteration named by tracker contents (None for release).

        Raises:
            CorruptCheckpointError: the contents name no iteration; the message quotes
                them and says how to repair the file.
        """
        value = text.strip()
        if value == RELEASE:
            return None
        if re.fullmatch(f"[0-9]{{1,{MAX_DIGITS}}}", value):
            return int(value)
        iteration = self.parse_dir_name(value)
        if iteration is None:
            raise CorruptCheckpointError(
                f"tracker file {where} holds {value[:60]!r}, which is neither an iteration number nor "
                f"'{RELEASE}'; write the iteration to load into it, or pass iteration=N to load()"
            )
        return iteration


MAX_DIGITS = 18  # digits of the largest iteration a name or tracker may give (int64)

LAYOUTS: dict[str, Layout] = {
    "megatron": Layout("megatron", "latest_checkpointed_iteration.txt", "iter_{:07d}", r"iter_([0-9]+)", False),
    "neox": Layout("neox", "latest", "global_step{}", r"global_step([0-9]+)", True),
    "hf": Layout("hf", "latest_checkpoint.txt", "checkpoint-{}", r"checkpoint-([0-9]+)", True),
    "accelerate": Layout(
        "accelerate", "latest_accelerate_checkpoint.txt", "checkpoint_{}", r"checkpoint_([0-9]+)", True
    ),
    "torchtitan": Layout("torchtitan", "latest_step.txt", "step-{}", r"step-([0-9]+)", True),
}


@dataclass(frozen=True)
class NamedLayout(Layout):
    """One checkpoint directory whose name a framework chose; made by :func:`named`, not in :data:`LAYOUTS`.

    Lightning's ``ModelCheckpoint`` picks every path itself (``epoch=0-step=4.ckpt``,
    ``last.ckpt``), so the name says nothing about the iteration: every save goes into
    ``dir_format`` (replacing the checkpoint there, committed as any other), the marker
    records the iteration, and the tracker ``.<name>.latest`` beside it holds the number.
    The directory parses as iteration 0, the one checkpoint of this layout.
    """

    def dir_name(self, iteration: int | None) -> str:
        return RELEASE if iteration is None else self.dir_format

    def parse_dir_name(self, name: str) -> int | None:
        return 0 if name == self.dir_format else None


def named(dir_name: str) -> NamedLayout:
    """The layout of the one checkpoint directory ``dir_name`` (a plain name, e.g. ``last.ckpt``).

    Raises:
        ValueError: ``dir_name`` is empty, holds a ``/``, starts with ``.`` or is ``release``.
    """
    if not dir_name or "/" in dir_name or "\\" in dir_name or dir_name.startswith(".") or dir_name == RELEASE:
        raise ValueError(f"a checkpoint directory name must be a plain name (no '/', no leading '.'), got {dir_name!r}")
    return NamedLayout("named", f".{dir_name}.latest", dir_name, re.escape(dir_name), False)


def get_layout(name: str | Layout) -> Layout:
    """The layout called ``name`` in :data:`LAYOUTS`; a :class:`Layout` (e.g. :func:`named`) is returned as is."""
    if isinstance(name, Layout):
        return name
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {name!r}") from None
