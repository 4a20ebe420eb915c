"""Lightning checkpoints through shardpoint: :class:`ShardpointCheckpointIO`.

Usage (nothing else changes)::

    from shardpoint.integrations.lightning import ShardpointCheckpointIO

    trainer = Trainer(
        plugins=[ShardpointCheckpointIO(async_save=True)],  # any Checkpointer options
        strategy="ddp",  # or ModelParallelStrategy(...), or one device
        callbacks=[ModelCheckpoint(dirpath="runs/ckpt", every_n_train_steps=100, save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")

**Why a CheckpointIO alone is not enough, and what the plugin hooks into.** Lightning
calls a ``CheckpointIO`` from ``Strategy.save_checkpoint`` on global rank 0 only, and
``ModelParallelStrategy`` does not call it at all (it runs DCP itself). A sharded save
needs every rank. So when Lightning hands this plugin to a strategy (the
``Strategy.checkpoint_io`` setter, which the plugin wraps once per process; Lightning
calls it while building the ``Trainer``), the plugin adapts that one strategy object:
its class becomes a subclass carrying the methods of :class:`_ShardpointStrategy`, which

* sends ``save_checkpoint`` and ``load_checkpoint`` to the plugin on every rank;
* restores after the strategy's setup (``restore_checkpoint_after_setup``), also
  under DDP, so that the optimizer exists and one load fills model and optimizer in
  place; Lightning's own ``load_model_state_dict`` / ``load_optimizer_state_dict``
  then have nothing left to do, as under ``ModelParallelStrategy``;
* gives Lightning's checkpoint dict references to the live weights and optimizer
  state instead of the gathered CPU copies ``ModelParallelStrategy`` would make (the
  plugin saves the model and optimizer themselves);
* commits a pending async save at ``teardown`` (which ``ModelParallelStrategy`` does not
  forward to its CheckpointIO).

``remove_checkpoint`` is left as Lightning has it: rank 0 calls the plugin, which
retires the directory the way shardpoint's own retention does.

**Where checkpoints go.** Each path ``ModelCheckpoint`` chooses (``D/epoch=0-step=4.ckpt``,
``D/last.ckpt``) becomes one committed shardpoint checkpoint directory at that path: a
:class:`~shardpoint.checkpointer.Checkpointer` rooted at ``D`` with the layout
:func:`~shardpoint.catalog.layout.named` writes into a temporary directory, renames it
into place with its ``shardpoint.json`` and then writes the tracker ``D/.<name>.latest``.
A save that dies leaves nothing under the final name, so ``ckpt_path="last"`` never
meets a half-written checkpoint. The Checkpointers of ``D`` share its writer lock, so at
most one holds it: the plugin closes the others (committing their async saves) before a
save, and keeps the two most recent open so that ``last.ckpt`` reuses its staging
memory and save plan.

**What is saved.** The model (``DTensor`` shards under ``ModelParallelStrategy``) and its
optimizer as a :class:`~shardpoint.state.train_state.TrainState`, in shardpoint's sharded
format, reshardable; per-rank RNG (restored on a resumed ``fit``, which Lightning's own
checkpoints do not do); and the rest of Lightning's dict (``epoch``, ``global_step``,
``loops``, ``callbacks``, ``lr_schedulers``, hyperparameters, ``on_save_checkpoint``
additions) as ``extra``: rank 0's, as in Lightning's own files, stored with the
checkpoint and read back with ``torch.load(weights_only=True)``, never unpickling an
object. Values there that such a load could not read are refused when saving.

**Differences from Lightning's own checkpointing, each with its reason:**

* a checkpoint is a directory, not a ``.ckpt`` file: every rank writes its own shards;
* the weights are loaded in place into the live (possibly sharded) tensors before
  Lightning's restore; ``checkpoint["state_dict"]`` then holds those live tensors under
  the saved keys (a saved key the model lacks as a ``meta`` tensor of its saved shape),
  so Lightning's ``LightningModule.load_state_dict(..., strict=strict_loading)`` names
  missing and unexpected keys as for its own files, and an ``on_load_checkpoint`` that
  edits the dict applies (a renamed key the model lacks cannot be: it was not read).
  Under ``ModelParallelStrategy``, as in Lightning's own, the load itself is strict or not;
* ``ddp_spawn`` / ``ddp_notebook``: each spawned rank saves and loads as under ``ddp``; the
  weights their launcher hands back to the main process through the CheckpointIO (on one
  rank, not a checkpoint) are written, read and removed as Lightning's own file;
  ``FSDPStrategy`` and ``DeepSpeedStrategy`` are refused (their own
  sharded files); one optimizer only;
* paths are local, ``s3://``, ``gs://``, ``az://`` or any other fsspec URL (``memory://``, ...:
  served through fsspec with a warning naming what it cannot guarantee; see
  :mod:`shardpoint.storage.fsspec_store`); a scheme no filesystem serves is refused by name
  (:func:`_check_url`);
* a checkpoint Lightning wrote itself (a ``.ckpt`` file, or ``ModelParallelStrategy``'s DCP
  folder) given as ``ckpt_path`` is read and applied by Lightning's own code, so a running
  project switches to the plugin and resumes; its later saves are shardpoint's;
* each rank's RNG is restored on a resumed ``fit``, which Lightning's own files do not do.

**Inference and fine-tuning:** ``MyModel.load_from_checkpoint("runs/ckpt/last.ckpt")`` works
on a checkpoint directory once this module is imported (weights at full size and the
hyperparameters; see :mod:`shardpoint.integrations.lightning_load`), or call
:func:`load_checkpoint_dict` for the dict itself.
"""

