"""The Checkpointer: the user's entry point, sequencing policy, saving and loading.

A save: the save policy decides (``maybe_save``), the state is collected into a
:class:`~shardpoint.state.train_state.FlatState`, and :class:`~shardpoint.lifecycle.save_pipeline.SavePipeline`
writes and commits it (see there for the steps, and :mod:`shardpoint.lifecycle.commit` for
why their order is safe); old checkpoints are deleted in the background.

A load: :class:`~shardpoint.lifecycle.load_pipeline.LoadPipeline` finds the checkpoint
(rank 0 decides, everyone receives the one answer), opens its sources, checks the
config and the files, and the format fills the live tensors in place.

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
from typing import Any

from shardpoint.catalog.layout import Layout, get_layout
from shardpoint.formats import get_format
from shardpoint.lifecycle.discovery import LoadSources
from shardpoint.lifecycle.load_pipeline import LoadOptions, LoadPipeline, LoadResult
from shardpoint.lifecycle.node_local import detect as detect_nodes
from shardpoint.lifecycle.policy import preservation_policies, save_decision
from shardpoint.lifecycle.save_pipeline import VALIDATION_FILE, SavePipeline
from shardpoint.lifecycle.upload import RemoteMirror
from shardpoint.parallel import comm
from shardpoint.parallel.topology import Topology
from shardpoint.state.naming import Rename
from shardpoint.state.train_state import (
    TrainState,
    collect,
)
from shardpoint.storage.base import open_storage

__all__ = ["VALIDATION_FILE", "Checkpointer", "LoadResult"]

log = logging.getLogger(__name__)


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
        comm.control_group()  # collective: created here, on every rank in the same order
        self.storage = open_storage(path)
        self.root = self.storage.root
        self.topology = topology or Topology(1, 1, comm.world_size())
        self.format = get_format(format)
        self.layout: Layout = get_layout(layout)
        self._time_based = save_interval_minutes is not None
        self.save_policy = save_decision(save_interval, save_interval_minutes)
        self.preservation = preservation_policies(keep_last, keep_every, keep_best)
        self.config = _json_config(config)
        self.verify = verify
        self.async_save = async_save
        self.thread_count = thread_count or default_thread_count()
        self.last_saved_iteration: int | None = None
        self.mirror = RemoteMirror(upload_to, self.layout, self.preservation) if upload_to else None
        self._node = detect_nodes(self.storage, self.root, self.layout, node_local, self.mirror is not None)
        remote = (self.mirror.storage, self.mirror.root) if self.mirror else (None, None)
        sources = LoadSources(self.storage, self.root, self.layout, *remote, self._node)
        self._loader = LoadPipeline(
            sources,
            self.topology,
            config=self.config,
            allow_config_mismatch=allow_config_mismatch,
            thread_count=self.thread_count,
        )
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
    # host memory this rank keeps for staging (the async snapshot, GPU tensors of sync saves)
    staging_bytes = property(lambda self: self._saver.staging.nbytes)

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
            self._loader.close()

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

        The steps are :class:`~shardpoint.lifecycle.load_pipeline.LoadPipeline`'s.

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
        return self._loader.run(state, opts)


def default_thread_count() -> int:
    return max(1, min(4, 2 * (os.cpu_count() or 1)))


def _json_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config as plain JSON values; it is stored in shardpoint.json, never pickled."""
    try:
        return json.loads(json.dumps(dict(config or {}), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Checkpointer config must hold JSON values (numbers, strings, lists, dicts): {exc}") from None
