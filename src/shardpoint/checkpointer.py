"""The Checkpointer: sequences policy, format, integrity and the commit protocol.

A save, on every rank (see :mod:`shardpoint.commit` for why this order is safe)::

    collect state -> rank 0 creates a temporary directory -> every rank writes its
    files -> every rank checksums its files -> rank 0 writes shardpoint.json and
    renames the directory into place -> rank 0 replaces the tracker -> retention

A load: rank 0 picks the checkpoint (tracker, or ``iteration=N``) and reads its
marker, everyone receives that one answer, checks config and integrity, and the
format fills the live tensors in place.

Each step that can fail locally runs under :func:`shardpoint._comm.agree`, so a
failure on one rank is raised on all ranks instead of leaving the others waiting in
a collective.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardpoint import _comm, commit, faults
from shardpoint._version import __version__
from shardpoint.async_save import BackgroundWrite, SnapshotBuffers
from shardpoint.discovery import LoadSources, verify_share
from shardpoint.errors import (
    ConfigMismatchError,
    MissingKeysError,
    StorageError,
)
from shardpoint.formats import FormatContext, Loaded, get_format
from shardpoint.formats.base import read_torch_file, write_torch_file
from shardpoint.layout import Layout, get_layout
from shardpoint.lock import DirectoryLock
from shardpoint.metadata import CheckpointMetadata
from shardpoint.naming import Rename
from shardpoint.node_local import detect as detect_nodes
from shardpoint.policy import AnySaveDecision, BestN, EveryNMinutes, EveryNSteps, KeepEvery, LatestN, PreservationPolicy
from shardpoint.rank_local import RESHARD_POLICIES
from shardpoint.replicas import check_replicas
from shardpoint.retention import apply_retention
from shardpoint.state import (
    MODEL_PREFIX,
    OPTIM_PREFIX,
    FlatState,
    ParamIndex,
    TrainState,
    collect,
    load_optimizer_shards,
    restore,
)
from shardpoint.storage import Storage, as_storage_error, open_storage
from shardpoint.topology import Topology
from shardpoint.upload import RemoteMirror

__all__ = ["VALIDATION_FILE", "Checkpointer", "LoadResult"]

log = logging.getLogger(__name__)

VALIDATION_FILE = "validation_logits.pt"


@dataclass
class _PendingSave:
    """A save between its start and its commit (the whole of it for sync saves)."""

    iteration: int | None
    final: str
    flat: FlatState
    metrics: dict[str, float]
    extra: dict[str, Any]
    update_tracker: bool
    start: float = field(default_factory=time.perf_counter)
    ctx: FormatContext | None = None  # set once the temporary directory exists
    needed: int = 0
    writer: BackgroundWrite | None = None
    attachments: dict[str, Any] = field(default_factory=dict)  # extra files this rank writes (validation logits)
    check_replicas: bool = True  # compare declared replicas by hash (optimizer scalars are always compared)


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
    storage: Storage | None = field(default=None, repr=False)

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
            (``dist`` format); see :mod:`shardpoint.async_save`.
        config: the model's defining arguments, stored as JSON and compared on load.
        allow_config_mismatch: config keys that may differ between save and load.
        verify: check file checksums on load (sizes are always checked).
        thread_count: writer threads per rank for the ``dist`` format.
        upload_to: local-first mode: after each local commit, copy the checkpoint to
            this ``s3://`` prefix in the background and move the remote tracker when the
            upload is complete (see :mod:`shardpoint.upload`).
        node_local: whether ``path`` is a different, unshared directory on each node
            (with ``upload_to``); None finds out with a probe file at construction
            (see :mod:`shardpoint.node_local`).
        replica_check_interval: compare tensors that several ranks hold (declared
            replicas) by hash on the first save and every N-th save after it (1: every
            save, 0: never); a mismatch stops the save. See :mod:`shardpoint.replicas`.

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
        thread_count: int = 1,
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
        self.topology = topology or Topology(1, 1, _comm.world_size())
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
        self.thread_count = thread_count
        self.replica_check_interval = replica_check_interval
        self._saves_started = 0
        self.async_save = async_save
        self._async_group = _comm.new_group() if async_save else None
        self._buffers = SnapshotBuffers()
        self._pending: _PendingSave | None = None
        self.last_stall_seconds = 0.0
        self.last_background_seconds = 0.0
        self.last_save_seconds = 0.0
        self.total_save_seconds = 0.0
        self.last_saved_iteration: int | None = None
        self._last_save_time = time.time()
        self.mirror = RemoteMirror(upload_to, self.layout, self.preservation) if upload_to else None
        self._node = detect_nodes(self.storage, self.root, self.layout, node_local, self.mirror is not None)
        remote = (self.mirror.storage, self.mirror.root) if self.mirror else (None, None)
        self._sources = LoadSources(self.storage, self.root, self.layout, *remote, self._node)
        self._owns_dir = self._node.is_leader if self._node else _comm.rank() == 0  # creates, commits, cleans
        # object stores have no flock: one writer per prefix is the user's to ensure there
        self._lock = DirectoryLock(self.root) if self.storage.is_local else None
        self._cleaned = False
        if self._owns_dir and self._lock is not None and self.storage.is_dir(self.root):
            self._clean_leftovers_if_unlocked()

    def _clean_leftovers_if_unlocked(self) -> None:
        """Remove partial saves of dead jobs, unless a live job owns the directory (its saves are not ours).

        Without a lock (object storage) only a job that saves cleans, at its first save:
        a job that only loads must not delete another job's save in progress.
        """
        if self._lock.try_acquire():
            try:
                commit.clean_leftovers(self.storage, self.root)
            finally:
                self._lock.release()

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
        decision = self.save_policy.should_save(iteration, time.time(), self._last_save_time)
        if self._time_based:
            decision = _comm.broadcast(decision)
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
        path = self._write(
            iteration, flat, metrics or {}, state.extra, background=self.async_save, attachments=attachments
        )
        self.last_saved_iteration = iteration
        if self.async_save:
            self.last_stall_seconds = time.perf_counter() - start
            log.info("async save of %s: training resumed after %.3f s", path, self.last_stall_seconds)
        return path

    def save_release(self, state: TrainState, *, update_tracker: bool = True) -> str:
        """Save model weights only into ``release/``; loading it enters finetune mode."""
        self._finalize(blocking=True)
        flat = collect(state, iteration=0, include_optimizer=False, include_rng=False)
        return self._write(None, flat, {}, state.extra, update_tracker=update_tracker)

    def wait(self) -> None:
        """Block until a pending async save is written and committed (raises its error, if any)."""
        self._finalize(blocking=True)

    def close(self) -> None:
        """Commit a pending async save and release the directory's writer lock."""
        try:
            self._finalize(blocking=True)
        finally:
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write(
        self,
        iteration: int | None,
        flat: FlatState,
        metrics: Mapping[str, float],
        extra: Mapping[str, Any],
        update_tracker: bool = True,
        background: bool = False,
        attachments: Mapping[str, Any] | None = None,
    ) -> str:
        flat.common["config"] = self.config
        name = self.layout.dir_name(iteration)
        pending = _PendingSave(
            iteration, self.storage.join(self.root, name), flat, dict(metrics), dict(extra), update_tracker
        )
        interval = self.replica_check_interval
        pending.check_replicas = interval > 0 and self._saves_started % interval == 0
        self._saves_started += 1
        pending.attachments = {k: _detached_copy(v) for k, v in (attachments or {}).items()}
        if background:
            pending.flat = self._buffers.snapshot(flat)
            pending.writer = BackgroundWrite(lambda: self._open_and_write(pending, self._async_group)).start()
            self._pending = pending
            return pending.final
        try:
            records: Any = self._open_and_write(pending, None)
            error = None
        except Exception as exc:  # noqa: BLE001 - agreed on and re-raised on every rank by _finish
            records, error = None, exc
        return self._finish(pending, records, error)

    def _open_and_write(self, pending: _PendingSave, group: Any) -> dict[str, Any]:
        """Collective over ``group``: rank 0 creates the temporary directory, then every rank writes.

        Runs on the background thread for async saves, with a group of its own, so the
        trainer's collectives never interleave with these.
        """
        rank = _comm.rank()
        name = self.layout.dir_name(pending.iteration)
        replicas = _comm.agree(
            lambda: check_replicas(pending.flat, group, check_declared=pending.check_replicas),
            "comparing replicated tensors",
            group,
        )
        pending.needed = replicas.deduplicated_bytes
        if self._node is not None:  # each node's leader creates its own
            tmp = self._node.begin(lambda: self._begin(name, pending.needed), group)
        else:
            tmp = _comm.broadcast(
                _comm.agree(
                    lambda: self._begin(name, pending.needed) if rank == 0 else None,
                    "preparing the checkpoint directory",
                    group,
                ),
                group=group,
            )
        pending.ctx = FormatContext(
            self.storage,
            tmp,
            self.topology,
            thread_count=self.thread_count,
            distributed_optimizer=pending.flat.common.get("distributed_optimizer", False),
            process_group=group,
        )
        return self._write_files(pending)

    def _finish(self, pending: _PendingSave, records: Any, error: BaseException | None) -> str:
        """Collective: agree on the outcome of the writes, then rank 0 commits and applies retention."""
        rank = _comm.rank()
        tmp = pending.ctx.directory if pending.ctx is not None else None

        def outcome() -> Any:
            if error is not None:
                raise error
            return records

        try:
            records = _comm.agree(outcome, "writing checkpoint data")
            all_records = _comm.gather_to(records, 0)
            seconds = time.perf_counter() - pending.start
            meta = self._metadata(pending.iteration, all_records, pending.metrics, pending.extra, seconds)
            if self._node is not None:  # node parts, no local tracker; the remote commit follows the upload
                self._node.commit(tmp, pending.final, records, meta, self.preservation)
            else:
                _comm.agree(
                    lambda: self._commit(tmp, pending.final, meta, pending.update_tracker) if rank == 0 else None,
                    "committing the checkpoint",
                )
        except BaseException:
            if self._owns_dir and tmp is not None:
                self.storage.remove(tmp)
            raise
        if rank == 0 and self._node is None:
            apply_retention(self.storage, self.root, self.layout, self.preservation)
        self._record_timing(pending.start, meta, pending.final)
        if self.mirror is not None:
            marker = meta.to_json().encode()
            self.mirror.start(pending.final, list(records), pending.iteration, marker, pending.update_tracker)
        return pending.final

    def _finalize(self, blocking: bool) -> None:
        """Commit the pending async save, then the pending upload, once every rank is done with it."""
        self._finalize_save(blocking)
        if self.mirror is not None:
            self.mirror.poll(blocking)

    def _finalize_save(self, blocking: bool) -> None:
        pending = self._pending
        if pending is None or pending.writer is None:
            return
        if blocking:
            pending.writer.wait()
        elif not all(_comm.all_gather(pending.writer.done())):
            return
        pending.writer.wait()
        self._pending = None
        self.last_background_seconds = pending.writer.seconds
        self._finish(pending, pending.writer.result, pending.writer.error)
        log.info("async save %s committed; background write took %.2f s", pending.final, pending.writer.seconds)

    def _begin(self, name: str, needed: int) -> str:
        if self._lock is not None and not self._lock.held:
            self._lock.acquire()
            commit.clean_leftovers(self.storage, self.root)
        elif self._lock is None and not self._cleaned:
            commit.clean_leftovers(self.storage, self.root)
        self._cleaned = True
        free = self.storage.free_bytes(self.root)
        if free is not None and needed > free:
            raise StorageError(
                f"not enough space to save {name} under {self.root}: about {needed / 1e9:.2f} GB needed, "
                f"{free / 1e9:.2f} GB free; free space, lower keep_last, or save elsewhere"
            )
        return commit.begin(self.storage, self.root, name)

    def _write_files(self, pending: _PendingSave) -> dict[str, Any]:
        """This rank's files and their records (runs on the background thread for async saves)."""
        rank = _comm.rank()
        ctx = pending.ctx
        try:
            faults.hit("before-data", rank)
            records = self.format.save(ctx, pending.flat)
            for name, obj in pending.attachments.items():
                records[name] = write_torch_file(obj, self.storage.join(ctx.directory, name), self.storage)
            faults.hit("mid-data", rank)
            faults.hit("after-data", rank)
        except (OSError, RuntimeError) as exc:
            storage_error = as_storage_error(exc, ctx.directory, pending.needed)
            if storage_error is None:
                raise
            raise storage_error from exc
        return records

    def _metadata(
        self,
        iteration: int | None,
        all_records: Sequence[dict] | None,
        metrics: Mapping[str, float],
        extra: Mapping[str, Any],
        seconds: float,
    ) -> CheckpointMetadata:
        files = {k: v for records in (all_records or []) for k, v in records.items()}
        return CheckpointMetadata(
            iteration=iteration or 0,
            format=self.format.name,
            topology=self.topology.describe(),
            release=iteration is None,
            layout=self.layout.name,
            config=self.config,
            files=files,
            consumed_samples=_optional_int(extra.get("consumed_samples")),
            flops=_optional_float(extra.get("flops")),
            metrics=_finite_metrics(metrics),
            validation_logits=VALIDATION_FILE if VALIDATION_FILE in files else None,
            wall_time=time.time(),
            save_seconds=seconds,
            library_version=__version__,
        )

    def _commit(self, tmp: str, final: str, meta: CheckpointMetadata, update_tracker: bool) -> None:
        faults.hit("before-marker", 0)
        commit.publish(self.storage, tmp, final, meta)
        faults.hit("before-tracker", 0)
        if update_tracker:
            commit.write_tracker(self.storage, self.root, self.layout, None if meta.release else meta.iteration)

    def _record_timing(self, start: float, meta: CheckpointMetadata, final: str) -> None:
        self.last_save_seconds = time.perf_counter() - start
        self.total_save_seconds += self.last_save_seconds
        self._last_save_time = time.time()
        if _comm.rank() == 0:
            gb = meta.total_bytes / 1e9
            log.info(
                "saved %s (%s format, %.3f GB) in %.2f s, %.2f GB/s",
                final,
                meta.format,
                gb,
                self.last_save_seconds,
                gb / max(self.last_save_seconds, 1e-9),
            )

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

        Keys are the model's own names whatever wraps it (see :mod:`shardpoint.naming`).
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
        verify = self.verify if verify is None else verify
        rank = _comm.rank()
        found = _comm.broadcast(
            _comm.agree(
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
            storage, path, self.topology, strict=strict, optimizer_reshard=optimizer_reshard, rename=rename
        )
        # every file some rank reads, split over all ranks (each rank's own list may differ: torch format)
        files = sorted(set().union(*_comm.all_gather(fmt.files_to_read(ctx, meta))))
        _comm.agree(lambda: verify_share(storage, path, meta, files, verify), "verifying checkpoint files")
        flat = collect(
            state,
            iteration=meta.iteration,
            include_optimizer=load_optimizer and not finetune,
            include_rng=False,
            init_optimizer=True,
        )
        loaded = fmt.load(ctx, flat, meta)
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


def _detached_copy(value: Any) -> Any:
    """Attachments are written later (async saves): keep what they were at the call."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, Mapping):
        return {k: _detached_copy(v) for k, v in value.items()}
    return value


def _json_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config as plain JSON values; it is stored in shardpoint.json, never pickled."""
    try:
        return json.loads(json.dumps(dict(config or {}), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Checkpointer config must hold JSON values (numbers, strings, lists, dicts): {exc}") from None


def _finite_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Metrics as stored in JSON; a NaN or infinite one (a diverging run) is dropped, never the save."""
    kept = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
    if len(kept) < len(metrics):
        log.warning("not recording non-finite metrics %s", sorted(set(metrics) - set(kept)))
    return kept


def _optional_int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _optional_float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
