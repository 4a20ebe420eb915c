"""The Checkpointer: the user's entry point, sequencing policy, saving and loading.

A save: the save policy decides (``maybe_save``), the state is collected into a
:class:`~shardpoint.state.train_state.FlatState`, and :class:`~shardpoint.lifecycle.save_pipeline.SavePipeline`
writes and commits it (see there for the steps, and :mod:`shardpoint.lifecycle.commit` for
why their order is safe); old checkpoints are deleted in the background.

A load: :class:`~shardpoint.lifecycle.load_pipeline.LoadPipeline` finds the checkpoint
(rank 0 decides, everyone receives the one answer), opens its sources, checks the
config and the files, and the format fills the live tensors in place.

With ``local_dir`` there is a second, non-persistent tier (:mod:`shardpoint.tier`):
``maybe_save`` writes it when no persistent save is due, and ``load`` takes the
newest iteration complete across all ranks from either tier.

Each step that can fail locally runs under :func:`shardpoint.parallel.comm.agree`, so a
failure on one rank is raised on all ranks instead of leaving the others waiting in
a collective.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardpoint.catalog.layout import Layout, get_layout
from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.formats import get_format
from shardpoint.lifecycle.discovery import LoadSources
from shardpoint.lifecycle.load_pipeline import LoadOptions, LoadPipeline, LoadResult
from shardpoint.lifecycle.node_local import detect as detect_nodes
from shardpoint.lifecycle.policy import PreservationPolicy, preservation_policies, save_decision
from shardpoint.lifecycle.save_pipeline import VALIDATION_FILE, SavePipeline
from shardpoint.lifecycle.upload import RemoteMirror
from shardpoint.parallel import comm, deadline
from shardpoint.parallel.deadline import DEFAULT_ROUND_TIMEOUT
from shardpoint.parallel.topology import Topology
from shardpoint.state.naming import Rename
from shardpoint.state.train_state import (
    TrainState,
    collect,
)
from shardpoint.storage.base import open_storage
from shardpoint.storage.safe_io import paused_gc
from shardpoint.tier import LocalTier, LocalTierOptions

__all__ = ["VALIDATION_FILE", "Checkpointer", "LoadResult"]

log = logging.getLogger(__name__)


class Checkpointer:
    """Save and load model-parallel training state with Megatron's semantics.

    Args:
        path: the save directory: a local path, or an object-store prefix ``s3://bucket/prefix``,
            ``gs://bucket/prefix`` or ``az://container/prefix`` (credentials and endpoints from each
            store's standard environment, e.g. ``AWS_ENDPOINT_URL``).
        topology: this process's place in the tp × pp × dp layout (default:
            ``Topology(1, 1, world_size)``, every rank a data-parallel replica).
        format: ``"dist"`` (sharded, reshardable, default) or ``"torch"`` (Megatron legacy).
        layout: ``"megatron"`` (``iter_0000100/``) or ``"neox"`` (``global_step100/``).
        save_interval: ``maybe_save`` saves when ``iteration % save_interval == 0``.
        save_interval_minutes: ``maybe_save`` also saves when this much time has passed;
            rank 0's clock decides, so every rank saves at the same iteration.
        keep_last: keep the newest N checkpoints (None keeps all).
        keep_every: also keep every checkpoint whose iteration is a multiple of K.
        keep_best: also keep the N best by a metric: ``(N, "val_loss", "min")``.
        keep: further retention policies (``should_preserve(checkpoints) -> set of iterations``),
            alongside ``keep_*``: a checkpoint any policy keeps survives. Integrations use it
            to apply a framework's own rule (the Trainer's ``save_total_limit``).
        async_save: copy the state to host memory and write it in the background
            (``dist`` format); see :mod:`shardpoint.lifecycle.async_save`.
        config: the model's defining arguments, stored as JSON and compared on load.
        allow_config_mismatch: config keys that may differ between save and load.
        verify: check file checksums on load (sizes are always checked).
        thread_count: writer and reader threads per rank for the ``dist`` format
            (default: twice the cores, at most 4; I/O waits on the disk more than on the CPU).
        upload_to: local-first mode: after each local commit, copy the checkpoint to this ``s3://``, ``gs://``
            or ``az://`` prefix (or a shared directory) in the background, then move the remote tracker.
        node_local: whether ``path`` is a different, unshared directory on each node (with ``upload_to``);
            None finds out with a probe file (:mod:`shardpoint.lifecycle.node_local`).
        replica_check_interval: compare tensors that several ranks hold (declared
            replicas) by hash on the first save and every N-th save after it (1: every
            save, 0: never); a mismatch stops the save. See :mod:`shardpoint.state.replicas`.
        local_dir: the non-persistent tier: a node-local path (NVMe, or RAM such as ``/dev/shm/run``) where
            ``maybe_save`` writes a checkpoint every ``local_interval`` steps, asynchronously; an iteration
            due for both tiers is saved persistently only. See :mod:`shardpoint.tier`.
        local_interval: steps between local checkpoints (needs ``local_dir``).
        local_keep: local checkpoints kept on each node, replicas included.
        local_replicas: copies of each rank's files held by ranks on other nodes, sent
            over shardpoint's gloo group in the background (no shared filesystem).
        round_timeout: seconds each collective round waits for every rank before raising
            ``CheckpointTimeoutError`` naming the missing ones (see :mod:`shardpoint.parallel.deadline`).
        dedup: store a parameter that is not trained (``requires_grad=False``, or in no group of
            a ``torch.optim`` optimizer over the model's parameters) once: a save whose frozen
            tensors are unchanged since this process's last committed save refers to their
            stored bytes instead of writing them again (local ``dist`` saves; see
            :mod:`shardpoint.formats.dedup`). False writes every tensor at every save.

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
        layout: str | Layout = "megatron",
        save_interval: int | None = None,
        save_interval_minutes: float | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: tuple[int, str, str] | None = None,
        keep: Sequence[PreservationPolicy] = (),
        async_save: bool = False,
        config: Mapping[str, Any] | None = None,
        allow_config_mismatch: Iterable[str] = (),
        verify: bool = True,
        thread_count: int | None = None,
        upload_to: str | None = None,
        node_local: bool | None = None,
        replica_check_interval: int = 1,
        local_dir: str | None = None,
        local_interval: int | None = None,
        local_keep: int = 2,
        local_replicas: int = 1,
        round_timeout: float | None = DEFAULT_ROUND_TIMEOUT,
        dedup: bool = True,
    ):
        if async_save and format != "dist":
            raise ValueError(f"async_save=True needs format='dist' (got format={format!r})")
        if replica_check_interval < 0:
            raise ValueError(f"replica_check_interval must be >= 0, got {replica_check_interval}")
        deadline.set_round_timeout(round_timeout)
        comm.control_group()  # collective: created here, on every rank in the same order
        self.storage = open_storage(path)
        self.root = self.storage.root
        self.topology = topology or Topology(1, 1, comm.world_size())
        self.format = get_format(format)
        self.layout: Layout = get_layout(layout)
        self._time_based = save_interval_minutes is not None
        self.save_policy = save_decision(save_interval, save_interval_minutes)
        self.preservation = [*preservation_policies(keep_last, keep_every, keep_best), *keep]
        self.config = _json_config(config)
        self.verify = verify
        self.async_save = async_save
        self.dedup = dedup
        self.thread_count = thread_count or default_thread_count()
        self.last_saved_iteration: int | None = None
        self.mirror = RemoteMirror(upload_to, self.layout, self.preservation) if upload_to else None
        self._node = detect_nodes(self.storage, self.root, self.layout, node_local, self.mirror is not None)
        self._loader = _load_pipeline(self, allow_config_mismatch)
        self._saver = _save_pipeline(self, replica_check_interval)
        self.local_tier = _local_tier(local_dir, local_interval, local_keep, local_replicas, self, self.topology)

    # what saves cost (see SaveTimes), for trainers that keep it out of their throughput
    last_stall_seconds = property(lambda self: self._saver.times.last_stall_seconds)
    last_background_seconds = property(lambda self: self._saver.times.last_background_seconds)
    last_save_seconds = property(lambda self: self._saver.times.last_save_seconds)
    total_save_seconds = property(lambda self: self._saver.times.total_save_seconds)
    # host memory this rank keeps for staging (the async snapshot, GPU tensors of sync saves)
    staging_bytes = property(lambda self: self._saver.staging.nbytes)
    # what local-tier saves cost (stall, write, replication), None without local_dir
    local_times = property(lambda self: self.local_tier.times if self.local_tier else None)

    # ----------------------------------------------------------------- saving
    def maybe_save(
        self,
        iteration: int,
        state: TrainState,
        *,
        metrics: Mapping[str, float] | None = None,
        validation_logits: Any = None,
    ) -> bool:
        """Save if the save policy says so at ``iteration``; returns whether it saved (either tier).

        A persistent save when ``save_interval`` is due; otherwise, with ``local_dir``, a
        local-tier save when ``local_interval`` is due (asynchronous, with its replicas).

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
        if self.local_tier is not None and self.local_tier.is_due(iteration):
            self.local_tier.save(iteration, state)  # non-persistent, in the background
            return True
        return False

    def save(
        self,
        iteration: int,
        state: TrainState,
        *,
        metrics: Mapping[str, float] | None = None,
        validation_logits: Any = None,
        files: Mapping[str, bytes] | None = None,
    ) -> str:
        """Save now; every rank calls this. Returns the checkpoint directory.

        ``validation_logits`` (GPT-NeoX's forward-pass validation): logits of a fixed
        batch, or a callable returning them, passed by the one rank that holds them
        (None elsewhere). They are stored as ``validation_logits.pt``, checksummed and
        named in ``shardpoint.json``; after a load, compare them with
        :meth:`LoadResult.read_validation_logits`.

        ``files``: small files, ``{name: bytes}``, written into the checkpoint directory
        beside the data, checksummed and listed in ``shardpoint.json``, so they are
        committed with it: a framework's own metadata (the Hugging Face ``Trainer``'s
        ``trainer_state.json``). Passed by the rank that writes them (None elsewhere).

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
        logits = validation_logits() if callable(validation_logits) else validation_logits
        attachments = {VALIDATION_FILE: logits} if logits is not None else {}
        attachments.update(_checked_files(files))
        with paused_gc():  # a save builds objects per tensor: at thousands, full collections cost more
            flat = collect(state, iteration=iteration)
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
        """Block until a pending async save (and local-tier save, replicas included) is committed and old ones deleted.

        Raises the error of a failed background save, if any.
        """
        self._finalize(blocking=True)
        self._saver.wait_deletions()

    def poll(self) -> None:
        """Commit a pending async (or local-tier) save whose files every rank has written, without waiting.

        Collective: every rank calls it at the same point (a training loop's per-step hook,
        such as Megatron's ``maybe_finalize_async_save(blocking=False)``).
        """
        self._finalize(blocking=False)

    def close(self) -> None:
        """Commit pending async and local-tier saves, wait for background deletions, release the writer lock."""
        try:
            self._finalize(blocking=True)
        finally:
            self._saver.close()
            self._loader.close()
            if self.mirror is not None:
                self.mirror.close()  # a local upload_to directory's writer lock

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _finalize(self, blocking: bool) -> None:
        """Commit the pending async save, the pending upload and the pending local save, once every rank is done."""
        self._saver.finalize(blocking)
        if self.mirror is not None:
            self.mirror.poll(blocking)
        if self.local_tier is not None:
            self.local_tier.poll(blocking)

    # ---------------------------------------------------------------- loading
    def load(
        self,
        state: TrainState,
        *,
        iteration: int | None = None,
        finetune: bool = False,
        load_optimizer: bool = True,
        load_rng: bool = True,
        strict: bool | str = True,
        verify: bool | None = None,
        fallback: bool = False,
        optimizer_reshard: str = "error",
        rename: Rename = None,
    ) -> LoadResult | None:
        """Load the latest checkpoint (or ``iteration``) into ``state``; None when there is none.

        Every rank calls this; the steps are :class:`~shardpoint.lifecycle.load_pipeline.LoadPipeline`'s.
        A release checkpoint, or ``finetune=True``, loads no optimizer, scheduler or RNG and
        resumes at iteration 0. Keys are the model's own names whatever wraps it
        (:mod:`shardpoint.state.naming`); ``rename`` maps saved names onto current ones
        (``{"old.name": "new.name"}`` or a callable, applied to model names; optimizer state
        follows its parameter). ``strict``: True raises when the checkpoint lacks a key of
        ``state`` or holds one ``state`` lacks; ``"missing"`` only for the former (as Megatron's
        ``--dist-ckpt-strictness assume_ok_unexpected``); False loads the keys that match.
        Optimizer state saved per rank (e.g. Adafactor's factored statistics of a sharded
        weight) is exact at the saved layout only; elsewhere ``optimizer_reshard="error"``
        raises naming it and ``"reinit"`` zeroes it with a warning naming each one.

        Raises:
            ConfigMismatchError: the saved config differs (keys named in the message).
            MissingKeysError: ``strict`` and the keys do not match.
            CorruptCheckpointError: a file is missing, truncated or fails its checksum.
            TopologyMismatchError: the checkpoint cannot be loaded at this layout.
        """
        opts = LoadOptions(
            iteration=iteration,
            finetune=finetune,
            load_optimizer=load_optimizer,
            load_rng=load_rng,
            strict=strict,
            verify=self.verify if verify is None else verify,
            fallback=fallback,
            optimizer_reshard=optimizer_reshard,
            rename=rename,
        )
        self._finalize(blocking=True)
        self._saver.wait_deletions()  # a load may name an old iteration that retention is deleting
        with paused_gc():  # as in save: read items, plans and shards per tensor
            if self.local_tier is not None:  # the newest complete iteration of any tier (see shardpoint.tier)
                return self.local_tier.load(state, opts, self._loader)
            return self._loader.run(state, opts)


