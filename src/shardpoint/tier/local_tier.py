"""The local tier as the Checkpointer sees it: when to save, save, poll, load, close.

Construction (collective, every rank in the same order): probe which ranks share
``local_dir`` (the nodes), place the replicas, let each node's leader remove what
interrupted saves of this run left and report what other runs keep there (never
loaded, never deleted: each run has its own directory, named for its persistent
path), create the gloo group the background replication uses.

Saving: :meth:`LocalTier.is_due` / :meth:`LocalTier.save` / :meth:`LocalTier.poll`
(:mod:`shardpoint.tier.local_save`). Loading: :meth:`LocalTier.load` asks the
persistent store for its candidate first, then makes the collective choice
(:mod:`shardpoint.tier.choose`): the local tier is used when it has an iteration
newer than the persistent one, complete across all ranks and verified; ranks whose
files are on another node fetch them (:mod:`shardpoint.tier.fetch`). A save whose
copies are damaged or cannot be fetched gives way to the next older one, then to
the persistent store, and nothing intact is deleted because a newer copy failed. Either way each rank logs its tier
and source, and :class:`~shardpoint.lifecycle.load_pipeline.LoadResult` records them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardpoint.catalog.metadata import CheckpointMetadata
from shardpoint.errors import CheckpointError
from shardpoint.lifecycle.load_pipeline import LoadOptions, LoadPipeline, LoadResult
from shardpoint.lifecycle.node_local import probe_domains
from shardpoint.lifecycle.policy import EveryNSteps
from shardpoint.parallel import comm
from shardpoint.parallel.topology import Topology
from shardpoint.state.train_state import TrainState, collect
from shardpoint.storage.base import LocalStorage
from shardpoint.tier.choose import Choice, choose, marker_of
from shardpoint.tier.fetch import fetch
from shardpoint.tier.local_save import LocalSaver, LocalTimes
from shardpoint.tier.marker import LocalMarker, other_runs, remove_leftovers, run_dir_name
from shardpoint.tier.placement import Nodes, nodes_from_domains, place_replicas
from shardpoint.tier.retention import prune_node
from shardpoint.tier.snapshot import LocalSnapshotFormat

__all__ = ["LocalTier", "LocalTierOptions"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalTierOptions:
    """The ``local_*`` arguments of the Checkpointer.

    Attributes:
        local_dir: a node-local path (NVMe, or RAM-backed such as ``/dev/shm/run``),
            shared by the ranks of one node and by no other node.
        local_interval: ``maybe_save`` writes a local checkpoint when ``iteration %
            local_interval == 0`` (and no persistent save is due).
        local_keep: local checkpoints (iterations) kept on each node, replicas included.
        local_replicas: copies of each rank's files held by ranks on other nodes.
    """

    local_dir: str
    local_interval: int
    local_keep: int = 2
    local_replicas: int = 1

    def __post_init__(self) -> None:
        if "://" in self.local_dir:
            raise ValueError(
                f"local_dir must be a node-local path, got {self.local_dir!r} (object stores are for path=)"
            )
        if self.local_interval < 1:
            raise ValueError(f"local_interval must be >= 1, got {self.local_interval}")
        if self.local_keep < 1:
            raise ValueError(f"local_keep must be >= 1, got {self.local_keep}")
        if self.local_replicas < 0:
            raise ValueError(f"local_replicas must be >= 0, got {self.local_replicas}")


class LocalTier:
    """The non-persistent tier of one Checkpointer (collective to construct)."""

    def __init__(self, options: LocalTierOptions, topology: Topology, config: dict[str, Any], run: str):
        """``run``: the persistent path; this run's copies live in a directory of ``local_dir`` named for it."""
        self.options = options
        self.storage = LocalStorage(options.local_dir)
        self.run = comm.broadcast(run, what="naming the local tier's run")  # rank 0's spelling, on every node
        self.root = self.storage.join(self.storage.root, run_dir_name(self.run))
        self.topology = topology
        self.policy = EveryNSteps(options.local_interval)
        domains = probe_domains(self.storage, self.root) if comm.world_size() > 1 else [(0,)]
        self.nodes: Nodes = nodes_from_domains(domains, self.root)
        self.replicas = min(options.local_replicas, self.nodes.count - 1)
        if self.replicas < options.local_replicas and comm.rank() == 0:
            # one node cannot hold copies on another: expected on a workstation, worth a warning on a cluster
            (log.warning if self.nodes.count > 1 else log.info)(
                "local_replicas=%d needs %d nodes, this job has %d: keeping %d replica(s) of each rank's files "
                "(losing a node then loses its local checkpoints; the persistent store still has them)",
                options.local_replicas,
                options.local_replicas + 1,
                self.nodes.count,
                self.replicas,
            )
        self.placement = place_replicas(self.nodes, self.replicas)
        self.is_leader = comm.rank() == self.nodes.leader(comm.rank())
        comm.agree(lambda: self._clean() if self.is_leader else None, "cleaning local_dir")
        self.saver = LocalSaver(
            self.storage,
            self.root,
            nodes=self.nodes,
            placement=self.placement,
            topology=topology,
            config=config,
            run=self.run,
            keep=options.local_keep,
            group=comm.new_group(),
            incompatible=self.incompatibility,
        )
        if comm.rank() == 0:
            log.info(
                "local tier under %s: every %d steps, %d kept per node, %d replica(s); %s",
                self.root,
                options.local_interval,
                options.local_keep,
                self.replicas,
                self.nodes.describe(),
            )

    def _clean(self) -> None:
        """The node's leader: remove this run's leftovers; say what other runs keep in ``local_dir``."""
        remove_leftovers(self.storage, self.root)
        for line in other_runs(self.storage, self.storage.root, self.root):
            log.warning("local_dir also holds another run's local checkpoints, not loaded, not deleted: %s", line)

    @property
    def times(self) -> LocalTimes:
        return self.saver.times

    @property
    def staging_bytes(self) -> int:
        return self.saver.staging.nbytes

    def incompatibility(self, marker: LocalMarker) -> str | None:
        """Why this job cannot load a copy (another run, another layout, other nodes), or None."""
        if marker.run != self.run:
            return f"saved by another run ({marker.run or 'unrecorded'}, this run is {self.run})"
        return marker.incompatibility(self.topology.describe(), self.nodes.world_size, self.nodes.sizes)

    # ---------------------------------------------------------------- saving
    def is_due(self, iteration: int) -> bool:
        return self.policy.should_save(iteration, 0.0, 0.0)

    def save(self, iteration: int, state: TrainState, files: Mapping[str, bytes] | None = None) -> None:
        """Every rank: snapshot ``state`` into host memory and write, replicate and commit it in the background.

        ``files``: this rank's small files, kept, replicated and fetched with its copy.
        """
        self.saver.start(iteration, collect(state, iteration=iteration), files)
        log.debug("local-tier save %d: training resumed after %.3f s", iteration, self.times.last_stall_seconds)

    def poll(self, blocking: bool) -> bool:
        """Collective: commit the pending local save when every rank is done (``blocking``: wait for it)."""
        return self.saver.poll(blocking)

    def close(self) -> None:
        self.saver.poll(blocking=True)

    # --------------------------------------------------------------- loading
    def load(self, state: TrainState, opts: LoadOptions, loader: LoadPipeline) -> LoadResult | None:
        """Collective: the local tier when it has the newest complete iteration, else the persistent store."""
        if opts.finetune:  # a new run from weights: what the persistent store (release/) is for
            return loader.run(state, opts)
        found, error = None, None
        if opts.iteration is None:
            try:
                found = loader.find(opts)
            except CheckpointError as exc:  # raised on every rank alike: every rank takes this branch
                error = exc
                log.warning("cannot read the persistent checkpoint (%s); looking in the local tier", exc)
        tried: list[tuple[int, str]] = []  # saves that failed: kept (a fetch may succeed next time)
        while True:
            choice, failed = choose(
                self.storage,
                self.root,
                self.nodes,
                self.incompatibility,
                newer_than=_persistent_iteration(found),
                exact=opts.iteration,
                verify=opts.verify,
                skip=tried,
            )
            tried += failed
            if choice is None:
                break
            result = self._load_choice(state, opts, loader, choice)
            if result is not None:
                self._forget_newer(choice.iteration, tried, opts)
                return result
            tried.append(choice.save)
        if error is not None:
            raise error
        result = loader.run(state, opts) if opts.iteration is not None else loader.run_found(state, opts, found)
        self._forget_newer(result.iteration if result else 0, tried, opts)
        if result is not None:
            log.info(
                "rank %d loaded iteration %d from the persistent store %s", comm.rank(), result.iteration, result.path
            )
        return result

    def _load_choice(
        self, state: TrainState, opts: LoadOptions, loader: LoadPipeline, choice: Choice
    ) -> LoadResult | None:
        try:
            path = fetch(self.storage, self.root, choice)
        except CheckpointError as exc:  # agreed: raised on every rank
            log.warning("local tier: %s; trying the next older local checkpoint, then the persistent store", exc)
            return None
        mine = choice.sources[comm.rank()]
        tiers = {owner: (s.tier, s.describe()) for owner, s in choice.sources.items()}
        meta: CheckpointMetadata = marker_of(mine.offer).to_metadata()
        log.info(
            "rank %d loads local-tier iteration %d (non-persistent): %s", comm.rank(), choice.iteration, mine.describe()
        )
        return loader.run_opened(state, opts, LocalSnapshotFormat(), self.storage, path, meta, tiers)

    def _forget_newer(self, iteration: int, failed: list[tuple[int, str]], opts: LoadOptions) -> None:
        """Each leader: local copies newer than what a resume loaded belong to an abandoned future; delete them.

        Only after a load of the newest checkpoint (no ``iteration=``): a load of an
        explicit older iteration reads only (an evaluation sharing ``local_dir`` must not
        wipe the training job's newer copies; a job that rolls back and trains on prunes
        them at its first local commit, :mod:`~shardpoint.tier.retention`). Spared too:
        the saves that were tried and failed (``failed``: a damaged copy of one rank, a
        fetch that a full disk refused; the other copies are intact and the next local
        commit prunes them), and copies of other layouts (a job at another layout that
        only loads must not wipe the training job's tier).
        """
        if self.is_leader and opts.iteration is None:
            prune_node(
                self.storage,
                self.root,
                iteration,
                self.options.local_keep,
                self.incompatibility,
                newer_only=True,
                spare=set(failed),
            )


def _persistent_iteration(found: tuple[str, str, str] | None) -> int:
    """The iteration the persistent store would load; a release outranks the local tier (the user chose it)."""
    if found is None:
        return -1
    meta = CheckpointMetadata.from_json(found[2], found[1])
    return sys.maxsize if meta.release else meta.iteration