from __future__ import annotations

import copy
import logging
import os
import posixpath
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from shardpoint.integrations import missing_framework

try:
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
        Strategy,
    )
    from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
except ModuleNotFoundError as exc:
    raise missing_framework(exc, "lightning", "lightning") from exc

from shardpoint.catalog.layout import named
from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.checkpointer import Checkpointer
from shardpoint.errors import CheckpointError, CheckpointNotFoundError
from shardpoint.integrations.lightning_load import install_load_hook, load_checkpoint_dict, saved_state_dict
from shardpoint.lifecycle import commit
from shardpoint.parallel import comm
from shardpoint.parallel.topology import Topology
from shardpoint.state.sharding import is_dtensor
from shardpoint.state.train_state import TrainState
from shardpoint.storage.base import open_storage
from shardpoint.storage.fsspec_store import is_fsspec_url
from shardpoint.storage.object_store import is_object_url

__all__ = ["ShardpointCheckpointIO", "load_checkpoint_dict"]

log = logging.getLogger(__name__)

# Checkpointer options that Lightning decides: ModelCheckpoint names the paths, says when to save and what to keep
_DECIDED = {
    "layout": "ModelCheckpoint names every checkpoint",
    "save_interval": "ModelCheckpoint(every_n_train_steps=...) decides when to save",
    "save_interval_minutes": "ModelCheckpoint(train_time_interval=...) decides when to save",
    "keep_last": "ModelCheckpoint(save_top_k=...) decides what to keep",
    "keep_every": "ModelCheckpoint(save_top_k=...) decides what to keep",
    "keep_best": "ModelCheckpoint(save_top_k=..., monitor=...) decides what to keep",
    "topology": "it is read from the strategy (its device mesh under ModelParallelStrategy)",
    "upload_to": "ModelCheckpoint's removals would not reach the remote copies",
    "node_local": "it only applies with upload_to",
}
_TENSOR_KEYS = ("state_dict", "optimizer_states")  # what the plugin saves from the live objects instead
_OPEN_CHECKPOINTERS = 2  # last.ckpt and the newest top-k name
_HANDBACK_NAME = ".temp.ckpt"  # lightning.pytorch.strategies.launchers.multiprocessing names it so
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)


class ShardpointCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves sharded, committed, checksummed shardpoint checkpoints.

    Pass it as ``Trainer(plugins=[ShardpointCheckpointIO(**checkpointer_options)])``;
    the options go to every :class:`~shardpoint.checkpointer.Checkpointer` it makes
    (``async_save``, ``config``, ``verify``, ``format``, ...). How it takes part on every
    rank is in the module docstring.

    Raises:
        ValueError: an option Lightning decides was given (the message says what decides it).
    """

    def __init__(self, **checkpointer_options: Any):
        super().__init__()
        refused = sorted(set(checkpointer_options) & set(_DECIDED))
        if refused:
            reasons = "; ".join(f"{k}: {_DECIDED[k]}" for k in refused)
            raise ValueError(f"ShardpointCheckpointIO does not take {refused} ({reasons})")
        self.options = dict(checkpointer_options)
        self.strategy: Strategy | None = None
        self._topology: Topology | None = None
        self._open: OrderedDict[str, Checkpointer] = OrderedDict()
        self.stock_loaded = False  # the last load read a checkpoint Lightning wrote: Lightning applies it
        _hook_attach()

    # ------------------------------------------------------------ attaching
    def connect(self, strategy: Strategy) -> None:
        """Adapt ``strategy`` so that every rank saves and loads through this plugin (see the module docstring).

        Called by Lightning's ``Strategy.checkpoint_io`` setter, which the plugin wraps.

        Raises:
            ValueError: the strategy is one this plugin cannot serve, or the plugin already serves another.
        """
        _check_strategy(strategy)
        if self.strategy is not None and self.strategy is not strategy:
            raise ValueError("a ShardpointCheckpointIO serves one Trainer; make one per Trainer")
        if type(strategy) not in _ORIGINAL:
            strategy.__class__ = _adapted(type(strategy))
        self.strategy = strategy

    # --------------------------------------------------------------- saving
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Save Lightning's ``checkpoint`` as the shardpoint checkpoint directory ``path``; every rank calls this.

        Raises:
            CheckpointError: a value outside the weights and optimizer state is not plain
                data (named in the message), or the save failed on any rank.
        """
        if storage_options is not None:
            raise TypeError("ShardpointCheckpointIO.save_checkpoint(..., storage_options=...) is not supported")
        if _is_handback(checkpoint):  # ddp_spawn's weights for the main process, on one rank: not a checkpoint
            TorchCheckpointIO().save_checkpoint(checkpoint, path)
            return
        strategy = self._connected()
        path = comm.broadcast(os.fspath(path))  # rank 0's path on every rank, as ModelParallelStrategy does
        # every rank checks its own dict, then all agree (one small all-gather): a dict refused on one
        # rank only must not leave the others waiting in the collective save
        extra = comm.agree(lambda: _saved_extra(checkpoint, path), f"checking the checkpoint dict for {path}")
        state = self._train_state(strategy, with_optimizer="optimizer_states" in checkpoint)
        state.extra = extra
        self._checkpointer(path).save(int(checkpoint["global_step"]), state)
        if not _fitting(strategy):
            self._release(path)  # trainer.save_checkpoint() outside fit: nothing else would close it

    # -------------------------------------------------------------- loading
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the shardpoint checkpoint ``path`` into the live model and optimizer; every rank calls this.

        Returns Lightning's checkpoint dict: what was saved besides the tensors, with
        ``state_dict`` and ``optimizer_states`` referring to the (already filled) live
        objects. A resumed ``fit`` also restores the optimizer and each rank's RNG;
        ``validate``/``test``/``predict`` load the weights only. ``map_location`` and
        ``weights_only`` have no effect: tensors load into the live ones, and nothing is
        ever unpickled.

        Raises:
            CheckpointNotFoundError: nothing at ``path`` (also a ``FileNotFoundError``, as Lightning raises).
            CheckpointError: ``path`` is not a committed shardpoint checkpoint.
            CorruptCheckpointError: a file is damaged (named in the message).
        """
        strategy = self._connected()
        path = comm.broadcast(os.fspath(path))
        _check_url(path)
        self._close_open()  # commit pending saves first: the load may be of one of them
        if is_stock_checkpoint(path):  # a .ckpt file Lightning wrote: Lightning's own reader, applied the stock way
            self.stock_loaded = True
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if "://" not in path and not os.path.exists(path):
            raise _not_a_checkpoint(path)  # before a Checkpointer would create its directory
        module = strategy.lightning_module
        if module is None:  # no model connected yet (the connector's resume_start): the whole dict, as Lightning's
            self.stock_loaded = True  # Lightning applies it
            return load_checkpoint_dict(path, map_location=map_location)
        fitting = _fitting(strategy, running=False)
        state = self._train_state(strategy, with_optimizer=fitting)
        # ModelParallelStrategy decides strictness here, as Lightning's own does; the others leave it to
        # module.load_state_dict(checkpoint["state_dict"], strict=...), which Lightning calls after on_load_checkpoint
        parallel = isinstance(strategy, ModelParallelStrategy)
        result = self._checkpointer(path).load(
            state,
            load_optimizer=state.optimizer is not None,
            load_rng=fitting,
            strict=module.strict_loading if parallel else False,
        )
        if result is None:
            raise _not_a_checkpoint(path)
        loaded = dict(result.extra)
        loaded["state_dict"] = module.state_dict() if parallel else saved_state_dict(module, result)
        if state.optimizer is not None:
            loaded["optimizer_states"] = [state.optimizer.state_dict()]
        return loaded

    # ------------------------------------------------------------- removing
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint directory ``path`` and its tracker (Lightning calls this on rank 0).

        Only a committed shardpoint checkpoint is deleted, through the same rename-then-delete
        as shardpoint's retention; anything else at ``path`` is left alone with a warning.
        """
        if _is_handback_file(os.fspath(path)):  # the main process is done with ddp_spawn's hand-back
            TorchCheckpointIO().remove_checkpoint(path)
            return
        root, name = _split(os.fspath(path))
        storage = open_storage(root)
        target = storage.join(storage.root, name)
        if not storage.exists(target):
            return
        if not storage.exists(storage.join(target, MARKER_NAME)):
            log.warning("not removing %s: it is not a shardpoint checkpoint (no %s)", target, MARKER_NAME)
            return
        commit.retire(storage, storage.root, name)
        tracker = storage.join(storage.root, named(name).tracker_name)
        if storage.exists(tracker):
            storage.remove(tracker)
        log.info("removed %s", target)

    def teardown(self) -> None:
        """Commit a pending async save and let go of the save directories (every rank)."""
        self._close_open()
        self._open.clear()

    # --------------------------------------------------------------- helpers
    def _connected(self) -> Strategy:
        if self.strategy is None:
            raise CheckpointError(
                "ShardpointCheckpointIO is not attached to a strategy: pass it as Trainer(plugins=[...]) "
                "or DDPStrategy(checkpoint_io=...), and use a strategy it supports (see its docstring)"
            )
        return self.strategy

    def _checkpointer(self, path: str) -> Checkpointer:
        """The Checkpointer of ``path``'s directory, the only one of the root holding its writer lock."""
        self._close_open(keep=path)
        ckpt = self._open.pop(path, None)
        if ckpt is None:
            root, name = _split(path)
            ckpt = Checkpointer(root, layout=named(name), topology=self._topology_of(), **self.options)
        self._open[path] = ckpt
        while len(self._open) > _OPEN_CHECKPOINTERS:
            self._open.popitem(last=False)  # already closed: it just lets go of its staging memory
        return ckpt

    def _release(self, path: str) -> None:
        """Close ``path``'s Checkpointer (committing its save), letting go of the directory's writer lock."""
        ckpt = self._open.pop(path, None)
        if ckpt is not None:
            ckpt.close()

    def _close_open(self, keep: str | None = None) -> None:
        """Close every open Checkpointer but ``keep``'s (committing pending saves; same order on every rank)."""
        for path, ckpt in self._open.items():
            if path != keep:
                ckpt.close()

    def _topology_of(self) -> Topology:
        """Built once: its process groups are made on first use and reused by every save."""
        if self._topology is None:
            strategy = self.strategy
            if isinstance(strategy, ModelParallelStrategy):
                self._topology = Topology.from_mesh(strategy.device_mesh)
            else:
                self._topology = Topology(1, 1, comm.world_size())
        return self._topology

    @staticmethod
    def _train_state(strategy: Strategy, with_optimizer: bool) -> TrainState:
        optimizers = list(strategy.optimizers) if with_optimizer else []
        if len(optimizers) > 1:
            raise CheckpointError(
                f"ShardpointCheckpointIO saves one optimizer, but configure_optimizers returned {len(optimizers)}; "
                "combine their parameter groups into one optimizer, or use Lightning's own checkpointing"
            )
        return TrainState(model=strategy.lightning_module, optimizer=optimizers[0] if optimizers else None)


