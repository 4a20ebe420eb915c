"""``save_16bit_model``'s file beside the tags, replaced atomically instead of written in place.

DeepSpeed's ``engine.save_16bit_model(save_dir, save_filename)`` (and ``save_fp16_model``)
writes ``<save_dir>/<save_filename>`` through the engine's checkpoint engine, with a
``create`` and a ``commit`` around it, but outside any tag: the tag commit of
:class:`~shardpoint.integrations.deepspeed.files.StagedTag` does not apply (it would
refuse the path). For that call, :func:`~shardpoint.integrations.deepspeed.engine.use`
puts a :class:`WholeFileEngine` in place: the file is written under its own name in a
hidden folder of ``save_dir`` (``torch.save`` names the archive after the file, so the
bytes are DeepSpeed's own), made durable, and moved into place with ``os.replace`` at
``commit``. A kill leaves the previous file or none, never a torn one; a hidden
``.shardpoint-file-*`` folder may stay behind.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from shardpoint.errors import CheckpointError
from shardpoint.integrations import missing_framework
from shardpoint.storage.base import fsync_dir

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
except ModuleNotFoundError as exc:
    raise missing_framework(exc, "deepspeed", "deepspeed") from exc

__all__ = ["WholeFileEngine"]

_PREFIX = ".shardpoint-file-"


class WholeFileEngine(CheckpointEngine):
    """A checkpoint engine for single files outside the tags: written hidden, renamed into place at ``commit``."""

    def __init__(self, zipfile_serialization: bool = True):
        super().__init__(None)
        self.name = "ShardpointWholeFileEngine"
        self.zipfile_serialization = zipfile_serialization
        self.written: list[tuple[str, str]] = []  # (hidden copy, final path)

    def create(self, info: CheckpointCommitInfo) -> None:
        self.written = []

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        folder = tempfile.mkdtemp(prefix=_PREFIX, dir=os.path.dirname(os.path.abspath(path)))
        hidden = os.path.join(folder, os.path.basename(path))
        torch.save(state_dict, hidden, _use_new_zipfile_serialization=self.zipfile_serialization)
        with open(hidden, "rb") as f:
            os.fsync(f.fileno())
        self.written.append((hidden, path))

    def load(self, path: str, map_location: Any = None) -> Any:
        raise CheckpointError(f"{path}: the whole-file engine only writes (save_16bit_model); load tags with use()")

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Move every file written since ``create`` into place, each with one ``os.replace``."""
        for hidden, path in self.written:
            os.replace(hidden, path)
            os.rmdir(os.path.dirname(hidden))
            fsync_dir(os.path.dirname(os.path.abspath(path)))
        self.written = []
        return True
