"""One local-tier save, from the snapshot in host memory to committed copies on several nodes.

Every rank runs the same sequence::

    stage        the state into a reused host slab (the stall: one memory copy, as async_save)
    --- background thread, on the tier's own gloo group ---
    write        this rank's files (state.pt, frozen.pt) into a temporary directory of its run's directory of local_dir
    agree        every rank's record (size, checksum) to every rank, and rank 0's save id
                 (time and a random token), which every copy of this save records (one all-gather)
    replicate    each file to its holders on other nodes (shardpoint.tier.replicate);
                 holders hash what they receive and compare it with the owner's record
    mark         a marker into each temporary directory (own copy and replicas held);
                 still invisible, the directory names are temporary
    --- training thread, at a later maybe_save / wait / close ---
    poll         "is your background work done?" (one all-gather; skipped by wait/close)
    agree        the outcome: any rank's failure is raised on every rank, all temporary
                 directories are removed
    publish      each rank renames its temporary directories into place
    prune        each node's leader applies local_keep (shardpoint.tier.retention)

Publishing happens only after every rank agreed that all files and replicas were
written, so a published copy always belongs to a save that was complete on every
rank; a crash before it leaves temporary directories nobody looks at (removed at the
next start), a crash during it leaves some ranks' copies published and others not,
which the load treats as it treats any missing copy. Pruning comes after a second
agreement (the publish step's), so no rank deletes the previous iteration before
every rank has published the new one.

The background thread runs its collectives on a group of its own, so they never
interleave with the trainer's or with the control group's polls (invariant 13).
"""

from __future__ import annotations

import logging
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardpoint.catalog.metadata import FileRecord
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.formats.base import FormatContext, write_file
from shardpoint.lifecycle import faults
from shardpoint.lifecycle.async_save import BackgroundWrite
from shardpoint.lifecycle.staging import HostStaging
from shardpoint.parallel import comm
from shardpoint.parallel.topology import Topology
from shardpoint.state.train_state import FlatState
from shardpoint.storage.base import LocalStorage
from shardpoint.tier.marker import LOCAL_MARKER, LocalMarker, mark_copy, publish_copy, tmp_copy_dir
from shardpoint.tier.placement import Nodes, held_by
from shardpoint.tier.replicate import Transfer, exchange
from shardpoint.tier.retention import prune_node
from shardpoint.tier.snapshot import LocalSnapshotFormat

__all__ = ["LocalSaver", "LocalTimes"]

log = logging.getLogger(__name__)


@dataclass
class LocalTimes:
    """What local-tier saves cost (``Checkpointer.local_times``)."""

    last_stall_seconds: float = 0.0  # save() until training resumed: the snapshot into host memory
    last_write_seconds: float = 0.0  # background: this rank's files
    last_replicate_seconds: float = 0.0  # background: sending and receiving replicas
    last_replicated_bytes: int = 0  # sent plus received by this rank
    last_background_seconds: float = 0.0
    saves: int = 0


@dataclass
class _Pending:
    iteration: int
    writer: BackgroundWrite = field(init=False)  # set by LocalSaver.start at once: its work needs this object
    tmp_dirs: list[str] = field(default_factory=list)  # every directory this rank created, for clean-up


