"""``Accelerator.save_state`` / ``load_state`` through shardpoint: :func:`save_state`, :func:`load_state`.

They save and load what Accelerate's own methods do, as one committed shardpoint
checkpoint instead of a directory of pickles written in place:

=======================================  ====================================================
Accelerate saves                         here it is
=======================================  ====================================================
the prepared model                       ``TrainState.model``: its own names, DDP or FSDP2
                                         around it or not; sharded tensors stay sharded
the prepared optimizer                   ``TrainState.optimizer``: per-parameter state
                                         follows its parameter (reshards with it)
LR schedulers, objects registered with   state common to all ranks (Accelerate saves both
``register_for_checkpointing``           from the main process)
the grad scaler                          ``TrainState.grad_scaler``
each data loader's epoch, and the state  per rank, restored at the same layout only
of a stateful data loader
every rank's random streams              per rank (Python, NumPy, torch, this rank's CUDA)
``accelerator.step``                     ``TrainState.extra["step"]``
=======================================  ====================================================

Names follow ``ProjectConfiguration``: with ``automatic_checkpoint_naming`` the save
directory is ``{project_dir}/checkpoints`` and checkpoints are ``checkpoint_{iteration}``
(``accelerator.save_iteration``, advanced after each save as Accelerate does);
``total_limit`` keeps that many of the newest. Without automatic naming ``output_dir``
is the save directory and holds ``checkpoint_{iteration}`` directories too: a save
never rewrites the previous one in place, which is how a crash mid-save could lose it.
``load_state`` restores ``save_iteration`` to the loaded checkpoint's successor, so the
next save does not collide with it.

Each call opens a :class:`~shardpoint.Checkpointer` and closes it before returning, so a
checkpoint is committed (and uploaded, with ``upload_to``) when ``save_state`` returns,
as with Accelerate. A save that overlaps training (``async_save``) needs a Checkpointer
that outlives the call: use :class:`~shardpoint.Checkpointer` directly.

For a resume that matches an uninterrupted run bit for bit, mid-epoch and with dropout,
resume the epoch with ``accelerator.skip_first_batches`` and give the ``DataLoader`` a
``generator=`` of its own (with ``DataLoaderConfiguration(use_seedable_sampler=True)``): a
``DataLoader`` otherwise draws from torch's global stream each time an iterator starts,
and a resumed epoch starts its iterator at another point of that stream. (The
``Trainer`` avoids this by restoring the streams after skipping; a user's loop cannot
be reached from here.)

Not supported (each raises ``ValueError``): DeepSpeed and Megatron-LM engines (their
state lives in their own files), FSDP1, several prepared models or optimizers.
Accelerate's ``register_save_state_pre_hook`` hooks are not called (a warning says so).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from shardpoint.catalog.layout import get_layout
from shardpoint.checkpointer import Checkpointer
from shardpoint.integrations import _hf_common as common
from shardpoint.lifecycle.load_pipeline import LoadResult
from shardpoint.state.train_state import TrainState

__all__ = ["DataLoaderProgress", "load_state", "save_state"]

log = logging.getLogger(__name__)

LAYOUT = get_layout("accelerate")


def save_state(
    accelerator: Any, output_dir: str | os.PathLike[str] | None = None, *, checkpointer_options: Mapping | None = None
) -> str:
    """Save what ``accelerator.save_state`` saves as one shardpoint checkpoint; every process calls it.

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare``.
        output_dir: the save directory; ignored with ``automatic_checkpoint_naming``
            (``{project_dir}/checkpoints``, as Accelerate does).
        checkpointer_options: keyword arguments of :class:`~shardpoint.Checkpointer`
            (``upload_to``, ``keep_every``, ``config``, ...); ``keep_last`` defaults to
            ``ProjectConfiguration.total_limit``.

    Returns:
        The checkpoint's directory, ``<save directory>/checkpoint_<iteration>``.

    Example:
        >>> from shardpoint.integrations.accelerate import load_state, save_state
        >>> accelerator = Accelerator(project_config=ProjectConfiguration(
        ...     project_dir="runs/x", automatic_checkpoint_naming=True, total_limit=3))
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        >>> load_state(accelerator)          # None on a fresh start
        >>> ...
        >>> save_state(accelerator)          # runs/x/checkpoints/checkpoint_0, _1, ...
    """
    if getattr(accelerator, "_save_model_state_pre_hook", None):
        log.warning("save_state: hooks registered with register_save_state_pre_hook are not called")
    config = accelerator.project_configuration
    root = _save_directory(accelerator, output_dir, "save_state")
    state = _train_state(accelerator)
    with _checkpointer(accelerator, root, checkpointer_options) as ckpt:
        path = ckpt.save(config.iteration, state)
    config.iteration += 1
    return path


def load_state(
    accelerator: Any, input_dir: str | os.PathLike[str] | None = None, *, checkpointer_options: Mapping | None = None
) -> LoadResult | None:
    """Load what ``accelerator.load_state`` loads from a shardpoint checkpoint; every process calls it.

    Args:
        accelerator: the ``Accelerator``, after ``prepare`` and ``register_for_checkpointing``
            of the same objects as the run that saved.
        input_dir: a save directory (its latest checkpoint is loaded) or one
            ``checkpoint_N`` directory in it; with ``automatic_checkpoint_naming`` it
            defaults to ``{project_dir}/checkpoints``.
        checkpointer_options: as for :func:`save_state` (``verify``, ``config``, ...).

    Returns:
        What was loaded (``result.iteration``, ``result.path``, ...), or None when the save
        directory holds no checkpoint yet (a fresh start).

    Raises:
        CorruptCheckpointError: a file of the checkpoint is missing or changed (named).
        ValueError: no ``input_dir`` and no automatic naming, or it does not exist.
    """
    if getattr(accelerator, "_load_model_state_pre_hook", None):
        log.warning("load_state: hooks registered with register_load_state_pre_hook are not called")
    iteration = None
    if input_dir is not None and common.is_shardpoint_checkpoint(input_dir):
        root, iteration = common.locate(input_dir, LAYOUT)
    else:
        root = _save_directory(accelerator, input_dir, "load_state")
        if input_dir is not None and not os.path.isdir(root):
            raise ValueError(f"load_state: {root} does not exist; pass a save directory or one of its checkpoint_N")
    state = _train_state(accelerator)
    with _checkpointer(accelerator, root, checkpointer_options) as ckpt:
        result = ckpt.load(state, iteration=iteration)
    if result is not None:
        accelerator.step = int(result.extra.get("step", accelerator.step))
        accelerator.project_configuration.iteration = result.iteration + 1
    return result


class DataLoaderProgress:
    """Where a prepared data loader is: its epoch (which seeds its shuffle) and, if stateful, its position.

    Accelerate's data loaders count their epochs in ``iteration``; ``set_epoch`` passes it
    on to the sampler, so a resumed epoch draws the same order.
    """

    def __init__(self, loader: Any):
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": int(getattr(self.loader, "iteration", 0))}
        if getattr(self.loader, "use_stateful_dataloader", False):
            state["position"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(state["epoch"])
        if "position" in state and getattr(self.loader, "use_stateful_dataloader", False):
            self.loader.load_state_dict(state["position"])


def _save_directory(accelerator: Any, directory: str | os.PathLike[str] | None, caller: str) -> str:
    """``{project_dir}/checkpoints`` with automatic naming, else ``directory``, which is then required."""
    if accelerator.project_configuration.automatic_checkpoint_naming:
        return os.path.join(accelerator.project_dir, "checkpoints")
    if directory is None:
        raise ValueError(f"{caller}: pass a directory, or use ProjectConfiguration(automatic_checkpoint_naming=True)")
    return os.path.abspath(os.fspath(directory))


def _checkpointer(accelerator: Any, root: str, options: Mapping | None) -> Checkpointer:
    """A Checkpointer of ``root`` for one call (collective: every process opens it)."""
    options = common.checked_options(options, "shardpoint.integrations.accelerate")
    if options.get("async_save"):
        raise ValueError(
            "save_state returns with its checkpoint committed, so it cannot save asynchronously; "
            "for saves that overlap training keep a shardpoint.Checkpointer open across steps"
        )
    limit = accelerator.project_configuration.total_limit
    if "keep_last" not in options and limit:
        options["keep_last"] = limit
    options.setdefault("topology", common.accelerator_topology(accelerator))
    return Checkpointer(root, layout=LAYOUT.name, **options)


def _train_state(accelerator: Any) -> TrainState:
    """The prepared and registered objects of ``accelerator`` as one TrainState (see the module's table)."""
    _check_supported(accelerator)
    models, optimizers = accelerator._models, accelerator._optimizers  # what Accelerator.save_state reads too
    if len(models) > 1 or len(optimizers) > 1:
        raise ValueError(
            f"shardpoint's save_state keeps one prepared model and one optimizer; this Accelerator has "
            f"{len(models)} and {len(optimizers)}: use Accelerator.save_state, or one shardpoint.Checkpointer per model"
        )
    shared = {f"scheduler_{i}": s for i, s in enumerate(accelerator._schedulers)}
    shared |= {f"custom_{i}": obj for i, obj in enumerate(accelerator._custom_objects)}
    group = common.StateGroup(shared, "schedulers and registered objects")
    return TrainState(
        model=models[0] if models else None,
        optimizer=common.unwrap_optimizer(optimizers[0]) if optimizers else None,
        scheduler=group if group else None,
        grad_scaler=accelerator.scaler,
        stateful={f"dataloader_{i}": DataLoaderProgress(dl) for i, dl in enumerate(accelerator._dataloaders)},
        extra={"step": int(accelerator.step)},
    )


def _check_supported(accelerator: Any) -> None:
    kind = str(getattr(accelerator, "distributed_type", ""))
    if kind.endswith(("DEEPSPEED", "MEGATRON_LM")):
        raise ValueError(
            f"shardpoint's save_state does not checkpoint {kind} engines (they keep their state in their own "
            "files); use Accelerator.save_state"
        )
    if kind.endswith("FSDP") and not getattr(accelerator, "is_fsdp2", False):
        raise ValueError("shardpoint's save_state supports FSDP2 only: FullyShardedDataParallelPlugin(fsdp_version=2)")
