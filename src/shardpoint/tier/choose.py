"""The collective choice of what to load from the local tier, and from which copy for each rank.

Every rank runs the same sequence on the control group::

    offer     each node's leader lists the committed copies in its local_dir; every
              rank receives every node's list (one all-gather)
    plan      every rank computes the same answer from the same lists: the newest
              iteration (newer than the persistent one) of which every rank's files
              have at least one copy saved at this job's layout, and for each rank its
              copies in order of preference: on its own node first, then the other
              nodes in ring order
    verify    the node holding each rank's preferred copy checksums it (the rank
              itself when the copy is on its node, else a rank of that node); the
              outcomes are all-gathered; a damaged or missing copy is named in the log
              and the rank's next copy is tried in the next round (at most
              local_replicas + 1 rounds)

The answer is a :class:`Choice`: per rank, its tier (``"local"``: a copy on its own
node's disk, ``"peer"``: a copy on another node, sent over the process group by
:mod:`shardpoint.tier.fetch`) and source. None means the next tier, the persistent
store, is used, and the log says why: no local checkpoint, one saved at another
layout or on other nodes (the tier is bound to its layout, invariant 12), one
incomplete across ranks, or a rank whose every copy failed its checksum. Only the
newest complete iteration is offered: when its copies fail, the persistent store
is next, not an older local iteration (a disk that damaged one copy is not trusted
with the older ones, and each round of checksums costs a read of the state).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from shardpoint.catalog.integrity import checksum_file
from shardpoint.catalog.metadata import FileRecord
from shardpoint.parallel import comm
from shardpoint.storage.base import Storage
from shardpoint.tier.marker import LocalMarker, held_copies
from shardpoint.tier.placement import Nodes

__all__ = ["LOCAL", "PEER", "Choice", "Offer", "Source", "choose", "marker_of", "offers", "plan"]

log = logging.getLogger(__name__)

LOCAL, PEER = "local", "peer"


@dataclass(frozen=True)
class Offer:
    """One committed copy a node holds: ``owner``'s files of ``iteration`` at ``path`` on node ``node``."""

    iteration: int
    owner: int
    node: int
    path: str
    files: dict[str, FileRecord]
    marker: str  # the copy's marker (JSON), so a rank that fetches it can publish its own copy
    problem: str | None = None  # why this job cannot load it (another layout), or None


@dataclass(frozen=True)
class Source:
    """Where one rank's files come from: its tier, the rank that reads them, and the copy."""

    owner: int
    tier: str
    server: int
    offer: Offer

    def describe(self) -> str:
        if self.tier == LOCAL:
            return f"own node's copy {self.offer.path}"
        return f"replica held by rank {self.server} ({self.offer.path}), received over the process group"


@dataclass(frozen=True)
class Choice:
    iteration: int
    sources: dict[int, Source]


Incompatibility = Callable[[LocalMarker], "str | None"]


def offers(storage: Storage, root: str, nodes: Nodes, incompatible: Incompatibility) -> list[Offer]:
    """Collective: every node's committed copies (each leader scans its own local_dir)."""
    me = comm.rank()
    mine: list[Offer] = []
    if me == nodes.leader(me):
        node = nodes.node_of(me)
        for c in held_copies(storage, root):
            mine.append(
                Offer(c.iteration, c.owner, node, c.path, c.marker.files, c.marker.to_json(), incompatible(c.marker))
            )
    return [offer for part in comm.agree_all(lambda: mine, "listing local-tier copies") for offer in part]


def plan(
    all_offers: Sequence[Offer], nodes: Nodes, newer_than: int, exact: int | None = None
) -> tuple[int | None, dict[int, list[Offer]], str]:
    """The iteration to try and each rank's copies by preference, or ``(None, {}, why not)``. Pure."""
    usable = [o for o in all_offers if o.problem is None and 0 <= o.owner < nodes.world_size]
    wanted = sorted(
        {o.iteration for o in usable if (o.iteration == exact if exact is not None else o.iteration > newer_than)}
    )
    foreign = [o for o in all_offers if o.problem is not None]
    for iteration in reversed(wanted):
        by_owner: dict[int, list[Offer]] = {}
        for o in usable:
            if o.iteration == iteration:
                by_owner.setdefault(o.owner, []).append(o)
        if len(by_owner) == nodes.world_size:
            return iteration, {owner: _preferred(owner, copies, nodes) for owner, copies in by_owner.items()}, ""
    if not wanted and foreign:
        why = f"its checkpoints were {foreign[0].problem}: the local tier loads only at the layout it was saved at"
        return None, {}, why
    if not wanted:
        target = f"iteration {exact}" if exact is not None else f"a checkpoint newer than iteration {newer_than}"
        return None, {}, f"it has no {target}"
    newest = wanted[-1]
    have = {o.owner for o in usable if o.iteration == newest}
    lost = sorted(set(range(nodes.world_size)) - have)
    return None, {}, f"iteration {newest} has no copy of rank(s) {lost[:8]}'s files on any node"


