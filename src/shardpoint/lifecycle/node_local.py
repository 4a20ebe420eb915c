"""Node-local checkpoint directories: local-first saves (``upload_to``) with no shared filesystem.

On clouds each node has its own NVMe and the nodes share only an object store. A
``Checkpointer(local_dir, upload_to="s3://...")`` whose ``local_dir`` is a different,
unshared directory on each node cannot use the shared-directory commit (rank 0
lists and renames a directory every rank wrote into). Here instead:

**Who shares a directory** is found out, not assumed: at construction every rank
writes a probe file named with a token from rank 0 into its ``local_dir``, and each
rank reports which ranks' probes it can see. Ranks that see each other's probes
form a *node* (a storage domain); its lowest rank is the node's *leader*. All ranks
in one domain: the classic shared-directory protocol. Why a probe rather than host
names or ``LOCAL_RANK``: what matters is which files a rank can read, and the same
path may be a node's own NVMe on one cluster and a Lustre mount on another (or, in
tests, different paths on one machine). The probe names are fresh random names, so
no NFS negative lookup cache can hide them. ``node_local=True/False`` skips it.

**A save** (every rank; see :meth:`NodeLocal.begin`, :meth:`NodeLocal.commit`)::

    each leader creates .shardpoint-tmp-<name>-<token>/ in its own local_dir
    -> every rank writes its files into its node's directory
    -> file records are gathered through collectives (nobody reads another node's disk)
    -> each leader writes shardpoint-node.json (its node's files, the full marker
       embedded) and renames its directory into place
    -> every rank uploads the files it wrote into the upload's own staging directory
       on the store, named by rank 0 (:mod:`shardpoint.lifecycle.upload`)
    -> once every rank's upload is done, rank 0 publishes it there (shardpoint.json
       last, as a direct save to that store commits), then the tracker.

The local directories hold **no** ``shardpoint.json`` and no tracker: a node's copy
is a part (``"partial": true``, ``"ranks": [r..s]``) and can never be mistaken for a
complete checkpoint. The object store's tracker is the only one that names what to
load; on a load every file a rank reads comes from its node's copy when that copy is
committed, belongs to the checkpoint the remote tracker names (same size and
checksum as in the remote marker) and is intact, and from the object store otherwise
(:mod:`shardpoint.lifecycle.node_view`).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardpoint.catalog.layout import Layout
from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.lifecycle import commit
from shardpoint.lifecycle.policy import CheckpointInfo, PreservationPolicy, select_for_deletion
from shardpoint.parallel import comm
from shardpoint.storage.base import Storage

__all__ = [
    "NODE_MARKER",
    "NodeLocal",
    "NodeLocalError",
    "NodeMarker",
    "PartialCheckpointError",
    "committed_metadata",
    "detect",
    "probe_domains",
]

log = logging.getLogger(__name__)

NODE_MARKER = "shardpoint-node.json"
PROBE_PREFIX = ".shardpoint-probe-"


class PartialCheckpointError(CheckpointError):
    """A directory holds one node's part of a checkpoint, not a whole checkpoint."""


class NodeLocalError(CheckpointError):
    """The ranks' local directories are neither all shared nor split into nodes cleanly."""


