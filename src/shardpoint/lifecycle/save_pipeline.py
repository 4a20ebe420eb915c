"""How one save travels from collected state to a committed checkpoint (the mechanism behind ``save``).

Every rank runs the same sequence (see :mod:`shardpoint.lifecycle.commit` for why it is safe)::

    compare replicas -> rank 0 creates a temporary directory -> every rank writes and
    checksums its files -> ranks agree on the outcome -> rank 0 writes shardpoint.json,
    renames the directory into place, replaces the tracker -> retention (background)

A synchronous save runs it all in :meth:`SavePipeline.start`. Either kind first
stages device tensors on the host, once, in a reused slab
(:mod:`shardpoint.lifecycle.staging`); an asynchronous save stages every tensor, runs
the writes on a background thread (with a process group of its own), and :meth:`SavePipeline.finalize` commits once
every rank reports its writes done. Deleting old checkpoints never happens inside
``save``: it runs on a worker after the commit, and the next commit waits for it.

Each step that can fail locally runs under :func:`shardpoint.parallel.comm.agree`, so a
failure on one rank is raised on all ranks instead of leaving the others waiting in
a collective. Policy (when to save, what to keep) stays with the Checkpointer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardpoint._version import __version__
from shardpoint.catalog.layout import Layout
from shardpoint.catalog.metadata import CheckpointMetadata
from shardpoint.errors import CheckpointError, StorageError
from shardpoint.formats import FormatContext
from shardpoint.formats.base import CheckpointFormat, write_file, write_torch_file
from shardpoint.formats.dedup import StoredItems
from shardpoint.formats.dist_replay import SavePlanCache
from shardpoint.lifecycle import commit, faults, tracker_owner
from shardpoint.lifecycle.async_save import BackgroundWrite
from shardpoint.lifecycle.policy import PreservationPolicy
from shardpoint.lifecycle.retention import BackgroundRetention
from shardpoint.lifecycle.staging import HostStaging
from shardpoint.parallel import comm
from shardpoint.parallel.topology import Topology
from shardpoint.state import replicas
from shardpoint.state.replicas import check_replicas
from shardpoint.state.train_state import FlatState
from shardpoint.storage.base import Storage, as_storage_error
from shardpoint.storage.lock import DirectoryLock

__all__ = ["VALIDATION_FILE", "SavePipeline", "SaveTimes"]

log = logging.getLogger(__name__)

VALIDATION_FILE = "validation_logits.pt"


@dataclass
class SaveTimes:
    """What saves cost, for trainers that keep saving time out of their throughput."""

    last_stall_seconds: float = 0.0  # async: how long save() kept training waiting
    last_background_seconds: float = 0.0  # async: the background write
    last_save_seconds: float = 0.0  # from save() to commit
    total_save_seconds: float = 0.0
    last_save_time: float = field(default_factory=time.time)  # wall clock of the last commit

    def record(self, start: float, meta: CheckpointMetadata, final: str) -> None:
        """A save that began at ``start`` (``perf_counter``) was committed as ``final``."""
        times = self
        times.last_save_seconds = time.perf_counter() - start
        times.total_save_seconds += times.last_save_seconds
        times.last_save_time = time.time()
        if comm.rank() == 0:
            gb = meta.total_bytes / 1e9
            log.info(
                "saved %s (%s format, %.3f GB) in %.2f s, %.2f GB/s",
                final,
                meta.format,
                gb,
                times.last_save_seconds,
                gb / max(times.last_save_seconds, 1e-9),
            )


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
    replicas: Any = None  # the replica check's ReplicaReport when this save ran one (who writes which box)
    finished: dict[str, Any] = field(default_factory=dict)  # rank 0: files the format's finish() wrote

    def context(self) -> FormatContext:
        """The format's context: the steps after the save's start (which sets it) use this."""
        if self.ctx is None:
            raise CheckpointError(f"the save of {self.final} has no temporary directory yet (its start failed)")
        return self.ctx


class SavePipeline:
    """Writes and commits saves into one save directory; one save in flight at a time.

    Args:
        storage: where the save directory lives; ``root`` is its path there.
        layout, fmt, topology, config: what the checkpoint looks like and records.
        preservation: retention policies, applied after each commit in the background.
        thread_count: writer threads per rank.
        replica_check_interval: see :class:`~shardpoint.checkpointer.Checkpointer`.
        async_save: snapshot and write in the background.
        node: the node-local view (``upload_to`` with unshared local disks), or None.
        mirror: the object-store mirror of ``upload_to``, or None.
    """

    def __init__(
        self,
        storage: Storage,
        root: str,
        *,
        layout: Layout,
        fmt: CheckpointFormat,
        topology: Topology,
        config: dict[str, Any],
        preservation: Sequence[PreservationPolicy],
        thread_count: int,
        replica_check_interval: int,
        async_save: bool,
        node: Any = None,
        mirror: Any = None,
        dedup: bool = True,
    ):
        self.storage, self.root, self.layout, self.format = storage, root, layout, fmt
        self.topology, self.config, self.preservation = topology, config, list(preservation)
        self.thread_count, self.replica_check_interval = thread_count, replica_check_interval
        self.node, self.mirror = node, mirror
        self.times = SaveTimes()
        self.staging = HostStaging()  # one reused host slab (pinned for GPU tensors)
        self._async_group = comm.new_group() if async_save else None
        # the last plan, replayed while the structure stays (dist format; node-local saves plan per node)
        self._plan_cache = SavePlanCache() if fmt.name == "dist" and node is None else None
        self._pending: _PendingSave | None = None
        self._saves_started = 0
        self.owns_dir = node.is_leader if node else comm.rank() == 0  # creates, commits, cleans
        # object stores have no flock: one writer per prefix is the user's to ensure there
        self._lock = DirectoryLock(root) if storage.is_local else None
        self._cleaned = False
        self._retention = BackgroundRetention(storage, root, layout, self.preservation)
        self._stored = _stored_items(dedup, storage, fmt, node, mirror)
        if self.owns_dir and self._lock is not None and storage.is_dir(root):
            _clean_leftovers_if_unlocked(self._lock, self.storage, root)

    # ------------------------------------------------------------ public steps
    def start(
        self,
        iteration: int | None,
        flat: FlatState,
        metrics: Mapping[str, float],
        extra: Mapping[str, Any],
        *,
        update_tracker: bool = True,
        background: bool = False,
        attachments: Mapping[str, Any] | None = None,
    ) -> str:
        """Collective: write ``flat`` (and commit it, unless ``background``); returns the final directory."""
        flat.common["config"] = self.config
        name = self.layout.dir_name(iteration)
        pending = _PendingSave(
            iteration, self.storage.join(self.root, name), flat, dict(metrics), dict(extra), update_tracker
        )
        interval = self.replica_check_interval
        pending.check_replicas = interval > 0 and self._saves_started % interval == 0
        self._saves_started += 1
        pending.attachments = {k: _detached_copy(v) for k, v in (attachments or {}).items()}
        # device tensors reach the host once, for hashing and writing alike (async: every tensor)
        pending.flat = self.staging.stage(flat, everything=background)
        if background:
            pending.writer = BackgroundWrite(lambda: self._open_and_write(pending, self._async_group)).start()
            self._pending = pending
            return pending.final
        try:
            records: Any = self._open_and_write(pending, None)
            error = None
        except Exception as exc:  # noqa: BLE001 - agreed on and re-raised on every rank by _finish
            records, error = None, exc
        return self._finish(pending, records, error)

    def finalize(self, blocking: bool) -> None:
        """Commit the pending async save once every rank's writes are done (``blocking``: wait for them)."""
        pending = self._pending
        if pending is None or pending.writer is None:
            return
        if blocking:
            pending.writer.wait()
        elif not all(comm.all_gather(pending.writer.done())):
            return
        pending.writer.wait()
        self._pending = None
        self.times.last_background_seconds = pending.writer.seconds
        self._finish(pending, pending.writer.result, pending.writer.error)
        log.info("async save %s committed; background write took %.2f s", pending.final, pending.writer.seconds)

    def wait_deletions(self) -> None:
        """Block until the background deletion of old checkpoints, if any, is finished."""
        self._retention.wait()

    def close(self) -> None:
        """Wait for background deletions and release the directory's writer lock (after :meth:`finalize`)."""
        try:
            self._retention.wait()
        finally:
            if self._lock is not None:
                self._lock.release()

    # ------------------------------------------------------------------ steps
    def _open_and_write(self, pending: _PendingSave, group: Any) -> dict[str, Any]:
        """Collective over ``group``: compare replicas, rank 0 creates the temporary directory, every rank writes.

        Runs on the background thread for async saves, with a group of its own, so the
        trainer's collectives never interleave with these. A save of the structure the
        last one had does it in one round (:meth:`_start_known`).
        """
        name = self.layout.dir_name(pending.iteration)
        cache = self._plan_cache
        if cache is not None and cache.ready:
            tmp = self._start_known(pending, name, group, cache)
        else:
            tmp = self._start_full(pending, name, group)
        pending.ctx = FormatContext(
            self.storage,
            tmp,
            self.topology,
            thread_count=self.thread_count,
            distributed_optimizer=pending.flat.common.get("distributed_optimizer", False),
            process_group=group,
            plan_cache=cache,
            replicas=pending.replicas,
            dedup=self._stored,
        )
        if self._stored is not None:
            self._stored.begin(name)
        return _write_files(self.format, self.storage, pending)

    def _start_full(self, pending: _PendingSave, name: str, group: Any) -> str:
        """Gather every rank's boxes to find and hash the replicas, then rank 0 creates the directory."""
        self._check_replicas(pending, group)
        if self.node is not None:  # each node's leader creates its own
            return self.node.begin(lambda: self._begin(name, pending.needed), group)
        return comm.from_root(lambda: self._begin(name, pending.needed), "preparing the checkpoint directory", group)

    def _start_known(self, pending: _PendingSave, name: str, group: Any, cache: SavePlanCache) -> str:
        """One round for a save whose structure is probably the last one's.

        Every rank sends whether its structure is unchanged and its hashes of the boxes
        the last replica check found shared; rank 0 sends the temporary directory it
        created (sized from the last save). When every structure is unchanged and the
        replicas agree, the format replays the last plan; otherwise the full replica
        check runs and the format plans afresh, into the same directory.
        """
        flat, report = pending.flat, cache.replicas
        checked = report.to_check(pending.check_replicas)

        def local() -> tuple[bool, dict, str | None]:
            same = self.format.fingerprint(FormatContext(self.storage, "", self.topology), flat) == cache.fingerprint
            tmp = self._begin(name, report.deduplicated_bytes) if comm.rank() == 0 else None
            return same, replicas.hashes_of(flat, checked), tmp

        outcomes = comm.agree_all(local, "starting the save", group)
        tmp = outcomes[0][2]
        if tmp is None:  # every rank received rank 0's answer: all raise alike
            raise CheckpointError(f"rank 0 sent no temporary directory for {name}")
        try:
            # every rank decides from the same hashes: the same moves, or the same error everywhere
            moved = replicas.compare(flat, [o[1] for o in outcomes])
            cache.replay = all(o[0] for o in outcomes) and not moved
            pending.needed = report.deduplicated_bytes
            if not cache.replay:  # a new structure: its size decides the free space needed
                self._check_replicas(pending, group)
                comm.from_root(
                    lambda: _check_space(self.storage, self.root, name, pending.needed), "checking free space", group
                )
        except BaseException:
            if comm.rank() == 0:
                self.storage.remove(tmp)
            raise
        return tmp

    def _check_replicas(self, pending: _PendingSave, group: Any) -> None:
        """The full replica check (every rank's boxes gathered); what it found is kept for the next save."""
        topo = self.topology
        scope = (topo.tp_rank, topo.pp_rank) if self.format.name == "torch" else ()  # per-mp-rank files
        report = comm.agree(
            lambda: check_replicas(pending.flat, group, check_declared=pending.check_replicas, scope=scope),
            "comparing replicated tensors",
            group,
        )
        pending.needed, pending.replicas = report.deduplicated_bytes, report
        if self._plan_cache is not None:
            self._plan_cache.captured.update(replicas=report)

    def _finish(self, pending: _PendingSave, records: Any, error: BaseException | None) -> str:
        """Collective: every rank's outcome and records to rank 0, which commits; its verdict to every rank.

        Two rounds at any rank count (:func:`~shardpoint.parallel.comm.decide_at_root`); a
        failure anywhere is raised everywhere and the temporary directory removed.
        """
        rank = comm.rank()
        ctx, cache = pending.ctx, self._plan_cache
        tmp = ctx.directory if ctx is not None else None
        try:
            if self.node is not None:
                meta = self._finish_on_nodes(pending, records, error)
            else:
                part = (records, ctx.for_coordinator if ctx is not None else None)
                meta = comm.decide_at_root(
                    part, error, lambda parts: self._commit_all(pending, parts), "writing the checkpoint"
                ) or _metadata(self, pending.iteration, None, pending.metrics, pending.extra, 0.0)
        except BaseException:
            if cache is not None:
                cache.clear()
            if self._stored is not None:
                self._stored.discard()
            if self.owns_dir and tmp is not None:
                commit.discard(self.storage, tmp)  # this save's own directory, never another save's
            raise
        if cache is not None:
            cache.commit()
        if self._stored is not None:
            self._stored.commit()
        if rank == 0 and self.node is None:
            self._retention.start()
        self.times.record(pending.start, meta, pending.final)
        if self.mirror is not None:
            marker = meta.to_json().encode()
            files = [*records, *pending.finished]  # rank 0 uploads what the format's finish wrote too
            self.mirror.start(pending.final, files, pending.iteration, marker, pending.update_tracker)
        return pending.final

    def _commit_all(self, pending: _PendingSave, parts: list[tuple[dict, Any]]) -> CheckpointMetadata:
        """Rank 0, once every rank's writes succeeded: the format's last files, the marker, the tracker."""
        all_records = [records for records, _ in parts]
        pending.finished = self.format.finish(pending.context(), [extra for _, extra in parts])  # .metadata, for dist
        all_records.append(pending.finished)
        seconds = time.perf_counter() - pending.start
        meta = _metadata(self, pending.iteration, all_records, pending.metrics, pending.extra, seconds)
        self._commit(pending.context().directory, pending.final, meta, pending.update_tracker)
        return meta

    def _finish_on_nodes(self, pending: _PendingSave, records: Any, error: BaseException | None) -> CheckpointMetadata:
        """Node-local saves: each node's leader commits its node's part; the remote commit follows the upload."""

        def outcome() -> Any:
            if error is not None:
                raise error
            return records

        records = comm.agree(outcome, "writing checkpoint data")
        all_records = comm.gather_to(records, 0)
        seconds = time.perf_counter() - pending.start
        meta = _metadata(self, pending.iteration, all_records, pending.metrics, pending.extra, seconds)
        self.node.commit(pending.context().directory, pending.final, records, meta, self.preservation)
        return meta

    def _begin(self, name: str, needed: int) -> str:
        # the last save's deletions must be done before free space is measured and written into
        self._retention.wait()
        tracker_owner.refuse_foreign_tracker(self.storage, self.root, self.layout)  # another run's tracker stays
        if self._lock is not None and not self._lock.held:
            self._lock.acquire()
            commit.clean_leftovers(self.storage, self.root)
        elif self._lock is None and not self._cleaned:
            commit.clean_leftovers(self.storage, self.root)
        self._cleaned = True
        _check_space(self.storage, self.root, name, needed)
        if self.mirror is not None and comm.rank() == 0:
            self.mirror.prepare(name)  # what the upload may replace: the remote checkpoint as this save begins
        return commit.begin(self.storage, self.root, name)

    def _commit(self, tmp: str, final: str, meta: CheckpointMetadata, update_tracker: bool) -> None:
        """Rank 0: marker, rename, tracker; a deletion still running from the last save is waited for first."""
        self._retention.wait()
        faults.hit("before-marker", 0)
        commit.publish(self.storage, tmp, final, meta)
        faults.hit("before-tracker", 0)
        if update_tracker:
            commit.write_tracker(self.storage, self.root, self.layout, None if meta.release else meta.iteration)


