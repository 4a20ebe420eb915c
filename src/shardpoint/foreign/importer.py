"""Find, read and import Megatron-LM and DeepSpeed checkpoints as shardpoint ``dist`` checkpoints.

:func:`read_foreign` takes a save directory (with ``latest_checkpointed_iteration.txt``
or ``latest``) or one iteration directory, detects the tool and format, and returns a
:class:`~shardpoint.foreign.ForeignCheckpoint`. :func:`import_checkpoint` writes it
through shardpoint's own offline writer (:func:`shardpoint.offline.write_checkpoint`:
DCP files, ``common.pt``, ``shardpoint.json`` with checksums, then the tracker), so the
result is an ordinary ``dist`` checkpoint that loads at any layout.

Keys of the result (a choice, documented in the README): the source tool's own
parameter names with global layer numbers (``model.decoder.layers.3.mlp.linear_fc1.weight``
for Megatron; the engine's names for DeepSpeed), and per parameter
``optimizer.state.<name>.exp_avg`` / ``exp_avg_sq`` / ``step`` (and ``master_param``
where the weights are not fp32). Keeping the tool's names means a Megatron model's
``sharded_state_dict`` keys match with no renaming table, and export back is exact.
Mixture-of-experts weights are stored per *global* expert id
(``model.decoder.layers.0.mlp.experts.local_experts.<g>.linear_fc1.weight``), so they load
at any ep (declare them with :func:`shardpoint.global_expert`); buffers (a MoE router's
``expert_bias``) are model keys without optimizer state.

``common.pt`` carries ``optimizer_param_groups`` (hyperparameters per group), the
scheduler state, ``extra`` (``consumed_samples``, ``flops``), and ``foreign``: the
source's tool, format, layout, group membership and small fields that export needs.
``shardpoint.json``'s ``config`` is the source's args as JSON.

The source is only read. Sources are local directories.
"""

from __future__ import annotations

import logging
import os
import pickletools
import zipfile
from typing import Any, Literal, overload

import torch

from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.foreign._types import ForeignCheckpoint
from shardpoint.foreign._unpickle import PICKLE_DAMAGE
from shardpoint.foreign.deepspeed import is_deepspeed_dir, read_deepspeed
from shardpoint.foreign.megatron import MODEL_FILE, is_legacy_dir, read_legacy
from shardpoint.foreign.megatron_torch_dist import is_torch_dist_dir, read_torch_dist
from shardpoint.offline import ProgressFn, refuse_writing_into_source, write_checkpoint
from shardpoint.state.train_state import MODEL_PREFIX, OPTIM_PREFIX

__all__ = ["detect", "find_foreign", "import_checkpoint", "locate", "read_foreign", "to_shardpoint"]

log = logging.getLogger(__name__)

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_TRACKER = "latest"


def locate(path: str | os.PathLike[str], iteration: int | None = None) -> str:
    """The iteration directory ``path`` means: itself, or the one its tracker (or ``iteration``) names."""
    path = os.fspath(path)
    if "://" in path:
        raise CheckpointError(f"{path}: importing reads local directories; download the checkpoint first")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory")
    if detect(path, strict=False):
        return path
    if iteration is not None:
        for name in (f"iter_{iteration:07d}", f"global_step{iteration}"):
            if os.path.isdir(os.path.join(path, name)):
                return os.path.join(path, name)
        raise CheckpointError(f"{path} has no iter_{iteration:07d}/ nor global_step{iteration}/")
    for tracker in (MEGATRON_TRACKER, DEEPSPEED_TRACKER):
        file = os.path.join(path, tracker)
        if os.path.isfile(file):
            name = _tracked_name(file)
            if os.path.isdir(os.path.join(path, name)):
                return os.path.join(path, name)
            raise CheckpointError(f"{file} names {name!r}, but {os.path.join(path, name)} does not exist")
    raise CheckpointError(
        f"{path} is neither a Megatron-LM / DeepSpeed checkpoint directory nor a save directory with "
        f"{MEGATRON_TRACKER} or {DEEPSPEED_TRACKER}; pass the iteration directory"
    )


