"""Names on storage: iteration directories and the tracker file.

Two layouts are supported, both as their original projects write them:

* ``megatron``: ``iter_0000100/`` and ``latest_checkpointed_iteration.txt`` holding
  ``100`` or ``release``;
* ``neox``: ``global_step100/`` and ``latest`` holding the tag ``global_step100``
  (DeepSpeed's convention), or ``release``.

A layout only names things; it never touches storage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardpoint.errors import CorruptCheckpointError

__all__ = ["LAYOUTS", "RELEASE", "Layout"]

RELEASE = "release"


@dataclass(frozen=True)
class Layout:
    """How one convention names checkpoints.

    Args:
        name: ``megatron`` or ``neox``.
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
        return int(match.group(1)) if match else None

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
        if re.fullmatch("[0-9]+", value):
            return int(value)
        iteration = self.parse_dir_name(value)
        if iteration is None:
            raise CorruptCheckpointError(
                f"tracker file {where} holds {value[:60]!r}, which is neither an iteration number nor "
                f"'{RELEASE}'; write the iteration to load into it, or pass iteration=N to load()"
            )
        return iteration


LAYOUTS: dict[str, Layout] = {
    "megatron": Layout("megatron", "latest_checkpointed_iteration.txt", "iter_{:07d}", r"iter_([0-9]+)", False),
    "neox": Layout("neox", "latest", "global_step{}", r"global_step([0-9]+)", True),
}


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {name!r}") from None
