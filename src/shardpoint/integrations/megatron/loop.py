"""Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` (and async finalize), done by shardpoint.

The replacements keep Megatron's signatures (core_v0.16.1) and return values, read
Megatron's own flags from ``get_args()``, and hand the job's objects to a
:class:`~shardpoint.Checkpointer` as a :class:`~shardpoint.TrainState` (see
:mod:`.state`). Megatron's loop still decides *when* to save (``--save-interval``, the
exit signal handler, ``--exit-interval``, ``--exit-duration-in-mins``, the final save)
and times the save outside its throughput, as with its own saves.

Flag by flag (:data:`HONOURED`, :data:`NOT_APPLICABLE`):

* ``--save`` / ``--load`` / ``--pretrained-checkpoint`` (loaded in finetune mode when
  ``--load`` has none), ``--finetune``, ``--no-load-optim``, ``--no-load-rng``,
  ``--ckpt-step``, ``--exit-on-missing-checkpoint``: the same meaning.
* ``--no-save-optim``: no optimizer or scheduler state; ``--no-save-rng``: not the
  tensor-parallel tracker (the process-wide streams are always recorded, and cost nothing).
* ``--async-save``: ``Checkpointer(async_save=True)``; the commit happens in Megatron's
  ``maybe_finalize_async_save`` hook, in the next save, or at the end.
* ``--save-retain-interval N``: keep the newest checkpoint and every N-th.
* ``--non-persistent-save-interval`` with ``--non-persistent-ckpt-type local``:
  shardpoint's local tier in ``--non-persistent-local-ckpt-dir``, with
  ``--replication-factor`` - 1 copies on other nodes when ``--replication`` is given
  (none otherwise, as in Megatron); a load takes the newest iteration complete across
  all ranks in any tier: a node's own copy, a replica, or the persistent store.
  ``global``: a checkpoint in ``--non-persistent-global-ckpt-dir`` (default
  ``<save>/non_persistent``) of which only the newest is kept.
* ``--dist-ckpt-strictness``: as in Megatron, a key the job asks for and the checkpoint
  lacks is an error under ``assume_ok_unexpected`` (the default) and ``raise_*``, and a
  saved key nothing asks for is skipped, except under ``raise_all``; ``log_*``,
  ``return_*`` and ``ignore_all`` load the keys that match (shardpoint logs the rest).
* ``--use-checkpoint-args``: the model arguments are read from ``megatron_args.json``,
  a committed JSON file in each checkpoint, checked against the marker (never unpickled).
* A Megatron-native checkpoint under ``--load`` (no ``shardpoint.json``) is loaded by
  Megatron's own ``load_checkpoint``; the run then saves with shardpoint into another
  ``--save`` directory (the same one is refused before loading, see :meth:`Session._load_native`).
* Optimizers: megatron-core's ``DistributedOptimizer`` and, without
  ``--use-distributed-optimizer``, its ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``
  (:mod:`.plain_optimizer`); any other is refused by name before anything is written.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from typing import Any

import xxhash

from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.catalog.untrusted_json import parse_json_object
from shardpoint.checkpointer import Checkpointer
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.parallel.topology import Topology
from shardpoint.state.train_state import TrainState

from .objects import OBJECTS_FILE, encode, encode_rank, restore, saved_objects
from .rerun import rerun_state, restore_rerun_state
from .state import MegatronModel, MegatronRng, optimizer_state, unwrap
from .vocab import VOCAB_ARGS, VocabPadding, padding_for, saved_vocab, vocab_config

__all__ = ["ARGS_FILE", "HONOURED", "NOT_APPLICABLE", "NativeCheckpointError", "Session"]

log = logging.getLogger(__name__)

ARGS_FILE = "megatron_args.json"
TRACKER = "latest_checkpointed_iteration.txt"
HONOURED = [
    "save",
    "load",
    "save_interval",
    "no_save_optim",
    "no_load_optim",
    "no_save_rng",
    "no_load_rng",
    "finetune",
    "pretrained_checkpoint",
    "exit_on_missing_checkpoint",
    "ckpt_step",
    "async_save",
    "non_persistent_save_interval",
    "non_persistent_ckpt_type",
    "non_persistent_local_ckpt_dir",
    "replication",
    "replication_factor",
    "save_retain_interval",
    "use_checkpoint_args",
    "dist_ckpt_strictness",
]
# accepted and logged once: shardpoint always writes in parallel and plans per save
NOT_APPLICABLE = ("ckpt_fully_parallel_save", "ckpt_fully_parallel_load", "ckpt_assume_constant_structure")
MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups")
# --dist-ckpt-strictness -> Checkpointer.load(strict=). Megatron's "unexpected" keys are the ones the job asks
# for and the checkpoint lacks (shardpoint's "missing"); its "missing" ones are saved keys nothing asks for.
_STRICT: dict[str, bool | str] = {"assume_ok_unexpected": "missing", "raise_unexpected": "missing", "raise_all": True}


def strictness(args: argparse.Namespace) -> bool | str:
    """``strict=`` for ``--dist-ckpt-strictness`` (``log_*``, ``return_*``, ``ignore_all``: load what matches)."""
    return _STRICT.get(str(getattr(args, "dist_ckpt_strictness", None) or "assume_ok_unexpected"), False)


def config_options(args: argparse.Namespace) -> dict[str, Any]:
    """``config`` and ``allow_config_mismatch`` of the Checkpointers: a load compares the model's arguments only.

    A checkpoint ``convert --from megatron`` imported records all of Megatron's args,
    which differ from run to run. Without ``--group-query-attention`` Megatron ignores
    ``--num-query-groups`` (every head is its own group; ``--use-checkpoint-args`` may
    change it), so it is compared only with grouped-query attention.
    """
    config = {k: getattr(args, k, None) for k in MODEL_ARGS if _is_json(getattr(args, k, None))}
    config.update(vocab_config(args))  # recorded for a resume at another tp (see .vocab), never compared
    allowed = (set(vars(args)) | set(VOCAB_ARGS)) - set(MODEL_ARGS)
    if not getattr(args, "group_query_attention", False):
        allowed.add("num_query_groups")
    return {"config": config, "allow_config_mismatch": sorted(allowed)}


def _args_json(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron's args as JSON (values JSON cannot hold are written as their ``repr``)."""
    return {k: v if _is_json(v) else repr(v) for k, v in sorted(vars(args).items())}


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _topology() -> Topology:
    from megatron.core import parallel_state as ps

    def group(getter: str) -> Any:
        g = getattr(ps, getter)()
        return g if g is not None and g.size() > 1 else None

    return Topology.from_groups(
        tp_group=group("get_tensor_model_parallel_group"),
        pp_group=group("get_pipeline_model_parallel_group"),
        dp_group=group("get_data_parallel_group"),
        ep_group=group("get_expert_model_parallel_group"),
        etp_group=group("get_expert_tensor_parallel_group"),
        edp_group=group("get_expert_data_parallel_group"),
    )