def _tracked_name(file: str) -> str:
    """The directory a Megatron-LM or DeepSpeed tracker names: one plain name beside it, never a path.

    The tracker is someone else's file: read at most a few bytes of it, and refuse what is
    not text or would lead outside the save directory (``..``, ``/``, NUL).
    """
    with open(file, "rb") as f:
        raw = f.read(_MAX_TRACKER_BYTES + 1)
    try:
        text = raw.decode().strip()
    except UnicodeDecodeError:
        text = None
    if text and text.isdigit() and len(text) <= 18:
        return f"iter_{int(text):07d}"
    if len(raw) > _MAX_TRACKER_BYTES or not text or text in (".", "..") or any(c in text for c in "/\\\x00"):
        shown = repr(raw[:40]) if text is None else repr(text[:40])
        raise CorruptCheckpointError(
            f"tracker {file} holds {shown}, which names no checkpoint directory beside it; write the iteration "
            "(Megatron-LM) or the tag (DeepSpeed) into it, or pass the iteration directory itself"
        )
    return text


_MAX_TRACKER_BYTES = 4096


def find_foreign(path: str | os.PathLike[str], iteration: int | None = None) -> str | None:
    """The iteration directory of another tool's checkpoint that ``path`` means, or None.

    None for remote paths, for anything that is not a Megatron-LM / DeepSpeed
    checkpoint, and for shardpoint's own checkpoints (``shardpoint.json``, or a save's
    ``.shardpoint-in-progress`` object): shardpoint's ``torch`` format looks like
    Megatron's legacy one, and is read by shardpoint's own readers. Never raises for
    what it does not recognise, so callers can fall back to shardpoint's tools.
    """
    from shardpoint.catalog.metadata import MARKER_NAME
    from shardpoint.lifecycle.commit import IN_PROGRESS_NAME

    text = os.fspath(path)
    if "://" in text or not os.path.isdir(text):
        return None
    try:
        directory = locate(text, iteration)
    except CheckpointError:
        return None
    if any(os.path.exists(os.path.join(directory, n)) for n in (MARKER_NAME, IN_PROGRESS_NAME)):
        return None
    kind = detect(directory, strict=False)
    if kind == "megatron-torch" and not _holds_megatron_args(directory):
        return None  # shardpoint's own torch format, its marker gone: shardpoint's tools explain that
    return directory if kind else None


_UNREADABLE: tuple[type[BaseException], ...] = (OSError, *PICKLE_DAMAGE)


def _holds_megatron_args(directory: str) -> bool:
    """Whether the first ``model_optim_rng.pt`` pickles an ``argparse.Namespace`` (Megatron's args).

    Only the pickle's global names are listed, nothing is built; shardpoint's own
    ``torch`` format, laid out like Megatron's, pickles no class at all.
    """
    files = sorted(os.path.join(directory, n, MODEL_FILE) for n in os.listdir(directory) if n.startswith("mp_rank_"))
    try:
        names = _globals_in(next(f for f in files if os.path.exists(f)))
    except _UNREADABLE:
        return True  # unreadable: the reader names the damage
    return "argparse.Namespace" in names


