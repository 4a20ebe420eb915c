"""The Checkpointer: the user's entry point, sequencing policy, saving and loading.

A save: the save policy decides (``maybe_save``), the state is collected into a
:class:`~shardpoint.state.train_state.FlatState`, and :class:`~shardpoint.lifecycle.save_pipeline.SavePipeline`
writes and commits it (see there for the steps, and :mod:`shardpoint.lifecycle.commit` for
why their order is safe); old checkpoints are deleted in the background.

A load: rank 0 picks the checkpoint (tracker, or ``iteration=N``) and reads its
marker, everyone receives that one answer, checks config and integrity, and the
format fills the live tensors in place.

Each step that can fail locally runs under :func:`shardpoint.parallel.comm.agree`, so a
failure on one rank is raised on all ranks instead of leaving the others waiting in
a collective.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardpoint.catalog.layout import Layout, get_layout
from shardpoint.catalog.metadata import CheckpointMetadata
from shardpoint.errors import (
    ConfigMismatchError,
    MissingKeysError,
)
from shardpoint.formats import FormatContext, Loaded, get_format
from shardpoint.formats.base import read_torch_file
from shardpoint.lifecycle.discovery import LoadSources, verify_share, verify_unread
from shardpoint.lifecycle.node_local import detect as detect_nodes
from shardpoint.lifecycle.policy import (
    AnySaveDecision,
    BestN,
    EveryNMinutes,
    EveryNSteps,
    KeepEvery,
    LatestN,
    PreservationPolicy,
)
from shardpoint.lifecycle.save_pipeline import VALIDATION_FILE, SavePipeline
from shardpoint.lifecycle.upload import RemoteMirror
from shardpoint.parallel import comm
from shardpoint.parallel.topology import Topology
from shardpoint.state.naming import Rename
from shardpoint.state.rank_local import RESHARD_POLICIES
from shardpoint.state.train_state import (
    MODEL_PREFIX,
    OPTIM_PREFIX,
    FlatState,
    ParamIndex,
    TrainState,
    collect,
    load_optimizer_shards,
    restore,
)
from shardpoint.storage.base import Storage, open_storage

__all__ = ["VALIDATION_FILE", "Checkpointer", "LoadResult"]

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    """What :meth:`Checkpointer.load` loaded.

    Attributes:
        iteration: the iteration to resume from (0 in finetune mode).
        release: the checkpoint was a release checkpoint.
        path: its directory.
        finetune: optimizer and RNG were not loaded and the iteration restarts at 0.
        extra: the ``TrainState.extra`` saved with it (e.g. ``consumed_samples``).
        metadata: the parsed ``shardpoint.json``.
    """

    iteration: int
    release: bool
    path: str
    finetune: bool
    extra: dict[str, Any]
    metadata: CheckpointMetadata
    storage: Storage | None = field(default=None, repr=False)  # node-local: valid until the next load or close()

    def read_validation_logits(self) -> Any:
        """What was passed as ``validation_logits`` at save (checksum-verified with the rest), or None."""
        if self.metadata.validation_logits is None or self.storage is None:
            return None
        return read_torch_file(self.storage, self.storage.join(self.path, self.metadata.validation_logits))


class Checkpointer:
    """Save and load model-parallel training state with Megatron's semantics.

    Args:
        path: the save directory: a local path, or ``s3://bucket/prefix`` (endpoint and
            credentials from the standard AWS environment, e.g. ``AWS_ENDPOINT_URL``).
        topology: this process's place in the tp × pp × dp layout (default: all 1).
        format: ``"dist"`` (sharded, reshardable, default) or ``"torch"`` (Megatron legacy).
        layout: ``"megatron"`` (``iter_0000100/``) or ``"neox"`` (``global_step100/``).
        save_interval: ``maybe_save`` saves when ``iteration % save_interval == 0``.
        save_interval_minutes: ``maybe_save`` also saves when this much time has passed;
            rank 0's clock decides, so every rank saves at the same iteration.
        keep_last: keep the newest N checkpoints (None keeps all).
        keep_every: also keep every checkpoint whose iteration is a multiple of K.
        keep_best: also keep the N best by a metric: ``(N, "val_loss", "min")``.
        async_save: copy the state to host memory and write it in the background
            (``dist`` format); see :mod:`shardpoint.lifecycle.async_save`.
        config: the model's defining arguments, stored as JSON and compared on load.
        allow_config_mismatch: config keys that may differ between save and load.
        verify: check file checksums on load (sizes are always checked).
        thread_count: writer and reader threads per rank for the ``dist`` format
            (default: twice the cores, at most 4; I/O waits on the disk more than on the CPU).
        upload_to: local-first mode: after each local commit, copy the checkpoint to
            this ``s3://`` prefix in the background and move the remote tracker when the
            upload is complete (see :mod:`shardpoint.lifecycle.upload`).
        node_local: whether ``path`` is a different, unshared directory on each node
            (with ``upload_to``); None finds out with a probe file at construction
            (see :mod:`shardpoint.lifecycle.node_local`).
        replica_check_interval: compare tensors that several ranks hold (declared
            replicas) by hash on the first save and every N-th save after it (1: every
            save, 0: never); a mismatch stops the save. See :mod:`shardpoint.state.replicas`.

    Example:
        >>> ckpt = Checkpointer("runs/gpt", topology=topo, save_interval=100, keep_last=3)
        >>> result = ckpt.load(state)            # None on a fresh start
        >>> start = result.iteration if result else 0
        >>> for it in range(start + 1, iters + 1):
        ...     train_step()
        ...     ckpt.maybe_save(it, state)
        >>> ckpt.close()
    """

    def __init__(
        self,
        path: str,
        *,
        topology: Topology | None = None,
        format: str = "dist",
        layout: str = "megatron",
        save_interval: int | None = None,
        save_interval_minutes: float | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: tuple[int, str, str] | None = None,
        async_save: bool = False,
        config: Mapping[str, Any] | None = None,
        allow_config_mismatch: Iterable[str] = (),
        verify: bool = True,
        thread_count: int | None = None,
        upload_to: str | None = None,
        node_local: bool | None = None,
        replica_check_interval: int = 1,
    ):
        if async_save and format != "dist":
            raise ValueError(f"async_save=True needs format='dist' (got format={format!r})")
        if replica_check_interval < 0:
            raise ValueError(f"replica_check_interval must be >= 0, got {replica_check_interval}")
        self.storage = open_storage(path)
        self.root = self.storage.root
        self.topology = topology or Topology(1, 1, comm.world_size())
        self.format = get_format(format)
        self.layout: Layout = get_layout(layout)
        decisions = [EveryNSteps(save_interval)] if save_interval else []
        if save_interval_minutes:
            decisions.append(EveryNMinutes(save_interval_minutes))
        self._time_based = save_interval_minutes is not None
        self.save_policy = AnySaveDecision(tuple(decisions))
        self.preservation: list[PreservationPolicy] = [
            p
            for p in (
                LatestN(keep_last) if keep_last else None,
                KeepEvery(keep_every) if keep_every else None,
                BestN(*keep_best) if keep_best else None,
            )
            if p is not None
        ]
        self.config = _json_config(config)
        self.allow_config_mismatch = set(allow_config_mismatch)
        self.verify = verify
        self.async_save = async_save
        self.thread_count = thread_count or default_thread_count()
        self.last_saved_iteration: int | None = None
        self.mirror = RemoteMirror(upload_to, self.layout, self.preservation) if upload_to else None
        self._node = detect_nodes(self.storage, self.root, self.layout, node_local, self.mirror is not None)
        remote = (self.mirror.storage, self.mirror.root) if self.mirror else (None, None)
        self._sources = LoadSources(self.storage, self.root, self.layout, *remote, self._node)
        self._saver = SavePipeline(
            self.storage,
            self.root,
            layout=self.layout,
            fmt=self.format,
            topology=self.topology,
            config=self.config,
            preservation=self.preservation,
            thread_count=self.thread_count,
            replica_check_interval=replica_check_interval,
            async_save=async_save,
            node=self._node,
            mirror=self.mirror,
        )

    # what saves cost (see SaveTimes), for trainers that keep it out of their throughput
    last_stall_seconds = property(lambda self: self._saver.times.last_stall_seconds)
    last_background_seconds = property(lambda self: self._saver.times.last_background_seconds)
    last_save_seconds = property(lambda self: self._saver.times.last_save_seconds)
    total_save_seconds = property(lambda self: self._saver.times.total_save_seconds)

    # ----------------------------------------------------------------- saving
    def maybe_save(
        self,
        iteration: int,
        state: TrainState,
        *,
        metrics: Mapping[str, float] | None = None,
        validation_logits: Any = None,
    ) -> bool:
        """Save if the save policy says so at ``iteration``; returns whether it saved.

        ``validation_logits`` may be a callable, called (on every rank) only when a
        save happens, since computing logits costs a forward pass.
        """
        self._finalize(blocking=False)
        decision = self.save_policy.should_save(iteration, time.time(), self._saver.times.last_save_time)
        if self._time_based:
            decision = comm.broadcast(decision)
        if decision and iteration != self.last_saved_iteration:
            self.save(iteration, state, metrics=metrics, validation_logits=validation_logits)
            return True
        return False

    def save(
        self,
        iteration: int,
        state: TrainState,
        *,
        metrics: Mapping[str, float] | None = None,
        validation_logits: Any = None,
    ) -> str:
        """Save now; every rank calls this. Returns the checkpoint directory.

        ``validation_logits`` (GPT-NeoX's forward-pass validation): logits of a fixed
        batch, or a callable returning them, passed by the one rank that holds them
        (None elsewhere). They are stored as ``validation_logits.pt``, checksummed and
        named in ``shardpoint.json``; after a load, compare them with
        :meth:`LoadResult.read_validation_logits`.

        Synchronous saves are committed when this returns. With ``async_save`` this
        returns after copying the state to host memory; the checkpoint is committed by
        a later ``maybe_save``/``save``/``close`` once every rank's files are written.

        Raises:
            StorageError: the disk is full, read-only or not writable; nothing
                committed earlier is touched and the partial files are removed.
            CheckpointError: any rank failed (raised on every rank); with
                ``async_save``, a failure of the previous background save.
        """
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        start = time.perf_counter()
        self._finalize(blocking=True)
        flat = collect(state, iteration=iteration)
        logits = validation_logits() if callable(validation_logits) else validation_logits
        attachments = {VALIDATION_FILE: logits} if logits is not None else {}
        path = self._saver.start(
            iteration, flat, metrics or {}, state.extra, background=self.async_save, attachments=attachments
        )
        self.last_saved_iteration = iteration
        if self.async_save:
            self._saver.times.last_stall_seconds = time.perf_counter() - start
            log.info("async save of %s: training resumed after %.3f s", path, self.last_stall_seconds)
        return path

    def save_release(self, state: TrainState, *, update_tracker: bool = True) -> str:
        """Save model weights only into ``release/``; loading it enters finetune mode."""
        self._finalize(blocking=True)
        flat = collect(state, iteration=0, include_optimizer=False, include_rng=False)
        return self._saver.start(None, flat, {}, state.extra, update_tracker=update_tracker)

    def wait(self) -> None:
        """Block until a pending async save is committed (raising its error, if any) and old ones are deleted."""
        self._finalize(blocking=True)
        self._saver.wait_deletions()

    def close(self) -> None:
        """Commit a pending async save, wait for background deletions, release the directory's writer lock."""
        try:
            self._finalize(blocking=True)
        finally:
            self._saver.close()
            self._sources.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _finalize(self, blocking: bool) -> None:
        """Commit the pending async save, then the pending upload, once every rank is done with it."""
        self._saver.finalize(blocking)
        if self.mirror is not None:
            self.mirror.poll(blocking)

    # ---------------------------------------------------------------- loading
    def load(
        self,
        state: TrainState,
        *,
        iteration: int | None = None,
        finetune: bool = False,
        load_optimizer: bool = True,
        load_rng: bool = True,
        strict: bool = True,
        verify: bool | None = None,
        fallback: bool = False,
        optimizer_reshard: str = "error",
        rename: Rename = None,
    ) -> LoadResult | None:
        """Load the latest checkpoint (or ``iteration``) into ``state``; None when there is none.

        Every rank calls this. A release checkpoint, or ``finetune=True``, loads no
        optimizer, scheduler or RNG and resumes at iteration 0.

        Optimizer state that was saved per rank (not elementwise with its parameter,
        e.g. Adafactor's factored statistics of a sharded weight) is restored exactly
        at the saved layout only. At another layout ``optimizer_reshard="error"``
        (default) raises naming those states; ``"reinit"`` loads everything else and
        re-initialises them to zeros with a warning naming each one.

        Keys are the model's own names whatever wraps it (see :mod:`shardpoint.state.naming`).
        ``rename`` maps saved names onto current ones for checkpoints from before a
        refactor: ``{"old.name": "new.name"}`` or a callable, applied to model names
        (optimizer state follows its parameter); a strict load then names what is
        still missing.

        Raises:
            ConfigMismatchError: the saved config differs (keys named in the message).
            MissingKeysError: ``strict`` and the keys do not match.
            CorruptCheckpointError: a file is missing, truncated or fails its checksum.
            TopologyMismatchError: the checkpoint cannot be loaded at this layout.
        """
        if optimizer_reshard not in RESHARD_POLICIES:
            raise ValueError(f"optimizer_reshard must be one of {RESHARD_POLICIES}, got {optimizer_reshard!r}")
        self._finalize(blocking=True)
        self._saver.wait_deletions()  # a load may name an old iteration that retention is deleting
        verify = self.verify if verify is None else verify
        rank = comm.rank()
        found = comm.broadcast(
            comm.agree(
                lambda: self._sources.find(iteration, verify and fallback) if rank == 0 else None,
                "finding the checkpoint",
            )
        )
        if found is None:
            return None
        where, path, meta_json = found
        meta = CheckpointMetadata.from_json(meta_json, path)
        storage, path = self._sources.reader(where, path, meta, verify)  # local, remote, or node-local + remote
        self._check_config(meta, path)
        finetune = finetune or meta.release
        fmt = get_format(meta.format)
        ctx = FormatContext(
            storage,
            path,
            self.topology,
            strict=strict,
            thread_count=self.thread_count,
            optimizer_reshard=optimizer_reshard,
            rename=rename,
            verify=verify,
        )
        # every file some rank reads, split over all ranks (each rank's own list may differ: torch format);
        # the format checks the checksums of some files as it reads them, in the same pass
        files = sorted(set().union(*comm.all_gather(fmt.files_to_read(ctx, meta))))
        streamed = fmt.checksummed_while_reading(meta) if verify else set()
        comm.agree(lambda: verify_share(storage, path, meta, files, verify, streamed), "verifying checkpoint files")
        flat = collect(
            state,
            iteration=meta.iteration,
            include_optimizer=load_optimizer and not finetune,
            include_rng=False,
            init_optimizer=True,
        )
        loaded = fmt.load(ctx, flat, meta)
        verify_unread(storage, path, meta, streamed, loaded.checked)
        _forget_unsaved_optimizer_state(state, flat, loaded)
        if strict and (loaded.missing or loaded.unexpected):
            raise MissingKeysError(path, loaded.missing, loaded.unexpected)
        if state.optimizer is not None and load_optimizer and not finetune:
            load_optimizer_shards(state.optimizer, flat.tensors)
        if not finetune:
            restore(state, loaded.common, loaded.per_rank if load_rng else None, include_optimizer=load_optimizer)
        log.info("loaded %s (iteration %d%s)", path, meta.iteration, ", finetune" if finetune else "")
        return LoadResult(
            0 if finetune else meta.iteration,
            meta.release,
            path,
            finetune,
            dict(loaded.common.get("extra", {})),
            meta,
            storage,
        )

    def _check_config(self, meta: CheckpointMetadata, path: str) -> None:
        differences = {
            key: (meta.config.get(key), self.config.get(key))
            for key in set(meta.config) | set(self.config)
            if key not in self.allow_config_mismatch and meta.config.get(key) != self.config.get(key)
        }
        if differences and self.config:
            raise ConfigMismatchError(path, differences)


def _forget_unsaved_optimizer_state(state: TrainState, flat: FlatState, loaded: Loaded) -> None:
    """Parameters that had no optimizer state at the save (never stepped, or no gradient yet) are not an error.

    Loading created their state (to have targets to fill); drop it again so they start
    as they would have at the save.
    """
    missing = set(loaded.missing)
    by_param: dict[str, set[str]] = {}
    for key in [*flat.tensors, *flat.rank_local]:
        if key.startswith(OPTIM_PREFIX):
            by_param.setdefault(key[len(OPTIM_PREFIX) :].rsplit(".", 1)[0], set()).add(key)
    unsaved = {param for param, keys in by_param.items() if keys <= missing}
    if not unsaved:
        return
    loaded.missing = [
        k
        for k in loaded.missing
        if not (k.startswith(OPTIM_PREFIX) and k[len(OPTIM_PREFIX) :].rsplit(".", 1)[0] in unsaved)
    ]
    optimizer = state.optimizer
    if isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "sharded_state_dict"):
        index = ParamIndex(state.model, {k: v for k, v in flat.tensors.items() if k.startswith(MODEL_PREFIX)})
        for group in optimizer.param_groups:
            for param in group["params"]:
                if index.lookup(param) in unsaved:
                    optimizer.state.pop(param, None)


def default_thread_count() -> int:
    return max(1, min(4, 2 * (os.cpu_count() or 1)))


def _json_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config as plain JSON values; it is stored in shardpoint.json, never pickled."""
    try:
        return json.loads(json.dumps(dict(config or {}), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Checkpointer config must hold JSON values (numbers, strings, lists, dicts): {exc}") from None
