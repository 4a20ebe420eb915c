"""Whole checkpoints in one process: read every tensor at full size, write a new checkpoint.

The command line (``shardpoint convert``, ``diff``, ``export``) and importers work on
checkpoints offline, with no training job and no process group. They need two things
the :class:`~shardpoint.Checkpointer` never does: assemble each tensor from all the
files that hold a piece of it, and split full tensors again for another layout.

Reading (:func:`read_full`) verifies checksums first, then

* ``dist``: allocates every tensor at its global shape and lets DCP fill it from the
  saved chunks (the shardpoint load planner with full-size shards);
* ``torch``: places each tensor of every ``mp_rank_*/model_optim_rng.pt`` at the box its
  ``sharding`` entry names, and a distributed optimizer's pieces from
  ``distrib_optim.pt`` at theirs.

Besides the tensors it reports each tensor's *split dim* (the dim along which the
saved pieces differ: the tensor-parallel dim) and, for keys without a layer number,
which pipeline stage held them. Optimizer state follows its parameter (``exp_avg`` of
``layers.0.fc2.weight`` splits like the weight), because a ZeRO optimizer slices
state along other dims than tensor parallelism does.

Writing (:func:`write_checkpoint`) produces a complete committed checkpoint through
the same formats and the same commit protocol as a training job: a temporary
directory, the format's own ``save`` once per model-parallel rank, checksums,
``shardpoint.json``, rename, tracker. For ``torch`` output at tp=N, pp=M each tensor
is split along its split dim into N parts, and keys go to pipeline stages by their
global layer number (``layers.<n>.`` goes to stage ``n // (layers / M)``). Keys without
a layer number go where the source held them (first stage, last stage, or both, as a
tied embedding); when the source cannot say (``dist``, or pp=1) the rule is: a key
whose name contains ``embed`` goes to the first stage, any other to the last.

Sources and destinations may be local paths or ``s3://bucket/prefix`` (through
:func:`shardpoint.storage.base.open_storage`; endpoint and credentials from the standard
AWS environment). Objects are read whole into memory, where local files are
memory-mapped; a destination on object storage is committed by its marker, then
the tracker, and has no writer lock (:func:`writer_lock`).

Limits: every tensor is held in memory at full size, so converting needs about as
much RAM as the checkpoint's size. Per-rank RNG streams are not written (ranks do not
correspond across layouts). Call these functions from one process, outside
``torch.distributed`` (or in a world of one).

Modules: ``_locate`` (which checkpoint a path means), ``_read``, ``_write``, and
``_common`` (key naming rules shared by both); this package re-exports their public
names and holds :func:`convert`, which chains them.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Mapping

import torch

from shardpoint.errors import CheckpointError
from shardpoint.offline._common import ProgressFn, layer_of, param_key_of, single_process, stage_by_name
from shardpoint.offline._locate import find_layout, is_checkpoint_dir, local_path, looks_like_checkpoint, resolve
from shardpoint.offline._read import (
    FullCheckpoint,
    TensorInfo,
    check_files,
    describe_tensors,
    infer_split_dims,
    read_full,
)
from shardpoint.offline._write import write_checkpoint, writer_lock
from shardpoint.state.train_state import MODEL_PREFIX
from shardpoint.storage.base import open_storage

__all__ = [
    "FullCheckpoint",
    "ProgressFn",
    "TensorInfo",
    "apply_split_overrides",
    "check_files",
    "convert",
    "describe_tensors",
    "find_layout",
    "infer_split_dims",
    "is_checkpoint_dir",
    "layer_of",
    "local_path",
    "looks_like_checkpoint",
    "param_key_of",
    "read_full",
    "refuse_writing_into_source",
    "resolve",
    "single_process",
    "stage_by_name",
    "write_checkpoint",
    "writer_lock",
]

log = logging.getLogger(__name__)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    iteration: int | None = None,
    format: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
    layout: str | None = None,
    split_overrides: Mapping[str, int | None] | None = None,
    progress: ProgressFn | None = None,
) -> str:
    """Rewrite one checkpoint in another format, layout or tp/pp; the source is only read.

    Options left as None keep the source's value. Returns the new checkpoint's directory.

    Args:
        split_overrides: ``{pattern: dim}`` (``fnmatch`` on keys, with or without the
            ``model.`` prefix) for tensors whose tensor-parallel dim the source cannot
            tell, i.e. when it was saved at tp=1; None as a dim means replicated.

    Raises:
        CheckpointError: ``dst`` is the source's directory, the new checkpoint exists,
            or tp>1 is asked of a tp=1 source without ``split_overrides``.

    Example:
        >>> convert("runs/gpt", "runs/gpt-tp1", tp=1, pp=1, format="torch")
        >>> convert("s3://bucket/runs/gpt", "runs/gpt-local")  # download a copy
    """
    full = read_full(src, iteration, progress=progress)
    meta = full.metadata
    refuse_writing_into_source(full.path, dst)
    format = format or meta.format
    tp, pp = tp or meta.topology["tp"], pp or meta.topology["pp"]
    if format == "torch" and tp > 1 and meta.topology["tp"] == 1 and not split_overrides:
        raise CheckpointError(
            f"{full.path} was saved at tp=1, so it does not record which dim each tensor is split along; pass "
            "--split-dim PATTERN=DIM for the tensor-parallel ones (e.g. '*fc1.weight=0' '*fc2.weight=1'); "
            "tensors no pattern matches are replicated"
        )
    split_dims = apply_split_overrides(full.tensors, full.split_dims, split_overrides or {})
    written = write_checkpoint(
        dst,
        meta.iteration,
        full.tensors,
        full.common,
        tp,
        pp,
        format,
        layout or meta.layout,
        split_dims,
        release=meta.release,
        config=meta.config,
        stages=full.stages,
        metrics=meta.metrics,
        progress=progress,
    )
    if not meta.release:
        log.warning(
            "per-rank RNG states were not converted (ranks do not correspond across layouts); a job "
            "resuming from %s starts new random streams",
            written,
        )
    return written


def apply_split_overrides(
    tensors: Mapping[str, torch.Tensor], split_dims: Mapping[str, int | None], overrides: Mapping[str, int | None]
) -> dict[str, int | None]:
    """``split_dims`` with the keys matching a pattern set to its dim; optimizer state follows its parameter."""
    result = dict(split_dims)
    for key in tensors:
        short = key[len(MODEL_PREFIX) :] if key.startswith(MODEL_PREFIX) else key
        for pattern, dim in overrides.items():
            if fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(short, pattern):
                if dim is not None and not 0 <= dim < tensors[key].dim():
                    raise ValueError(f"--split-dim {pattern}={dim}: {key} has only {tensors[key].dim()} dims")
                result[key] = dim
    for key in tensors:
        param = param_key_of(key)
        if param is not None and param in tensors and tensors[param].shape == tensors[key].shape:
            result[key] = result.get(param)
    return result


def refuse_writing_into_source(checkpoint: str, dst: str | os.PathLike[str]) -> None:
    """Raise when ``dst`` is the save directory holding ``checkpoint``, or inside it: sources stay untouched.

    Local paths are compared after resolving links; ``s3://`` ones as written.
    """
    source, source_root = _canonical(checkpoint), _canonical(os.path.dirname(os.fspath(checkpoint).rstrip("/")))
    target = _canonical(dst)
    if target in (source, source_root) or target.startswith(source + "/"):
        raise CheckpointError(
            f"the destination {target} is the source's directory; conversion never modifies its source, "
            "so write into another directory"
        )


def _canonical(path: str | os.PathLike[str]) -> str:
    storage = open_storage(path)
    return os.path.realpath(storage.root) if storage.is_local else storage.root