def _write_files(fmt: CheckpointFormat, storage: Storage, pending: _PendingSave) -> dict[str, Any]:
    """This rank's files and their records (runs on the background thread for async saves)."""
    rank = comm.rank()
    ctx = pending.context()
    try:
        faults.hit("before-data", rank)
        records = fmt.save(ctx, pending.flat)
        _write_attachments(storage, ctx.directory, pending.attachments, records, fmt.name)
        faults.hit("mid-data", rank)
        faults.hit("after-data", rank)
    except (OSError, RuntimeError) as exc:
        storage_error = as_storage_error(exc, ctx.directory, pending.needed)
        if storage_error is None:
            raise
        raise storage_error from exc
    return records


def _clean_leftovers_if_unlocked(lock: DirectoryLock, storage: Storage, root: str) -> None:
    """Remove partial saves of dead jobs, unless a live job owns the directory (its saves are not ours).

    Without a lock (object storage) only a job that saves cleans, at its first save:
    a job that only loads must not delete another job's save in progress.
    """
    if lock.try_acquire():
        try:
            commit.clean_leftovers(storage, root)
        finally:
            lock.release()


def _stored_items(dedup: bool, storage: Storage, fmt: CheckpointFormat, node: Any, mirror: Any) -> StoredItems | None:
    """What saves refer to instead of writing frozen tensors again (:mod:`~shardpoint.formats.dedup`), or None.

    Only for ``dist`` saves into one directory or object store prefix (object stores get
    server-side copies, not references): a mirror or node-local copies hold each
    checkpoint's own files only.
    """
    if not dedup:
        return None
    reason = (
        "the format is not dist"
        if fmt.name != "dist"
        else "upload_to mirrors each checkpoint's own files"
        if mirror is not None or node is not None
        else None
    )
    if reason is None:
        return StoredItems()
    log.debug("frozen tensors are written at every save (%s)", reason)
    return None


