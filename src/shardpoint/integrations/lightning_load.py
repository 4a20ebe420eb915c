"""``Model.load_from_checkpoint(path)`` for checkpoints :class:`ShardpointCheckpointIO` saved.

It is how Lightning users take a trained model to inference or fine-tuning, with no
Trainer and usually one process. Lightning reads the file with
``lightning.pytorch.core.saving.pl_load`` (``torch.load`` of a ``.ckpt`` file), which a
checkpoint *directory* defeats with ``IsADirectoryError``. Importing
``shardpoint.integrations.lightning`` therefore wraps that one function: a directory
holding ``shardpoint.json`` is read by :func:`load_checkpoint_dict`, everything else still
by Lightning. ``load_checkpoint_dict`` is also the documented way to get the dict without
Lightning's classmethod.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from shardpoint.integrations import missing_framework

try:
    from lightning.pytorch.core import saving
except ModuleNotFoundError as exc:
    raise missing_framework(exc, "lightning_load", "lightning") from exc

from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.errors import CheckpointNotFoundError
from shardpoint.integrations._hf_common import is_shardpoint_checkpoint
from shardpoint.lifecycle.load_pipeline import LoadResult
from shardpoint.offline import describe_tensors, read_full
from shardpoint.state.train_state import MODEL_PREFIX

__all__ = ["install_load_hook", "load_checkpoint_dict", "saved_state_dict"]


def load_checkpoint_dict(path: str | os.PathLike[str], map_location: Any = None) -> dict[str, Any]:
    """Lightning's checkpoint dict of a shardpoint checkpoint, in one process, whole tensors.

    ``state_dict`` holds every weight at full size, however many ranks saved it and
    however they were sharded; the rest is what Lightning saved besides (``hyper_parameters``,
    ``epoch``, ``global_step``, ``callbacks``, ...). Checksums are verified first and nothing
    is unpickled. The optimizer state is not read (``load_from_checkpoint`` does not use it).

    Args:
        path: a checkpoint directory ShardpointCheckpointIO saved (``.../last.ckpt``), local or ``s3://``.
        map_location: a device (or its name) to put the weights on; other forms (Lightning's
            default function, a dict) leave them on the CPU.

    Raises:
        CheckpointNotFoundError: no shardpoint checkpoint at ``path``.
        CorruptCheckpointError: a file is damaged (named in the message).

    Example:
        >>> model = MyModel.load_from_checkpoint("runs/ckpt/last.ckpt")  # calls this, through Lightning
    """
    path = os.fspath(path)
    if not is_shardpoint_checkpoint(path):
        raise CheckpointNotFoundError(
            f"{path} holds no committed shardpoint checkpoint (no {MARKER_NAME}); pass a checkpoint directory "
            "that ShardpointCheckpointIO saved"
        )
    full = read_full(path)
    device = map_location if isinstance(map_location, (str, torch.device)) else None
    weights = {
        key.removeprefix(MODEL_PREFIX): tensor if device is None else tensor.to(device)
        for key, tensor in full.tensors.items()
        if key.startswith(MODEL_PREFIX)
    }
    return {**full.common.get("extra", {}), "state_dict": weights}


def saved_state_dict(module: torch.nn.Module, result: LoadResult) -> dict[str, Any]:
    """``checkpoint["state_dict"]`` after an in-place load: the saved keys, for Lightning's strict check.

    A key the checkpoint and the module share maps to the module's live tensor (filled by
    the load); a saved key the module lacks maps to a ``meta`` tensor of its saved shape
    and dtype (described from the checkpoint's index, not read); a module key the
    checkpoint lacks is absent. ``module.load_state_dict(..., strict=True)`` then names
    the missing and unexpected keys as it does for Lightning's own files.
    """
    live = module.state_dict()
    saved = describe_tensors(result.path, result.metadata, storage=result.storage)
    out: dict[str, Any] = {key: value for key, value in live.items() if not isinstance(value, torch.Tensor)}
    for info in saved:
        if not info.key.startswith(MODEL_PREFIX):
            continue
        key = info.key.removeprefix(MODEL_PREFIX)
        dtype = getattr(torch, info.dtype)
        out[key] = live[key] if key in live else torch.empty(info.shape, dtype=dtype, device="meta")
    return out


def install_load_hook() -> None:
    """Make ``pl_load`` (what ``load_from_checkpoint`` calls) read shardpoint checkpoints; idempotent."""
    original = saving.pl_load
    if getattr(original, "shardpoint_load", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)) and is_shardpoint_checkpoint(os.fspath(path_or_url)):
            return load_checkpoint_dict(path_or_url, map_location=map_location)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load.shardpoint_load = True  # type: ignore[attr-defined]  # a marker: functions take attributes at run time
    saving.pl_load = pl_load