class _ShardpointStrategy:
    """What the strategy a :class:`ShardpointCheckpointIO` serves does differently (see the module docstring).

    Not a base class: :func:`_adapted` copies these into a direct subclass of the
    strategy's class, the only kind of class an object's ``__class__`` may become.
    """

    checkpoint_io: ShardpointCheckpointIO
    lightning_module: Any

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer must exist: one load fills model and optimizer in place

    @property
    def lightning_restore_optimizer(self) -> bool:
        if self.checkpoint_io.stock_loaded:  # a checkpoint Lightning wrote: restored Lightning's way
            return _ORIGINAL[type(self)].lightning_restore_optimizer.fget(self)
        return False  # load_checkpoint already did

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options)  # every rank

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.checkpoint_io.stock_loaded = is_stock_checkpoint(os.fspath(checkpoint_path))
        if self.checkpoint_io.stock_loaded:
            # Lightning's own code reads it (the strategy's load, which hands a file to the plugin,
            # whose load_checkpoint passes it to Lightning's TorchCheckpointIO), so a project can switch
            return _ORIGINAL[type(self)].load_checkpoint(self, checkpoint_path, weights_only=weights_only)
        return self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Lightning's own: module.load_state_dict(checkpoint["state_dict"], strict=strict). After a shardpoint
        # load that dict holds the live, already filled tensors (copying one into itself costs nothing), so the
        # call checks the keys with Lightning's strictness and applies on_load_checkpoint's edits;
        # ModelParallelStrategy's does nothing (its load_checkpoint loaded in place)
        _ORIGINAL[type(self)].load_model_state_dict(self, checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.checkpoint_io.stock_loaded:
            _ORIGINAL[type(self)].load_optimizer_state_dict(self, checkpoint)
        # else: filled in place by load_checkpoint

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.lightning_module.state_dict()  # references, no gathered copy: the plugin saves the model

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return getattr(optimizer, "_optimizer", optimizer).state_dict()  # references, as above

    def teardown(self) -> None:
        self.checkpoint_io.teardown()  # ModelParallelStrategy.teardown does not call it
        _ORIGINAL[type(self)].teardown(self)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # ddp_spawn pickles the Trainer into each process; the adapted class is made at run time, so
        # pickle cannot find it by name: rebuild it from the strategy's own class there
        return (_readapted, (_ORIGINAL[type(self)],), _ORIGINAL[type(self)].__getstate__(self))


_ADAPTED: dict[type, type] = {}  # strategy class -> its adapted subclass
_ORIGINAL: dict[type, Any] = {}  # and back (Any: its methods are called with an adapted strategy as self)


def _adapted(cls: type) -> type:
    """A direct subclass of ``cls`` with the methods of :class:`_ShardpointStrategy`, made once per class."""
    if cls not in _ADAPTED:
        methods = {k: v for k, v in vars(_ShardpointStrategy).items() if not k.startswith("__") or k == "__reduce_ex__"}
        adapted = type(f"Shardpoint{cls.__name__}", (cls,), {**methods, "__module__": __name__})
        _ADAPTED[cls], _ORIGINAL[adapted] = adapted, cls
    return _ADAPTED[cls]


def _readapted(cls: type) -> Any:
    """An adapted ``cls`` strategy to unpickle into (its state follows, through ``__setstate__``)."""
    return object.__new__(_adapted(cls))


def _hook_attach() -> None:
    """Wrap ``Strategy.checkpoint_io``'s setter so that assigning a plugin connects it (once per process).

    Lightning builds the strategy and assigns the plugin to it inside ``Trainer()``;
    there is no other call into a ``CheckpointIO`` before the first save.
    """
    prop = Strategy.__dict__["checkpoint_io"]
    if getattr(prop.fset, "shardpoint_attach", False):
        return
    original = prop.fset

    def fset(strategy: Strategy, io: Any) -> None:
        original(strategy, io)
        if isinstance(io, ShardpointCheckpointIO):
            io.connect(strategy)

    fset.shardpoint_attach = True  # type: ignore[attr-defined]  # a marker: functions take attributes at run time
    # replacing Lightning's property at run time, which its type (a getter and setter) does not allow
    Strategy.checkpoint_io = property(prop.fget, fset, prop.fdel, prop.__doc__)  # type: ignore[assignment]


def _check_strategy(strategy: Strategy) -> None:
    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(
        strategy, (DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy)
    ):
        raise ValueError(
            f"ShardpointCheckpointIO does not support {type(strategy).__name__}: use strategy='ddp', "
            "ModelParallelStrategy (FSDP2 through fully_shard in configure_model) or a single device"
        )


def _is_handback(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` is the weights ``ddp_spawn``/``ddp_notebook``'s launcher sends to the main process.

    Its ``_collect_rank_zero_results`` saves ``lightning_module.state_dict()`` through the
    CheckpointIO on local rank 0 alone, into a fresh temporary directory, and the main
    process loads and removes it: a hand-over between processes, not a checkpoint, so it
    is written as Lightning's own file (no collective, which the other ranks would not
    join). Every dict Lightning saves as a checkpoint carries its version; that one does not.
    """
    return "pytorch-lightning_version" not in checkpoint


def _is_handback_file(path: str) -> bool:
    """The file of :func:`_is_handback`'s hand-over (the launcher's ``<mkdtemp>/.temp.ckpt``)."""
    return "://" not in path and os.path.basename(path) == _HANDBACK_NAME and os.path.isfile(path)


def _saved_extra(checkpoint: Mapping[str, Any], path: str) -> dict[str, Any]:
    """What of Lightning's dict is saved besides the tensors, checked on this rank (see :func:`_check_plain`).

    A copy: Lightning goes on changing some of it (ModelCheckpoint's best_k_models) while an async save writes.
    """
    _check_url(path)
    extra = copy.deepcopy({k: v for k, v in checkpoint.items() if k not in _TENSOR_KEYS})
    try:
        _check_plain(extra, "checkpoint")
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: on rank {comm.rank()}, {exc}") from None
    return extra


def _split(path: str) -> tuple[str, str]:
    """``(save directory, checkpoint name)`` of a checkpoint path, local or an object-store URL."""
    if "://" in path:
        root, name = posixpath.split(path.rstrip("/"))
    else:
        root, name = os.path.split(os.path.abspath(path))
    return root, name


def _check_plain(value: Any, where: str) -> None:
    """Refuse what ``torch.load(weights_only=True)`` could not read back, naming where it is.

    Raises:
        CheckpointError: ``value`` holds an object other than plain data and tensors.
    """
    kind = type(value)
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
    elif kind in (list, tuple, set):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif kind in (torch.Tensor, torch.nn.Parameter) and not is_dtensor(value):
        return
    elif kind not in _PLAIN:
        raise CheckpointError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}; besides the weights and optimizer state, "
            "a shardpoint checkpoint holds plain data only (numbers, strings, lists, dicts, tensors), read back "
            "without unpickling objects: store it as such (e.g. vars(namespace), float(x), str(path))"
        )


def is_stock_checkpoint(path: str) -> bool:
    """Whether ``path`` is a checkpoint Lightning wrote itself: a ``.ckpt`` file, or a DCP folder without our marker.

    A shardpoint checkpoint appears under its final name only with its marker, so a folder
    there with DCP's ``.metadata`` and no marker is ``ModelParallelStrategy``'s own.
    """
    if "://" in path:
        return False
    return os.path.isfile(path) or (
        os.path.isfile(os.path.join(path, ".metadata")) and not os.path.exists(os.path.join(path, MARKER_NAME))
    )


def _check_url(path: str) -> None:
    """Refuse, before any collective, a URL Lightning accepts that no fsspec filesystem here serves.

    Local paths, ``s3://``, ``gs://``, ``az://`` have shardpoint's own backends; any other
    scheme fsspec knows (``memory://``, ``hdfs://``, ...) is served through fsspec, with a
    warning once naming what it cannot guarantee (:mod:`shardpoint.storage.fsspec_store`).
    """
    if "://" in path and not (path.startswith("file://") or is_object_url(path) or is_fsspec_url(path)):
        scheme = path.split("://", 1)[0]
        raise CheckpointError(
            f"{path}: no fsspec filesystem serves {scheme}:// here (is its package installed?); point "
            "ModelCheckpoint(dirpath=...) and default_root_dir at a local path, s3://, gs://, az:// or another "
            "fsspec URL"
        )


def _fitting(strategy: Strategy, running: bool = True) -> bool:
    """Whether the trainer is in ``fit`` (and, with ``running``, inside it: its teardown closes the Checkpointers).

    Read from the module's ``_trainer``, which is None until Lightning attaches the module
    (``model.trainer`` would raise then, e.g. in the connector's ``resume_start`` before ``validate``).
    """
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    state = getattr(trainer, "state", None)
    if state is None or state.fn != TrainerFn.FITTING:
        return False
    return state.status == TrainerStatus.RUNNING or not running


def _not_a_checkpoint(path: str) -> CheckpointError:
    root, name = _split(path)
    storage = open_storage(root)
    target = storage.join(storage.root, name)
    if not storage.exists(target):  # Lightning raises FileNotFoundError here, and users' code catches it
        return CheckpointNotFoundError(  # the path as given, in Lightning's words (its tests and users match them)
            f"Checkpoint file not found: {path} (no shardpoint checkpoint nor file at {target}); pass the path of an "
            "existing checkpoint as ckpt_path, or ckpt_path=None to start afresh"
        )
    if not storage.is_dir(target):
        return CheckpointError(
            f"{target} is a file, not a shardpoint checkpoint (a checkpoint Lightning wrote itself?); load it "
            "with Lightning's default CheckpointIO, or resume from a checkpoint ShardpointCheckpointIO saved"
        )
    return CheckpointError(
        f"{target} holds no committed shardpoint checkpoint (no {MARKER_NAME}: missing, or its save did not "
        "finish); pass another ckpt_path"
    )


install_load_hook()  # Model.load_from_checkpoint(shardpoint directory): see lightning_load