def committed_dir(root: str | None) -> str | None:
    """The directory the tracker under ``root`` points at (a local path), or None."""
    if not root or not os.path.isfile(os.path.join(root, TRACKER)):
        return None
    with open(os.path.join(root, TRACKER)) as f:
        tag = f.read().strip()
    name = "release" if tag == "release" else f"iter_{int(tag):07d}" if tag.isdigit() else tag
    return os.path.join(root, name)


def is_shardpoint(root: str | None) -> bool:
    """Whether the checkpoint the tracker under ``root`` names was written by shardpoint (local paths)."""
    found = committed_dir(root)
    return found is not None and os.path.isfile(os.path.join(found, MARKER_NAME))


class Session:
    """One job's Checkpointers (built on first use, collectively) and the replaced functions."""

    def __init__(self, options: dict[str, Any], original: dict[str, Any] | None = None, get_args: Any = None):
        """``get_args``: where Megatron's args come from (default ``megatron.training.get_args``);
        a megatron-core loop without Megatron-LM's training code passes its own."""
        self.options = dict(options)
        self.original = original or {}  # Megatron's own functions, for native checkpoints
        self.get_args = get_args or _megatron_args
        self.checkpointers: dict[str, Checkpointer] = {}
        self.last_load: Any = None  # the LoadResult of the last load_checkpoint (tier, source, path)
        self._logged = False

    # --------------------------------------------------------------- plumbing
    def _log_flags(self, args: argparse.Namespace) -> None:
        if self._logged:
            return
        self._logged = True
        ignored = [f"--{n.replace('_', '-')}" for n in NOT_APPLICABLE if getattr(args, n, False)]
        if ignored:
            log.warning("shardpoint: %s accepted and not used (shardpoint always saves in parallel)", " ".join(ignored))

    def checkpointer(self, args: argparse.Namespace, path: str, **extra: Any) -> Checkpointer:
        if path not in self.checkpointers:
            options = {
                "topology": _topology(),
                "async_save": bool(getattr(args, "async_save", False)),
                **config_options(args),
                **self._retention(args, path),
                **self.options,
                **extra,
            }
            self.checkpointers[path] = Checkpointer(path, **options)
        return self.checkpointers[path]

    @staticmethod
    def _retention(args: argparse.Namespace, path: str) -> dict[str, Any]:
        retain = getattr(args, "save_retain_interval", None)
        if retain and path == args.save:
            return {"keep_last": 1, "keep_every": int(retain)}
        return {}

    @staticmethod
    def _local_options(args: argparse.Namespace) -> dict[str, Any]:
        interval = getattr(args, "non_persistent_save_interval", None)
        if interval and getattr(args, "non_persistent_ckpt_type", None) == "local":
            local = getattr(args, "non_persistent_local_ckpt_dir", None)
            if not local:
                raise CheckpointError(
                    "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir (a node-local path)"
                )
            # Megatron keeps copies on other nodes only with --replication (--replication-factor counts the original)
            replication = getattr(args, "replication", False)
            replicas = int(getattr(args, "replication_factor", 2) or 1) - 1 if replication else 0
            return {"local_dir": local, "local_interval": int(interval), "local_replicas": replicas}
        return {}

    def main(self, args: argparse.Namespace) -> Checkpointer:
        """The Checkpointer of ``--save`` (with the local tier when asked)."""
        return self.checkpointer(args, args.save, **self._local_options(args))

    @staticmethod
    def state(
        model: Any,
        optimizer: Any,
        scheduler: Any,
        args: argparse.Namespace,
        saving: bool,
        vocab: VocabPadding | None = None,
    ) -> TrainState:
        chunks = model if isinstance(model, (list, tuple)) else [model]
        with_optim = not (args.no_save_optim if saving else False)
        stateful = {} if saving and getattr(args, "no_save_rng", False) else {"megatron_rng": MegatronRng()}
        view = MegatronModel(list(chunks), vocab)
        return TrainState(
            model=view,
            optimizer=optimizer_state(optimizer, view) if with_optim and optimizer is not None else None,
            scheduler=scheduler if with_optim else None,
            stateful=stateful,
        )

    # ------------------------------------------------------------------ save
    def save_checkpoint(
        self,
        iteration: int,
        model: Any,
        optimizer: Any,
        opt_param_scheduler: Any,
        num_floating_point_operations_so_far: float,
        checkpointing_context: Any = None,
        pipeline_rank: Any = None,
        expert_rank: Any = None,
        tensor_rank: Any = None,
        pipeline_parallel: Any = None,
        expert_parallel: Any = None,
        non_persistent_ckpt: bool = False,
        train_data_iterator: Any = None,
        preprocess_common_state_dict_fn: Any = None,
        release: bool = False,
        tp_group: Any = None,
        pp_group: Any = None,
        dp_cp_group: Any = None,
    ) -> None:
        """Megatron's ``save_checkpoint``, written by shardpoint (same signature, returns None)."""
        args = self.get_args()
        self._log_flags(args)
        state = self.state(model, optimizer, opt_param_scheduler, args, saving=True)
        state.extra.update(_progress(args, num_floating_point_operations_so_far))
        # rank 0's args (other ranks differ in rank and local_rank): one writer per file
        files = {ARGS_FILE: json.dumps(_args_json(args), indent=1).encode()} if _rank() == 0 else None
        ckpt = self.main(args)
        rerun = rerun_state(train_data_iterator)  # {} unless a rerun is pending (as Megatron's)
        if non_persistent_ckpt and ckpt.local_tier is not None:  # this rank's objects, in its own copy
            own = encode_rank(_chunks(model), rerun)
            ckpt.local_tier.save(iteration, state, files={OBJECTS_FILE: own} if own is not None else None)
            return
        objects = encode(_chunks(model), rerun)  # every rank: extra and rerun state, gathered on rank 0
        if files is not None and objects is not None:
            files[OBJECTS_FILE] = objects
        if non_persistent_ckpt:
            root = getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(args.save, "non_persistent")
            ckpt = self.checkpointer(args, root, keep_last=1)
        if release:
            ckpt.save_release(state)
            return
        ckpt.save(iteration, state, files=files)

    # ------------------------------------------------------------------ load
    def load_checkpoint(
        self,
        ddp_model: Any,
        optimizer: Any,
        opt_param_scheduler: Any,
        load_arg: str = "load",
        strict: bool = True,
        checkpointing_context: Any = None,
        skip_load_to_model_and_opt: bool = False,
        tp_group: Any = None,
        pp_group: Any = None,
        dp_cp_group: Any = None,
    ) -> tuple[int, float]:
        """Megatron's ``load_checkpoint``: returns ``(iteration, num_floating_point_operations_so_far)``."""
        args = self.get_args()
        self._log_flags(args)
        load_dir = getattr(args, load_arg, None)
        pretrained = getattr(args, "pretrained_checkpoint", None)
        if pretrained and not _has_checkpoint(load_dir):
            load_dir, args.finetune = pretrained, True
        if load_dir and committed_dir(load_dir) and not is_shardpoint(load_dir):
            return self._load_native(args, load_dir, ddp_model, optimizer, opt_param_scheduler, load_arg, strict)
        result = None
        if load_dir:
            ckpt = self.main(args) if load_dir == args.save else self.checkpointer(args, load_dir)
            vocab = _vocab_padding(load_dir, args)
            result = ckpt.load(
                self.state(ddp_model, optimizer, opt_param_scheduler, args, saving=False, vocab=vocab),
                iteration=getattr(args, "ckpt_step", None),
                finetune=bool(args.finetune),
                load_optimizer=not args.no_load_optim,
                load_rng=not args.no_load_rng,
                strict=strictness(args),
            )
            if vocab is not None and result is not None:
                vocab.fill_model()  # when the optimizer was not loaded (it fills first otherwise)
            if result is not None and os.path.isdir(result.path):  # persistent, or this rank's local-tier copy
                self._restore_objects(args, ddp_model, result)
        self.last_load = result
        if result is None:
            if getattr(args, "exit_on_missing_checkpoint", False):
                log.error("shardpoint: --exit-on-missing-checkpoint and no checkpoint in %s: exiting", load_dir)
                sys.exit()
            return 0, 0
        return self._after_load(args, result)

    @staticmethod
    def _restore_objects(args: argparse.Namespace, model: Any, result: Any) -> None:
        """The modules' extra state, and the rerun state machine's where Megatron restores it (not in a
        finetune or from a release; :func:`.rerun.restore_rerun_state` checks the layout)."""
        saved = saved_objects(result.path)
        restore(_chunks(model), result.path, strict=strictness(args) in (True, "missing"), saved=saved)
        if not (args.finetune or result.release or result.finetune):
            restore_rerun_state(saved, result.path)

    def _load_native(
        self, args: Any, load_dir: str, model: Any, optimizer: Any, scheduler: Any, load_arg: str, strict: bool
    ) -> tuple[int, float]:
        """A Megatron-native checkpoint: Megatron-LM's own ``load_checkpoint`` reads it; saves go on with shardpoint.

        Refused before anything is read when ``--save`` is that same directory: shardpoint
        never replaces another tool's tracker (the native run's own resume would then find
        a checkpoint it cannot read), so the run's first save would fail after training.
        """
        if args.save and os.path.realpath(args.save) == os.path.realpath(load_dir):
            raise NativeCheckpointError(
                f"--save {args.save} holds a Megatron-native checkpoint: shardpoint never replaces another tool's "
                f"tracker, so this run could not save there. Keep --load {load_dir} and pass a new --save directory"
            )
        native = self.original.get("load_checkpoint")
        if native is None:  # a megatron-core loop without Megatron-LM's training code
            raise NativeCheckpointError(
                f"{load_dir} holds a Megatron-native checkpoint (no shardpoint.json), and this job has no "
                "Megatron-LM training code (megatron.training) to read it: import it once with "
                f"`shardpoint convert --from megatron {load_dir} DST` and load DST"
            )
        log.warning("shardpoint: %s holds a Megatron-native checkpoint: loaded by Megatron itself", load_dir)
        return native(model, optimizer, scheduler, load_arg=load_arg, strict=strict)

    @staticmethod
    def _after_load(args: argparse.Namespace, result: Any) -> tuple[int, float]:
        extra = result.extra or {}
        checkpointing = _training_module("checkpointing")
        if not (args.finetune or result.release or result.finetune):
            args.consumed_train_samples = int(extra.get("consumed_train_samples", 0))
            args.skipped_train_samples = int(extra.get("skipped_train_samples", 0))
            args.consumed_valid_samples = int(extra.get("consumed_valid_samples", 0))
            if checkpointing is not None:  # Megatron-LM's loop: its microbatch calculator follows the samples
                from megatron.core.num_microbatches_calculator import update_num_microbatches

                update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
        if checkpointing is not None:
            checkpointing.set_checkpoint_version(3.0)
            checkpointing.set_loaded_iteration(result.iteration)
        flops = 0 if result.iteration == 0 else float(extra.get("flops", 0.0))
        log.info("shardpoint: loaded %s at iteration %d", result.path, result.iteration)
        return result.iteration, flops

    # -------------------------------------------------------- async finalize
    def maybe_finalize_async_save(self, blocking: bool = False, terminate: bool = False) -> None:
        """Megatron's async finalize hook: commit what every rank has written; at the end, close."""
        for ckpt in list(self.checkpointers.values()):
            if terminate:
                ckpt.close()
            elif blocking:
                ckpt.wait()
            else:
                ckpt.poll()
        if terminate:
            self.checkpointers.clear()
        native = self.original.get("maybe_finalize_async_save")
        if native is not None:
            native(blocking=blocking, terminate=terminate)  # a native async save before ours (none usually)

    # ---------------------------------------------------- --use-checkpoint-args
    def load_args_from_checkpoint(self, args: argparse.Namespace, load_arg: str = "load", **kw: Any) -> Any:
        """``--use-checkpoint-args`` from ``megatron_args.json`` (JSON, no unpickling, no collectives)."""
        root = getattr(args, load_arg, None)
        if not is_shardpoint(root):
            return self.original["load_args_from_checkpoint"](args, load_arg=load_arg, **kw)
        from megatron.training import checkpointing

        found = committed_dir(root)
        if found is None:  # is_shardpoint found it a moment ago: the tracker was replaced meanwhile
            raise CheckpointError(f"{root}: the tracker no longer names a checkpoint; is another job saving here?")
        saved, iteration = saved_args(found)
        state = {"args": saved, "iteration": iteration, "checkpoint_version": 3.0}
        original = checkpointing._load_base_checkpoint
        checkpointing._load_base_checkpoint = lambda *a, **k: (state, found, False, None)
        try:
            return self.original["load_args_from_checkpoint"](args, load_arg=load_arg, **kw)
        finally:
            checkpointing._load_base_checkpoint = original