def choose(
    storage: Storage,
    root: str,
    nodes: Nodes,
    incompatible: Incompatibility,
    *,
    newer_than: int,
    exact: int | None,
    verify: bool,
) -> Choice | None:
    """Collective: the verified choice, or None (then the log says why the persistent store is next)."""
    found = offers(storage, root, nodes, incompatible)
    iteration, candidates, why = plan(found, nodes, newer_than, exact)
    if iteration is None:
        if comm.rank() == 0:
            (log.warning if found else log.info)("local tier (%s) not used: %s; next: the persistent store", root, why)
        return None
    sources, why = _verify_rounds(storage, nodes, iteration, candidates, verify)
    if sources is None:
        log.warning("local tier not used: %s; loading from the persistent store", why)
        return None
    return Choice(iteration, sources)


def _preferred(owner: int, copies: list[Offer], nodes: Nodes) -> list[Offer]:
    """The owner's own node first, then the next nodes of the ring (spreading fetches as placement spread copies)."""
    home = nodes.node_of(owner)
    return sorted(copies, key=lambda o: ((o.node - home) % nodes.count, o.path))


def _server(offer: Offer, nodes: Nodes) -> int:
    """The rank that reads ``offer``: its owner when the copy is on the owner's node, else a rank of that node."""
    ranks = nodes.members[offer.node]
    return offer.owner if offer.owner in ranks else ranks[offer.owner % len(ranks)]


def _verify_rounds(
    storage: Storage, nodes: Nodes, iteration: int, candidates: Mapping[int, list[Offer]], verify: bool
) -> tuple[dict[int, Source] | None, str]:
    """Check each rank's preferred copy; a damaged one is named and the next copy tried, round by round."""
    me = comm.rank()
    remaining = {owner: list(copies) for owner, copies in candidates.items()}
    chosen: dict[int, Source] = {}
    while len(chosen) < nodes.world_size:
        exhausted = sorted(o for o, copies in remaining.items() if o not in chosen and not copies)
        if exhausted:
            return None, f"no intact copy of rank(s) {exhausted[:8]}'s files of iteration {iteration} on any node"
        todo = {o: copies[0] for o, copies in remaining.items() if o not in chosen}
        checked = [(o, _check(storage, offer, verify)) for o, offer in todo.items() if _server(offer, nodes) == me]
        results = comm.agree_all(lambda checked=checked: checked, "verifying local-tier copies")
        for owner, problem in (r for part in results for r in part):
            offer = remaining[owner].pop(0)
            if problem is None:
                server = _server(offer, nodes)
                chosen[owner] = Source(owner, LOCAL if server == owner else PEER, server, offer)
            elif me in (owner, _server(offer, nodes)) or me == 0:
                log.warning(
                    "local tier: rank %d's copy of iteration %d at %s (node of rank %d) is damaged: %s; "
                    "trying the next copy",
                    owner,
                    iteration,
                    offer.path,
                    _server(offer, nodes),
                    problem,
                )
    return chosen, ""


def _check(storage: Storage, offer: Offer, verify: bool) -> str | None:
    """What is wrong with a copy on this rank's node (missing, wrong size, wrong checksum), or None."""
    for name, record in sorted(offer.files.items()):
        path = storage.join(offer.path, name)
        try:
            if not storage.exists(path):
                return f"{path} is missing"
            size = storage.size(path)
            if size != record.size:
                return f"{path} has {size} bytes, its marker records {record.size}"
            if verify and checksum_file(storage, path) != record.xxh3_64:
                return f"{path} fails its checksum (xxh3_64 {record.xxh3_64} recorded in its marker)"
        except OSError as exc:
            return f"{path} cannot be read: {exc}"
    return None


def marker_of(offer: Offer) -> LocalMarker:
    return LocalMarker.from_json(offer.marker, offer.path)