@dataclass(frozen=True)
class NodeMarker:
    """``shardpoint-node.json``: what one node's local copy of a checkpoint holds.

    ``files`` are this node's files (a subset of ``checkpoint.files``); ``checkpoint``
    is the full marker that was uploaded, so a later load can tell whether this copy
    belongs to the checkpoint the remote tracker names.
    """

    ranks: tuple[int, ...]
    world_size: int
    files: dict[str, FileRecord]
    checkpoint: CheckpointMetadata

    def to_json(self) -> str:
        return json.dumps(
            {
                "partial": True,
                "ranks": list(self.ranks),
                "world_size": self.world_size,
                "files": {k: {"size": r.size, "xxh3_64": r.xxh3_64} for k, r in sorted(self.files.items())},
                "checkpoint": json.loads(self.checkpoint.to_json()),
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> NodeMarker:
        try:
            data = json.loads(text)
            ranks = tuple(int(r) for r in data["ranks"])
            files = {str(k): FileRecord(int(v["size"]), str(v["xxh3_64"])) for k, v in data["files"].items()}
            world = int(data["world_size"])
            checkpoint = data["checkpoint"]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{where} is not a valid node marker ({exc}); delete that directory") from None
        return cls(ranks, world, files, CheckpointMetadata.from_json(json.dumps(checkpoint), where))

    def describe_ranks(self) -> str:
        return f"ranks {self.ranks[0]}..{self.ranks[-1]} of {self.world_size}" if self.ranks else "no ranks"


def read_node_marker(storage: Storage, directory: str) -> NodeMarker | None:
    """The node marker of ``directory``, or None when it has none (or an unreadable one)."""
    path = storage.join(directory, NODE_MARKER)
    if not storage.exists(path):
        return None
    try:
        return NodeMarker.from_json(storage.read_bytes(path), path)
    except CorruptCheckpointError as exc:
        log.warning("ignoring %s", exc)
        return None


def probe_domains(storage: Storage, root: str) -> list[tuple[int, ...]]:
    """Collective: for each rank, the ranks whose files it can see under ``root`` (itself included).

    Every rank writes ``<root>/.shardpoint-probe-<token>-<rank>``, then checks which of
    the world's probe files exist, then removes its own.
    """
    rank, world = comm.rank(), comm.world_size()
    token = comm.broadcast(secrets.token_hex(6) if rank == 0 else None)

    def probe(r: int) -> str:
        return storage.join(root, f"{PROBE_PREFIX}{token}-{r}")

    def write_probe() -> None:
        storage.makedirs(root)
        storage.write_atomic(probe(rank), b"")

    comm.agree(write_probe, "probing the local dir")
    seen = tuple(r for r in range(world) if storage.exists(probe(r)))
    domains = [tuple(d) for d in comm.all_gather(seen)]
    storage.remove(probe(rank))
    return domains


def detect(storage: Storage, root: str, layout: Layout, node_local: bool | None, has_remote: bool) -> NodeLocal | None:
    """A :class:`NodeLocal` when ranks do not share ``root``, else None (the shared-directory protocol).

    Collective when there is a remote, several ranks and ``node_local`` is not False:
    the probe of :func:`probe_domains` finds the nodes. ``node_local=True`` uses the
    node-local protocol even when every rank shares the directory; ``False`` skips the
    probe and uses the shared-directory protocol.

    Raises:
        ValueError: ``node_local=True`` without ``upload_to`` (no node would hold a
            whole checkpoint), or a mount layout where visibility is not symmetric.
    """
    if node_local and not has_remote:
        raise ValueError("node_local=True needs upload_to='s3://...': no node would hold a whole checkpoint")
    if node_local is False or not has_remote or comm.world_size() == 1 or not storage.is_local:
        return None
    domains = probe_domains(storage, root)
    _check_partition(domains, root)
    if all(len(d) == comm.world_size() for d in domains) and not node_local:
        return None
    if node_local is None:
        log.info("%s is not shared by all ranks (%d nodes): node-local commits", root, len(set(domains)))
    return NodeLocal(storage, root, layout, domains)


def _check_partition(domains: Sequence[tuple[int, ...]], root: str) -> None:
    for rank, domain in enumerate(domains):
        if rank not in domain or any(domains[other] != domain for other in domain):
            raise NodeLocalError(
                f"ranks see each other's files under {root} inconsistently (rank {rank} sees {list(domain)}); "
                "give every node one directory that all its ranks share, or pass node_local=False for a shared one"
            )


class NodeLocal:
    """This rank's node: who shares its local directory and who leads it.

    Args:
        storage: the local storage of ``root``.
        root: this node's local checkpoint directory.
        layout: directory names.
        domains: for each global rank, the ranks that share its directory.
    """

    def __init__(self, storage: Storage, root: str, layout: Layout, domains: Sequence[tuple[int, ...]]):
        self.storage = storage
        self.root = root
        self.layout = layout
        self.rank = comm.rank()
        self.world_size = len(domains)
        self.ranks: tuple[int, ...] = tuple(domains[self.rank])
        self.leader = self.ranks[0]
        self.nodes = sorted(set(domains))

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def begin(self, create: Callable[[], str], group: Any = None) -> str:
        """Collective over ``group``: each leader runs ``create`` in its own directory; returns this node's path."""
        paths = comm.all_gather(
            comm.agree(lambda: create() if self.is_leader else None, "preparing the node-local directory", group),
            group,
        )
        return paths[self.leader]

    def commit(
        self,
        tmp: str,
        final: str,
        records: Mapping[str, FileRecord],
        meta: CheckpointMetadata,
        policies: Sequence[PreservationPolicy],
    ) -> None:
        """Collective: every leader publishes its node's part with a node marker, then applies retention.

        ``meta`` is complete on rank 0 only (it gathered the records); it is broadcast so
        every node marker embeds the marker that will be uploaded.
        """
        full = CheckpointMetadata.from_json(comm.broadcast(meta.to_json() if self.rank == 0 else None), final)
        written = comm.all_gather(sorted(records))
        mine = {name for r in self.ranks for name in written[r]}
        marker = NodeMarker(self.ranks, self.world_size, {n: full.files[n] for n in mine if n in full.files}, full)

        def publish() -> None:
            self.storage.write_atomic(self.storage.join(tmp, NODE_MARKER), marker.to_json().encode())
            self.storage.publish_dir(tmp, final)

        comm.agree(lambda: publish() if self.is_leader else None, "committing the node-local copies")
        if self.is_leader:
            self.apply_retention(policies)

    def apply_retention(self, policies: Sequence[PreservationPolicy]) -> list[str]:
        """Delete this node's parts that no policy keeps (the newest is always kept); a failure only warns."""
        parts = self.parts()
        if not policies or not parts:
            return []
        infos = [CheckpointInfo(it, m.checkpoint.metrics) for it, m in parts.items()]
        removed = []
        try:
            for iteration in select_for_deletion(infos, policies, {max(parts)}):
                name = self.layout.dir_name(iteration)
                self.storage.remove(self.storage.join(self.root, name))
                removed.append(name)
        except (OSError, CheckpointError) as exc:
            log.warning("retention could not delete old node-local copies under %s: %s", self.root, exc)
        return removed

    def parts(self) -> dict[int, NodeMarker]:
        """This node's committed parts of regular checkpoints, by iteration."""
        found = {}
        for name in self.storage.listdir(self.root):
            iteration = self.layout.parse_dir_name(name)
            if iteration is None:
                continue
            marker = read_node_marker(self.storage, self.storage.join(self.root, name))
            if marker is not None:
                found[iteration] = marker
        return found


def committed_metadata(storage: Storage, directory: str) -> CheckpointMetadata:
    """The marker of a just-committed checkpoint directory: ``shardpoint.json``, or a node part's embedded one."""
    marker = read_node_marker(storage, directory)
    return marker.checkpoint if marker is not None else commit.read_marker(storage, directory)


def partial_error(storage: Storage, root: str, layout: Layout) -> PartialCheckpointError | None:
    """The error for a root that holds node-local parts but no committed checkpoint, else None."""
    for entry in reversed(commit.list_checkpoints(storage, root, layout)):
        marker = read_node_marker(storage, entry.path)
        if marker is not None:
            return PartialCheckpointError(
                f"{entry.path} is one node's part of a checkpoint ({marker.describe_ranks()}), not a whole "
                "checkpoint: load it through the object store it was uploaded to (pass the same upload_to=, "
                "or load from the s3:// path)"
            )
    return None