class LocalSaver:
    """Writes, replicates and commits local-tier checkpoints under one node-local root; one in flight.

    Args:
        storage, root: this node's ``local_dir``.
        nodes: the job's nodes; ``placement``: owner -> holders (:mod:`~shardpoint.tier.placement`).
        topology, config, run: recorded in each copy's marker (the copy is bound to them; ``run`` is
            the persistent path).
        keep: ``local_keep``.
        group: the gloo group the background thread uses (None in one process).
        incompatible: why a held copy cannot be loaded by this job, or None (for pruning).
    """

    def __init__(
        self,
        storage: LocalStorage,
        root: str,
        *,
        nodes: Nodes,
        placement: dict[int, tuple[int, ...]],
        topology: Topology,
        config: dict[str, Any],
        run: str,
        keep: int,
        group: Any,
        incompatible: Callable[[LocalMarker], str | None],
    ):
        self.storage, self.root, self.nodes, self.placement = storage, root, nodes, placement
        self.topology, self.config, self.keep, self.group = topology, config, keep, group
        self.run, self.incompatible = run, incompatible
        self.format = LocalSnapshotFormat()
        self.staging = HostStaging()  # its own slab: a persistent async save may be in flight beside it
        self.times = LocalTimes()
        self._pending: _Pending | None = None

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def start(self, iteration: int, flat: FlatState, files: Mapping[str, bytes] | None = None) -> None:
        """Every rank: snapshot ``flat`` and write, replicate and mark it in the background.

        The previous local save is committed first (waiting for it if it is still
        running: the slab is reused). ``files``: this rank's small files (``{name: bytes}``,
        an integration's own), written beside ``state.pt`` and, listed in the copy's
        marker, replicated, verified and fetched with it.
        """
        start = time.perf_counter()
        self.poll(blocking=True)
        staged = self.staging.stage(flat, everything=True)
        pending = _Pending(iteration)
        extra = dict(files or {})
        pending.writer = BackgroundWrite(lambda: self._write_and_replicate(pending, staged, extra)).start()
        self._pending = pending
        self.times.last_stall_seconds = time.perf_counter() - start

    def poll(self, blocking: bool) -> bool:
        """Collective: commit the pending save once every rank's background work is done; True when none is pending."""
        pending = self._pending
        if pending is None:
            return True
        if blocking:
            pending.writer.wait()
        elif not all(comm.all_gather(pending.writer.done())):
            return False
        pending.writer.wait()
        self._pending = None
        self.times.last_background_seconds = pending.writer.seconds
        try:
            comm.agree(lambda: _raise(pending.writer.error), f"writing local-tier checkpoint {pending.iteration}")
            comm.agree(lambda: self._publish(pending), f"publishing local-tier checkpoint {pending.iteration}")
        except BaseException:
            for tmp in pending.tmp_dirs:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if comm.rank() == self.nodes.leader(comm.rank()):
            prune_node(self.storage, self.root, pending.iteration, self.keep, self.incompatible)
        self.times.saves += 1
        if comm.rank() == 0:
            log.info(
                "local-tier checkpoint %d committed under %s (background %.2f s, replicas %.2f s)",
                pending.iteration,
                self.root,
                pending.writer.seconds,
                self.times.last_replicate_seconds,
            )
        return True

    # ----------------------------------------------------------- background
    def _write_and_replicate(
        self, pending: _Pending, flat: FlatState, files: Mapping[str, bytes]
    ) -> list[tuple[str, int]]:
        """Background thread: own file, replicas, markers; returns the (directory, owner) pairs to publish."""
        me, iteration = comm.rank(), pending.iteration
        began = time.perf_counter()
        own_tmp, records, error = tmp_copy_dir(self.storage, self.root, iteration, me), None, None
        try:
            self._new_tmp(pending, own_tmp)
            ctx = FormatContext(self.storage, own_tmp, self.topology)
            records = self.format.save(ctx, flat)
            for name, data in files.items():
                if name in records or name == LOCAL_MARKER:
                    raise ValueError(f"local-tier save: {name!r} is one of the tier's own files; name it otherwise")
                records[name] = write_file(data, self.storage.join(own_tmp, name), self.storage)
            faults.hit("local-after-data", me)
        except Exception as exc:  # noqa: BLE001 - every rank must still reach the all-gather below
            error = exc
        self.times.last_write_seconds = time.perf_counter() - began
        token = f"{time.time_ns():016x}-{secrets.token_hex(4)}"  # rank 0's names the save
        shared = comm.all_gather((None if error else records, _describe(error), token), self.group)
        failed = {r: e for r, (_, e, _) in enumerate(shared) if e}
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(
                f"local-tier save {iteration} failed on rank(s) {sorted(failed)}: {next(iter(failed.values()))}"
            )
        all_records: list[dict[str, FileRecord]] = [r for r, _, _ in shared]
        save_id = shared[0][2]
        held = self._replicate(pending, own_tmp, all_records)
        copies = [(own_tmp, me), *[(tmp, owner) for owner, tmp in held.items()]]
        for tmp, owner in copies:  # still invisible: the names are temporary until every rank agreed
            mark_copy(self.storage, tmp, self._marker(iteration, owner, all_records[owner], flat, save_id))
        return copies

    def _replicate(self, pending: _Pending, own_tmp: str, records: list[dict[str, FileRecord]]) -> dict[int, str]:
        """Send this rank's files to its holders, receive the files of the owners it holds; returns owner -> tmp dir.

        Every file an owner's record lists travels (``state.pt``, ``frozen.pt``, ...): the
        replica's marker lists them all, and a copy lacking one is damaged, not a copy.
        """
        me, iteration = comm.rank(), pending.iteration
        began = time.perf_counter()
        transfers = [
            Transfer(owner, owner, holder, name, record.size)
            for owner, holders in sorted(self.placement.items())
            for holder in holders
            for name, record in sorted(records[owner].items())
        ]
        owners = held_by(self.placement, me)
        incoming = {owner: tmp_copy_dir(self.storage, self.root, iteration, owner) for owner in owners}
        errors = []
        for tmp in incoming.values():
            try:
                self._new_tmp(pending, tmp)
            except OSError as exc:  # received bytes are then discarded: every sender must still be served
                errors.append(f"cannot create {tmp}: {exc}")
        received, exchange_errors = exchange(
            transfers,
            lambda t: open(self.storage.join(own_tmp, t.name), "rb"),  # noqa: SIM115 - exchange enters and closes it
            lambda t: self.storage.open_write(self.storage.join(incoming[t.owner], t.name)),
            self.group,
        )
        errors += exchange_errors
        for t, record in received.items():
            if record != records[t.owner][t.name]:
                errors.append(
                    f"the replica of rank {t.owner}'s {t.name} received from rank {t.source} has "
                    f"{record}, not the {records[t.owner][t.name]} it was sent with"
                )
        self.times.last_replicate_seconds = time.perf_counter() - began
        self.times.last_replicated_bytes = sum(t.size for t in transfers if me in (t.source, t.target))
        if errors:
            raise CorruptCheckpointError(f"replicating local-tier checkpoint {iteration}: " + "; ".join(errors))
        return incoming

    def _new_tmp(self, pending: _Pending, tmp: str) -> None:
        pending.tmp_dirs.append(tmp)
        self.storage.makedirs(tmp)

    def _marker(
        self, iteration: int, owner: int, files: dict[str, FileRecord], flat: FlatState, save_id: str
    ) -> LocalMarker:
        extra = flat.common.get("extra", {})
        return LocalMarker(
            iteration=iteration,
            owner=owner,
            world_size=self.nodes.world_size,
            topology=self.topology.describe(),
            nodes=self.nodes.members,
            files=dict(files),
            config=self.config,
            consumed_samples=_number(extra.get("consumed_samples"), int),
            flops=_number(extra.get("flops"), float),
            wall_time=time.time(),
            run=self.run,
            save_id=save_id,
        )

    # --------------------------------------------------------------- commit
    def _publish(self, pending: _Pending) -> None:
        faults.hit("local-before-publish", comm.rank())
        for tmp, owner in pending.writer.result:
            publish_copy(self.storage, tmp, owner)
        pending.tmp_dirs.clear()


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"[:300]


def _number(value: Any, kind: type) -> Any:
    return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
