"""Which ranks hold whose replicas: losing any ``local_replicas`` nodes leaves a copy of every rank's files.

Nodes are found, not assumed: ranks that see each other's probe files in
``local_dir`` share a node (:func:`shardpoint.lifecycle.node_local.probe_domains`).
They are numbered by their lowest rank. The rank at position ``j`` of node ``k``
keeps its own files on node ``k`` and sends replica ``i`` (1..R) to the rank at
position ``j mod size`` of node ``(k + i) mod n``. A rank's copies therefore sit on
R + 1 consecutive, distinct nodes of the ring (R < n), and any R lost nodes leave
one of them. With nodes of equal size every rank holds exactly R replicas, so the
disk and RAM a node spends on replicas equals R times its own ranks' state.

Pure functions over plain values: tested with no process group and no disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardpoint.errors import CheckpointError

__all__ = ["Nodes", "TierLayoutError", "held_by", "nodes_from_domains", "place_replicas"]


class TierLayoutError(CheckpointError):
    """The ranks' local directories are neither shared per node nor apart between nodes."""


@dataclass(frozen=True)
class Nodes:
    """The job's nodes: the ranks of each, nodes ordered by their lowest rank."""

    members: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def world_size(self) -> int:
        return sum(len(m) for m in self.members)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Ranks per node, sorted: what a restart must match to use the local tier."""
        return tuple(sorted(len(m) for m in self.members))

    def node_of(self, rank: int) -> int:
        for index, ranks in enumerate(self.members):
            if rank in ranks:
                return index
        raise KeyError(f"rank {rank} is on no node of {self.members}")

    def leader(self, rank: int) -> int:
        """The lowest rank of ``rank``'s node: it scans and prunes the node's directory."""
        return self.members[self.node_of(rank)][0]

    def describe(self) -> str:
        sizes = sorted({len(m) for m in self.members})
        per_node = "/".join(map(str, sizes))
        return f"{self.count} node{'s' if self.count != 1 else ''} x {per_node} rank{'s' if sizes != [1] else ''}"


def nodes_from_domains(domains: Sequence[Sequence[int]], root: str) -> Nodes:
    """The nodes from each rank's probe result (the ranks whose files it sees, itself included).

    Raises:
        TierLayoutError: visibility is not a partition (rank a sees b but b does not
            see a, or a rank does not see itself): ``local_dir`` must be one directory
            shared by the ranks of a node and by no other node.
    """
    seen = [tuple(sorted(d)) for d in domains]
    for rank, domain in enumerate(seen):
        if rank not in domain or any(seen[other] != domain for other in domain):
            raise TierLayoutError(
                f"ranks see each other's files under local_dir={root} inconsistently (rank {rank} sees "
                f"{list(domain)}); give each node one local directory that all its ranks share and no other node sees"
            )
    return Nodes(tuple(sorted(set(seen))))


def place_replicas(nodes: Nodes, replicas: int) -> dict[int, tuple[int, ...]]:
    """``{owner rank: ranks on other nodes holding its replicas}``, replica 1 first.

    Raises:
        ValueError: ``replicas`` is negative or not smaller than the number of nodes
            (a replica must sit on a node other than its owner's and the others').
    """
    if replicas < 0:
        raise ValueError(f"local_replicas must be >= 0, got {replicas}")
    if replicas and replicas >= nodes.count:
        raise ValueError(
            f"local_replicas={replicas} needs at least {replicas + 1} nodes (each copy on another node); "
            f"this job has {nodes.count}"
        )
    placement = {}
    for k, ranks in enumerate(nodes.members):
        for j, owner in enumerate(ranks):
            holders = []
            for i in range(1, replicas + 1):
                target = nodes.members[(k + i) % nodes.count]
                holders.append(target[j % len(target)])
            placement[owner] = tuple(holders)
    return placement


def held_by(placement: dict[int, tuple[int, ...]], rank: int) -> list[int]:
    """The owners whose replicas ``rank`` holds, in rank order."""
    return sorted(owner for owner, holders in placement.items() if rank in holders)