def _globals_in(path: str) -> list[str]:
    """Every global (``module.name``) the pickle of the ``torch.save`` archive ``path`` names; nothing is built.

    Read from the pickle's opcodes, not through ``torch.serialization``: torch lists only
    globals not registered with ``add_safe_globals``, and megatron-core registers
    ``argparse.Namespace`` when it is imported, so once Megatron was imported in a process
    its checkpoints would no longer look like Megatron's.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            pkl = next((n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")), None)
            if pkl is None:
                raise ValueError(f"{path} holds no data.pkl")
            data = archive.read(pkl)
    except zipfile.BadZipFile:
        # shardpoint's own torch format writes no CRC-32 (zipfile refuses it); torch's scan reads it, and
        # Megatron's files, written by plain torch.save, always carry theirs
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    names, strings = [], []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            names.append(str(arg).replace(" ", "."))
        elif isinstance(arg, str):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.append(f"{strings[-2]}.{strings[-1]}")
    return names


@overload
def detect(directory: str, strict: Literal[True] = True) -> str: ...
@overload
def detect(directory: str, strict: bool) -> str | None: ...


def detect(directory: str, strict: bool = True) -> str | None:
    """``"megatron-torch"``, ``"megatron-torch_dist"`` or ``"deepspeed"`` for an iteration directory."""
    if is_torch_dist_dir(directory):
        return "megatron-torch_dist"
    if is_legacy_dir(directory):
        return "megatron-torch"
    if is_deepspeed_dir(directory):
        return "deepspeed"
    if strict:
        raise CheckpointError(f"{directory} is not a Megatron-LM (torch, torch_dist) or DeepSpeed checkpoint")
    return None


def read_foreign(
    path: str | os.PathLike[str],
    *,
    source: str | None = None,
    iteration: int | None = None,
    optimizer: bool = True,
) -> ForeignCheckpoint:
    """Read a Megatron-LM or DeepSpeed checkpoint into global tensors.

    Args:
        path: a save directory or one iteration directory.
        source: ``"megatron"`` or ``"deepspeed"`` to insist on one tool; None detects it.
        iteration: which iteration of a save directory (default: its tracker's).
        optimizer: False reads the model weights only: ``torch_dist`` then reads no
            optimizer key at all (so a layout it cannot decode does not stop it); the other
            readers drop the optimizer state they read.

    Example:
        >>> ckpt = read_foreign("/data/megatron/run1")        # iter dir from the tracker
        >>> ckpt.params["decoder.layers.0.mlp.linear_fc1.weight"].shape
    """
    directory = locate(path, iteration)
    kind = detect(directory)
    if source is not None and not kind.startswith(source):
        raise CheckpointError(f"{directory} is a {kind} checkpoint, not {source}; drop --from or fix it")
    if kind == "megatron-torch_dist":
        ckpt = read_torch_dist(directory, optimizer=optimizer)
    else:
        ckpt = {"megatron-torch": read_legacy, "deepspeed": read_deepspeed}[kind](directory)
    if not optimizer:
        ckpt.optimizer = {name: {} for name in ckpt.params}
    log.debug("read %s: %s", directory, ckpt.describe())
    return ckpt


def to_shardpoint(ckpt: ForeignCheckpoint) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, int | None]]:
    """Global-key tensors, common state and split dims of a shardpoint checkpoint holding ``ckpt``."""
    tensors: dict[str, torch.Tensor] = {}
    split_dims: dict[str, int | None] = {}
    for name, tensor in ckpt.params.items():
        tensors[MODEL_PREFIX + name] = tensor
        split_dims[MODEL_PREFIX + name] = ckpt.split_dims.get(name)
        for key, value in ckpt.optimizer.get(name, {}).items():
            okey = f"{OPTIM_PREFIX}{name}.{key}"
            tensors[okey] = value
            split_dims[okey] = ckpt.split_dims.get(name) if value.shape == tensor.shape else None
    extra: dict[str, Any] = {}
    if ckpt.consumed_samples is not None:
        extra["consumed_samples"] = int(ckpt.consumed_samples)
    flops = ckpt.extra.get("num_floating_point_operations_so_far")
    if isinstance(flops, (int, float)):
        extra["flops"] = float(flops)
    common = {
        "extra": extra,
        "optimizer_param_groups": [{k: v for k, v in g.items() if k != "param_names"} for g in ckpt.param_groups],
        "scheduler": ckpt.scheduler,
        "distributed_optimizer": False,  # state is stored per parameter: any optimizer layout loads it
        "foreign": {
            "tool": ckpt.tool,
            "format": ckpt.format,
            "tp": ckpt.tp,
            "pp": ckpt.pp,
            "dp": ckpt.dp,
            "ep": ckpt.ep,
            "buffers": list(ckpt.buffers),
            "optimizer_sharding": ckpt.optimizer_sharding,
            "param_groups": [list(g.get("param_names", [])) for g in ckpt.param_groups],
            "checkpoint_version": ckpt.extra.get("checkpoint_version"),
            "rng_state": ckpt.extra.get("rng_state"),
        },
    }
    return tensors, common, split_dims


def import_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source: str | None = None,
    iteration: int | None = None,
    optimizer: bool = True,
    progress: ProgressFn | None = None,
) -> str:
    """Import a Megatron-LM or DeepSpeed checkpoint into ``dst`` as a ``dist`` checkpoint; return its directory.

    The result has the source's iteration, a ``megatron`` layout for Megatron sources
    and ``neox`` (``global_stepN/``, ``latest``) for DeepSpeed ones, and loads through
    :meth:`shardpoint.Checkpointer.load` at any tp/pp/dp that divides the model.
    ``optimizer=False`` imports the weights only (load it with ``load_optimizer=False``).

    Example:
        >>> import_checkpoint("/data/megatron/run1", "runs/imported")
    """
    ckpt = read_foreign(src, source=source, iteration=iteration, optimizer=optimizer)
    refuse_writing_into_source(ckpt.path, dst)
    tensors, common, split_dims = to_shardpoint(ckpt)
    written = write_checkpoint(
        dst,
        ckpt.iteration,
        tensors,
        common,
        tp=ckpt.tp,
        pp=1,
        format="dist",
        layout="neox" if ckpt.tool == "deepspeed" else "megatron",
        split_dims=split_dims,
        config=ckpt.args,
        progress=progress,
    )
    log.info("imported %s (%s %s) into %s", ckpt.path, ckpt.tool, ckpt.format, written)
    return written