def _checked_files(files: Mapping[str, bytes] | None) -> dict[str, bytes]:
    """``files`` of :meth:`Checkpointer.save`, each a plain file name holding bytes (checked before any write)."""
    checked = {}
    for name, data in (files or {}).items():
        if not isinstance(data, bytes):
            raise TypeError(f"save(files=...): {name!r} must hold bytes, got {type(data).__name__}")
        if not name or "/" in name or "\\" in name or name.startswith(".") or name in (MARKER_NAME, VALIDATION_FILE):
            raise ValueError(
                f"save(files=...): {name!r} is not a plain file name of its own (no '/', no leading '.', "
                f"not {MARKER_NAME} or {VALIDATION_FILE}); rename it"
            )
        checked[name] = data
    return checked


def _load_pipeline(ckpt: Checkpointer, allow_config_mismatch: Iterable[str]) -> LoadPipeline:
    """The loads of ``ckpt``: from its directory, its upload mirror and its node-local view."""
    mirror = ckpt.mirror
    sources = LoadSources(
        ckpt.storage,
        ckpt.root,
        ckpt.layout,
        remote=mirror.storage if mirror else None,
        remote_root=mirror.root if mirror else None,
        node=ckpt._node,
    )
    return LoadPipeline(
        sources,
        ckpt.topology,
        config=ckpt.config,
        allow_config_mismatch=tuple(allow_config_mismatch),
        thread_count=ckpt.thread_count,
    )