def saved_args(found: str) -> tuple[argparse.Namespace, int]:
    """Megatron's args and the iteration of the shardpoint checkpoint ``found``, from ``megatron_args.json``.

    The file is read only as the marker lists it, with its size and XXH3 checksum
    (invariant 16), and parsed as JSON: a changed byte is named, never taken for args.

    Raises:
        CorruptCheckpointError: the file is not listed, or differs from what was saved.
    """
    marker = os.path.join(found, MARKER_NAME)
    with open(marker, "rb") as f:
        meta = CheckpointMetadata.from_json(f.read(), marker)
    record = meta.files.get(ARGS_FILE)
    if record is None:
        raise CorruptCheckpointError(
            f"{found}: {ARGS_FILE} is not listed in {MARKER_NAME}: --use-checkpoint-args needs a checkpoint saved "
            "by shardpoint's Megatron integration; drop the flag and give the model arguments"
        )
    with open(os.path.join(found, ARGS_FILE), "rb") as f:
        raw = f.read(record.size + 1)
    if len(raw) != record.size or xxhash.xxh3_64(raw).hexdigest() != record.xxh3_64:
        raise CorruptCheckpointError(
            f"{os.path.join(found, ARGS_FILE)} differs from what was saved (size {len(raw)}, expected {record.size}, "
            "or its checksum): it is damaged; load another checkpoint or drop --use-checkpoint-args"
        )
    values = parse_json_object(raw, os.path.join(found, ARGS_FILE), "Megatron args")
    return argparse.Namespace(**values), int(meta.iteration or 0)


