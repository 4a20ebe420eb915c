"""Megatron-LM's own training loop (``pretrain()``) checkpointing through shardpoint.

From the command line, ``pretrain_gpt.py`` unchanged::

    torchrun --nproc-per-node 8 -m shardpoint.integrations.megatron pretrain_gpt.py ARGS

or from a script, before ``pretrain()`` runs::

    from shardpoint.integrations import megatron
    megatron.install(keep_last=3)           # any Checkpointer option

``install`` replaces ``save_checkpoint``, ``load_checkpoint``, ``load_args_from_checkpoint``
and the async finalize where Megatron uses them: ``megatron.training.training`` (and
``initialize``, ``async_utils``) import them by name, so patching only
``megatron.training.checkpointing`` would change nothing. Megatron is imported only
when ``install`` runs; this package imports without it. Megatron's
``--ckpt-format`` takes a fixed list of choices, so shardpoint cannot be a value of it:
it comes in by this launcher instead. What each flag does is in :mod:`.loop`.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from shardpoint.errors import FrameworkMissingError
from shardpoint.integrations import missing_framework

from .loop import HONOURED, NOT_APPLICABLE, Session

__all__ = ["HONOURED", "NOT_APPLICABLE", "install", "installed", "uninstall"]

# (module, attribute, replacement method of Session)
_TARGETS = (
    ("megatron.training.checkpointing", "save_checkpoint", "save_checkpoint"),
    ("megatron.training.training", "save_checkpoint", "save_checkpoint"),
    ("megatron.training.checkpointing", "load_checkpoint", "load_checkpoint"),
    ("megatron.training.training", "load_checkpoint", "load_checkpoint"),
    ("megatron.training.async_utils", "maybe_finalize_async_save", "maybe_finalize_async_save"),
    ("megatron.training.training", "maybe_finalize_async_save", "maybe_finalize_async_save"),
    ("megatron.training.checkpointing", "load_args_from_checkpoint", "load_args_from_checkpoint"),
    ("megatron.training.initialize", "load_args_from_checkpoint", "load_args_from_checkpoint"),
)
_SESSION: list[Session] = []
_SAVED: list[tuple[Any, str, Any]] = []


def install(**checkpointer_options: Any) -> Session:
    """Make Megatron-LM's loop save and load through shardpoint; options go to every ``Checkpointer``.

    Idempotent per process (a second call replaces the options). Returns the session,
    whose ``checkpointers`` are the live :class:`~shardpoint.Checkpointer` objects.
    """
    uninstall()
    modules = {name: _import(name) for name, _, _ in _TARGETS}
    original = {
        "save_checkpoint": modules["megatron.training.checkpointing"].save_checkpoint,
        "load_checkpoint": modules["megatron.training.checkpointing"].load_checkpoint,
        "load_args_from_checkpoint": modules["megatron.training.checkpointing"].load_args_from_checkpoint,
        "maybe_finalize_async_save": modules["megatron.training.async_utils"].maybe_finalize_async_save,
    }
    session = Session(checkpointer_options, original)
    for name, attr, method in _TARGETS:
        _SAVED.append((modules[name], attr, getattr(modules[name], attr)))
        setattr(modules[name], attr, getattr(session, method))
    _SESSION.append(session)
    return session


def _import(name: str) -> Any:
    """A module of Megatron; its absence is named with what installs it.

    megatron-core is a package (the ``megatron`` extra); Megatron-LM's training code
    (``megatron.training``) is not: it comes from a Megatron-LM tree on ``PYTHONPATH``,
    or the folder of the script the launcher runs.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if not _has_megatron_core():
            raise missing_framework(exc, "megatron", "megatron") from exc
        raise FrameworkMissingError(
            f"shardpoint.integrations.megatron needs Megatron-LM's training code ({exc.name}), which is not a package: "
            "put a Megatron-LM tree (e.g. tag core_v0.16.1) on PYTHONPATH, or run its pretrain_gpt.py through "
            "`python -m shardpoint.integrations.megatron`",
            name=exc.name,
        ) from exc


def _has_megatron_core() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no ``megatron`` at all
        return False


def installed() -> Session | None:
    """The active session, or None."""
    return _SESSION[-1] if _SESSION else None


def uninstall() -> None:
    """Put Megatron's own functions back."""
    while _SAVED:
        module, attr, value = _SAVED.pop()
        setattr(module, attr, value)
    _SESSION.clear()