def _save_pipeline(ckpt: Checkpointer, replica_check_interval: int) -> SavePipeline:
    """The saves of ``ckpt``, into its directory (and, with ``upload_to``, its mirror)."""
    return SavePipeline(
        ckpt.storage,
        ckpt.root,
        layout=ckpt.layout,
        fmt=ckpt.format,
        topology=ckpt.topology,
        config=ckpt.config,
        preservation=ckpt.preservation,
        thread_count=ckpt.thread_count,
        replica_check_interval=replica_check_interval,
        async_save=ckpt.async_save,
        node=ckpt._node,
        mirror=ckpt.mirror,
        dedup=ckpt.dedup,
    )


def _local_tier(
    local_dir: str | None, interval: int | None, keep: int, replicas: int, ckpt: Checkpointer, topology: Topology
) -> LocalTier | None:
    """The non-persistent tier, or None without ``local_dir`` (collective when there is one)."""
    if local_dir is None:
        if interval is not None:
            raise ValueError("local_interval needs local_dir=, the node-local directory to save into")
        return None
    if interval is None:
        raise ValueError(f"local_dir={local_dir!r} needs local_interval=N (steps between local checkpoints)")
    if ckpt.storage.is_local and os.path.abspath(local_dir) == os.path.abspath(ckpt.root):
        raise ValueError(f"local_dir must differ from the persistent path {ckpt.root}: the tiers never mix")
    options = LocalTierOptions(local_dir=local_dir, local_interval=interval, local_keep=keep, local_replicas=replicas)
    run = ckpt.mirror.root if ckpt.mirror else ckpt.root  # with upload_to, node-local paths differ per node
    return LocalTier(options, topology, ckpt.config, run)


def default_thread_count() -> int:
    return max(1, min(4, 2 * (os.cpu_count() or 1)))


def _json_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config as plain JSON values; it is stored in shardpoint.json, never pickled."""
    try:
        return json.loads(json.dumps(dict(config or {}), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Checkpointer config must hold JSON values (numbers, strings, lists, dicts): {exc}") from None