class NativeCheckpointError(CheckpointError):
    """A Megatron-native checkpoint under ``--load`` that this job cannot read without Megatron-LM's training code."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _megatron_args() -> argparse.Namespace:
    from megatron.training import get_args

    return get_args()


def _training_module(name: str) -> Any:
    """``megatron.training.<name>`` when Megatron-LM's training code is importable, else None."""
    try:
        return importlib.import_module(f"megatron.training.{name}")
    except ImportError:
        return None


def _chunks(model: Any) -> list[Any]:
    """The model chunks inside their DDP / Float16Module wrappers."""
    return [unwrap(c) for c in (model if isinstance(model, (list, tuple)) else [model])]


def _vocab_padding(load_dir: str, args: argparse.Namespace) -> VocabPadding | None:
    """Rows to trim or pad when the checkpoint to load (the tracker's, or ``--ckpt-step``'s) has another
    padded vocabulary (local directories; elsewhere a tp change that moves the padding stays refused)."""
    step = getattr(args, "ckpt_step", None)
    found = os.path.join(load_dir, f"iter_{int(step):07d}") if step is not None else committed_dir(load_dir)
    saved = saved_vocab(found)
    return padding_for(found, saved, args) if found and saved else None


def _has_checkpoint(root: str | None) -> bool:
    return bool(root and os.path.isfile(os.path.join(root, TRACKER)))


def _progress(args: argparse.Namespace, flops: float) -> dict[str, Any]:
    return {
        "consumed_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
        "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
        "skipped_train_samples": int(getattr(args, "skipped_train_samples", 0) or 0),
        "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
        "flops": float(flops or 0.0),
    }