def _check_space(storage: Storage, root: str, name: str, needed: int) -> None:
    free = storage.free_bytes(root)
    if free is not None and needed > free:
        raise StorageError(
            f"not enough space to save {name} under {root}: about {needed / 1e9:.2f} GB needed, "
            f"{free / 1e9:.2f} GB free; free space, lower keep_last, or save elsewhere"
        )


def _write_attachments(
    storage: Storage, directory: str, attachments: Mapping[str, Any], records: dict[str, Any], fmt: str
) -> None:
    """The extra files of a save (validation logits, the Trainer's state): bytes as they are, objects by torch.save."""
    for name, obj in attachments.items():
        if name in records:
            raise CheckpointError(f"cannot save {name}: the {fmt} format writes a file of that name")
        path = storage.join(directory, name)
        records[name] = (
            write_file(obj, path, storage) if isinstance(obj, bytes) else write_torch_file(obj, path, storage)
        )


def _metadata(
    pipeline: SavePipeline,
    iteration: int | None,
    all_records: Sequence[dict] | None,
    metrics: Mapping[str, float],
    extra: Mapping[str, Any],
    seconds: float,
) -> CheckpointMetadata:
    """The marker of a save: what it holds, how it was laid out, and what it cost."""
    files = {k: v for records in (all_records or []) for k, v in records.items()}
    return CheckpointMetadata(
        iteration=iteration or 0,
        format=pipeline.format.name,
        topology=pipeline.topology.describe(),
        release=iteration is None,
        layout=pipeline.layout.name,
        config=pipeline.config,
        files=files,
        consumed_samples=_optional_int(extra.get("consumed_samples")),
        flops=_optional_float(extra.get("flops")),
        metrics=_finite_metrics(metrics),
        validation_logits=VALIDATION_FILE if VALIDATION_FILE in files else None,
        wall_time=time.time(),
        save_seconds=seconds,
        library_version=__version__,
        canonical_keys=True,
        contiguous_items=True,  # ShardSavePlanner writes contiguous items
    )


def _detached_copy(value: Any) -> Any:
    """Attachments are written later (async saves): keep what they were at the call."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, Mapping):
        return {k: _detached_copy(v) for k, v in value.items()}
    return value


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
