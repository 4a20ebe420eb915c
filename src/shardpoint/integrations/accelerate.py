"""Accelerate's ``save_state`` / ``load_state`` via shardpoint: :func:`save_state`, :func:`load_state`, :func:`patch`.

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

**Drop-in.** An existing script keeps its ``accelerator.save_state(...)`` /
``accelerator.load_state(...)`` calls and adds one line after building the Accelerator::

    accelerator = shardpoint.integrations.accelerate.patch(Accelerator(...))

:func:`patch` binds :func:`save_state` / :func:`load_state` on that one instance (the
class, and every other Accelerator, keep Accelerate's methods); :func:`unpatch` puts
Accelerate's back. Both functions take every argument Accelerate's methods take; what
does not apply is accepted and said below.

Names follow ``ProjectConfiguration``: with ``automatic_checkpoint_naming`` the save
directory is ``{project_dir}/checkpoints`` and checkpoints are ``checkpoint_{iteration}``
(``accelerator.save_iteration``, advanced after each save as Accelerate does);
``total_limit`` keeps that many of the newest. Without automatic naming ``output_dir``
is the save directory and holds ``checkpoint_{iteration}`` directories too: a save
never rewrites the previous one in place, which is how a crash mid-save could lose it.
``load_state(input_dir)`` loads the directory it is given, as Accelerate does (one
``checkpoint_N``, or a save directory, whose latest checkpoint it loads), automatic
naming or not; with no ``input_dir`` it loads the latest of ``{project_dir}/checkpoints``.
It restores ``save_iteration`` to the loaded checkpoint's successor, so the next save
does not collide with it. A directory shardpoint did not write (Accelerate's own
``pytorch_model.bin`` / ``model.safetensors`` files) is never loaded, and never
replaced by a save: both raise :class:`~shardpoint.storage.base.ForeignDataError`.

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

Differences from Accelerate, each for a reason: ``load_state()`` with automatic naming
and nothing saved yet returns None (a fresh start) where Accelerate raises; a save of a
``checkpoint_N`` that shardpoint committed earlier replaces it (atomically) where
Accelerate raises; ``save_on_each_node`` is not read (unshared local disks are
``checkpointer_options={"upload_to": ...}``).

Not supported (each raises ``ValueError``): DeepSpeed and Megatron-LM engines (their
state lives in their own files), FSDP1, several prepared models or optimizers.
Accelerate's ``register_save_state_pre_hook`` hooks are not called (a warning says so).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

from shardpoint.integrations import missing_framework

try:
    import accelerate  # noqa: F401  (only duck-typed here, but without it there is no Accelerator to pass)
except ModuleNotFoundError as exc:
    raise missing_framework(exc, "accelerate", "accelerate") from exc

from shardpoint.catalog.layout import get_layout
from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.checkpointer import Checkpointer
from shardpoint.errors import CheckpointError
from shardpoint.integrations import _hf_common as common
from shardpoint.lifecycle.load_pipeline import LoadResult
from shardpoint.state.train_state import TrainState
from shardpoint.storage.base import ForeignDataError

__all__ = ["DataLoaderProgress", "load_state", "patch", "save_state", "unpatch"]

log = logging.getLogger(__name__)

LAYOUT = get_layout("accelerate")
MAP_LOCATIONS = (None, "cpu", "on_device")  # what Accelerate's load_accelerator_state accepts


def save_state(
    accelerator: Any,
    output_dir: str | os.PathLike[str] | None = None,
    safe_serialization: bool = True,
    *,
    checkpointer_options: Mapping | None = None,
    **save_model_func_kwargs: Any,
) -> str:
    """Save what ``accelerator.save_state`` saves as one shardpoint checkpoint; every process calls it.

    Takes ``Accelerator.save_state``'s arguments. ``safe_serialization`` is accepted and
    has no effect: shardpoint never pickles, whatever it says (tensors go to DCP files,
    the rest to JSON and plain-type files loaded without unpickling).
    ``save_model_func_kwargs`` are DeepSpeed's ``save_checkpoint`` arguments in
    Accelerate; DeepSpeed is not supported, so they are ignored with a warning.

    Args:
        accelerator: an ``accelerate.Accelerator`` after ``prepare``.
        output_dir: the save directory; ignored with ``automatic_checkpoint_naming``
            (``{project_dir}/checkpoints``, as Accelerate does).
        safe_serialization: accepted for Accelerate's signature; see above.
        checkpointer_options: keyword arguments of :class:`~shardpoint.Checkpointer`
            (``upload_to``, ``keep_every``, ``config``, ...); ``keep_last`` defaults to
            ``ProjectConfiguration.total_limit``.
        **save_model_func_kwargs: accepted for Accelerate's signature; ignored (warned).

    Returns:
        The checkpoint's directory, ``<save directory>/checkpoint_<iteration>``.

    Raises:
        ForeignDataError: ``checkpoint_<iteration>`` exists and shardpoint did not write it
            (e.g. Accelerate's own save); nothing was written or deleted. Set
            ``accelerator.project_configuration.iteration`` past it, or save elsewhere.

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
    if save_model_func_kwargs:
        log.warning("save_state: %s ignored (DeepSpeed's save arguments)", sorted(save_model_func_kwargs))
    config = accelerator.project_configuration
    root = _save_directory(accelerator, output_dir, "save_state")
    state = _train_state(accelerator)
    with _checkpointer(accelerator, root, checkpointer_options) as ckpt:
        path = ckpt.save(config.iteration, state)
    config.iteration += 1
    return path


def load_state(
    accelerator: Any,
    input_dir: str | os.PathLike[str] | None = None,
    load_kwargs: Mapping | None = None,
    *,
    checkpointer_options: Mapping | None = None,
    **load_model_func_kwargs: Any,
) -> LoadResult | None:
    """Load what ``accelerator.load_state`` loads from a shardpoint checkpoint; every process calls it.

    Takes ``Accelerator.load_state``'s arguments. Of ``load_model_func_kwargs``,
    ``strict`` (``model.load_state_dict``'s) is honoured; ``map_location`` is checked as
    Accelerate checks it (``None``, ``"cpu"`` or ``"on_device"``) and needs nothing
    more: tensors load into the live ones, and optimizer state lands beside its
    parameter, where ``Optimizer.load_state_dict`` moves it in Accelerate too. Other
    keys (DeepSpeed's load arguments) and ``load_kwargs`` (``torch.load``'s, such as
    ``weights_only``) are ignored with a warning: nothing is ever unpickled.

    Args:
        accelerator: the ``Accelerator``, after ``prepare`` and ``register_for_checkpointing``
            of the same objects as the run that saved.
        input_dir: one ``checkpoint_N`` directory, or a save directory (its latest
            checkpoint is loaded). Loaded as given, automatic naming or not; without it,
            automatic naming loads the latest of ``{project_dir}/checkpoints``.
        load_kwargs: accepted for Accelerate's signature; ignored (warned).
        checkpointer_options: as for :func:`save_state` (``verify``, ``config``, ...).
        **load_model_func_kwargs: ``strict``, ``map_location``; see above.

    Returns:
        What was loaded (``result.iteration``, ``result.path``, ...), or None when
        ``input_dir`` is None and ``{project_dir}/checkpoints`` holds no checkpoint yet (a fresh start).

    Raises:
        ValueError: no ``input_dir`` and no automatic naming, or it does not exist.
        TypeError: ``map_location`` is not one Accelerate accepts.
        ForeignDataError: ``input_dir`` holds no shardpoint checkpoint (another tool's
            files, e.g. Accelerate's own save); the message names what it holds.
        CorruptCheckpointError: a file of the checkpoint is missing or changed (named).
    """
    if getattr(accelerator, "_load_model_state_pre_hook", None):
        log.warning("load_state: hooks registered with register_load_state_pre_hook are not called")
    strict = _load_arguments(load_kwargs, load_model_func_kwargs)
    root, iteration = _load_source(accelerator, input_dir)
    state = _train_state(accelerator)
    with _checkpointer(accelerator, root, checkpointer_options) as ckpt:
        result = ckpt.load(state, iteration=iteration, strict=strict)
    if result is not None:
        accelerator.step = int(result.extra.get("step", accelerator.step))
        accelerator.project_configuration.iteration = result.iteration + 1
    return result


def patch(accelerator: Any, *, checkpointer_options: Mapping | None = None) -> Any:
    """Make ``accelerator.save_state(...)`` / ``load_state(...)`` go through shardpoint; returns ``accelerator``.

    Binds :func:`save_state` and :func:`load_state` on this instance only, so a script's
    calls, with Accelerate's arguments, need no edit. Reversed by :func:`unpatch`;
    patching twice replaces the options.

    Args:
        accelerator: an ``accelerate.Accelerator`` (before or after ``prepare``).
        checkpointer_options: passed to every call (``upload_to``, ``verify``, ...).

    Example:
        >>> accelerator = patch(Accelerator(project_config=ProjectConfiguration(
        ...     project_dir="runs/x", automatic_checkpoint_naming=True)))
        >>> accelerator.save_state(safe_serialization=True)   # runs/x/checkpoints/checkpoint_0
    """
    options = dict(checkpointer_options or {})
    for name, function in (("save_state", save_state), ("load_state", load_state)):
        partial = functools.partial(_call_with_options, function, accelerator, options)
        bound = functools.update_wrapper(partial, function)
        bound.__shardpoint__ = True  # type: ignore[attr-defined]  # a marker: functions take attributes at run time
        setattr(accelerator, name, bound)
    return accelerator


def unpatch(accelerator: Any) -> Any:
    """Give ``accelerator`` back Accelerate's own ``save_state`` / ``load_state``; returns it."""
    for name in ("save_state", "load_state"):
        if getattr(vars(accelerator).get(name), "__shardpoint__", False):
            delattr(accelerator, name)
    return accelerator


def _call_with_options(function: Any, accelerator: Any, options: Mapping, *args: Any, **kwargs: Any) -> Any:
    """A patched method: the patch's Checkpointer options, unless the call names its own."""
    kwargs.setdefault("checkpointer_options", options)
    return function(accelerator, *args, **kwargs)


def _load_arguments(load_kwargs: Mapping | None, model_kwargs: Mapping[str, Any]) -> bool:
    """Check Accelerate's extra load arguments; returns ``strict``. See :func:`load_state`."""
    extra = dict(model_kwargs)
    location = extra.pop("map_location", None)
    if location not in MAP_LOCATIONS:
        raise TypeError(
            f"Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or `'on_device'` "
            f"(got {location!r}); as in Accelerate's load_state"
        )
    strict = bool(extra.pop("strict", True))
    ignored = sorted(extra) + ([f"load_kwargs {sorted(load_kwargs)}"] if load_kwargs else [])
    if ignored:
        log.warning("load_state: %s ignored (nothing is unpickled; DeepSpeed is not supported)", ignored)
    return strict


def _load_source(accelerator: Any, input_dir: str | os.PathLike[str] | None) -> tuple[str, int | None]:
    """``(save directory, iteration or None for its latest)`` that ``load_state(input_dir)`` reads.

    ``input_dir`` is loaded as given (a ``checkpoint_N``, or a save directory holding
    shardpoint checkpoints); without it, the automatic-naming save directory.
    """
    if input_dir is None:
        return _save_directory(accelerator, None, "load_state"), None
    path = os.path.abspath(os.path.expanduser(os.fspath(input_dir)))
    if not os.path.isdir(path):
        raise ValueError(f"load_state: {path} does not exist; pass a save directory or one of its checkpoint_N")
    if common.is_shardpoint_checkpoint(path):
        return common.locate(path, LAYOUT)
    if os.path.exists(os.path.join(path, LAYOUT.tracker_name)) or any(
        LAYOUT.parse_dir_name(name) is not None and common.is_shardpoint_checkpoint(os.path.join(path, name))
        for name in os.listdir(path)
    ):
        return path, None
    raise _not_shardpoint(path)


def _not_shardpoint(path: str) -> CheckpointError:
    """The error for a ``load_state`` directory that holds no shardpoint checkpoint, naming what it holds."""
    names = sorted(os.listdir(path))
    if not names:
        return CheckpointError(
            f"load_state: {path} is empty: there is no checkpoint to load; pass the directory save_state wrote, "
            "or pass no input_dir (with automatic_checkpoint_naming) to start fresh when there is none"
        )
    shown = ", ".join(names[:5]) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")
    return ForeignDataError(
        f"load_state: {path} is not a shardpoint checkpoint and holds none (no {MARKER_NAME}; it holds {shown}). "
        "A directory written by Accelerate's own save_state is loaded by Accelerate's load_state "
        "(shardpoint.integrations.accelerate.unpatch(accelerator) first); otherwise pass a checkpoint_N that "
        "shardpoint's save_state wrote, or its save directory"
    )


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
        return os.path.abspath(os.path.join(accelerator.project_dir, "checkpoints"))
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
