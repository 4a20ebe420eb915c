"""The collective choice of what to load from the local tier, and from which copy for each rank.

Every rank runs the same sequence on the control group::

    offer     each node's leader lists the committed copies in its local_dir; every
              rank receives every node's list (one all-gather)
    plan      every rank computes the same answer from the same lists: the saves
              (iteration and save id, newer than the persistent one) of which every
              rank's files have at least one copy saved at this job's layout, newest
              first, and for each rank its copies in order of preference: on its own
              node first, then the other nodes in ring order
    verify    the node holding each rank's preferred copy checksums it (the rank
              itself when the copy is on its node, else a rank of that node); the
              outcomes are all-gathered; a damaged or missing copy is named in the log
              and the rank's next copy is tried in the next round (at most
              local_replicas + 1 rounds); when no copy of some rank's files is intact,
              the next older save is verified the same way

The answer is a :class:`Choice`: per rank, its tier (``"local"``: a copy on its own
node's disk, ``"peer"``: a copy on another node, sent over the process group by
:mod:`shardpoint.tier.fetch`) and source. None means the next tier, the persistent
store, is used, and the log says why: no local checkpoint, one saved at another
layout or on other nodes (the tier is bound to its layout, invariant 12), one
incomplete across ranks, or every complete save newer than the persistent one has
a rank whose every copy failed its checksum. Copies are grouped by save id, never
by iteration alone: after a crash during a publish, one rank's copy of an older
save of the same iteration is not mixed with another rank's copy of the newer one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from shardpoint.catalog.integrity import checksum_file
from shardpoint.catalog.metadata import FileRecord
from shardpoint.parallel import comm
from shardpoint.storage.base import Storage
from shardpoint.tier.marker import LocalMarker, held_copies
from shardpoint.tier.placement import Nodes

__all__ = ["LOCAL", "PEER", "Candidate", "Choice", "Offer", "Source", "choose", "marker_of", "offers", "plan"]

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
    save_id: str = ""  # the save it belongs to (LocalMarker.save_id)

    @property
    def save(self) -> tuple[int, str]:
        return self.iteration, self.save_id


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
class Candidate:
    """One save of which every rank's files have a copy: each rank's copies by preference."""

    iteration: int
    save_id: str
    copies: dict[int, list[Offer]]

    @property
    def save(self) -> tuple[int, str]:
        return self.iteration, self.save_id


@dataclass(frozen=True)
class Choice:
    iteration: int
    sources: dict[int, Source]
    save_id: str = ""

    @property
    def save(self) -> tuple[int, str]:
        return self.iteration, self.save_id


Incompatibility = Callable[[LocalMarker], "str | None"]


def offers(storage: Storage, root: str, nodes: Nodes, incompatible: Incompatibility) -> list[Offer]:
    """Collective: every node's committed copies (each leader scans its own local_dir)."""
    me = comm.rank()
    mine: list[Offer] = []
    if me == nodes.leader(me):
        node = nodes.node_of(me)
        for c in held_copies(storage, root):
            mine.append(
                Offer(
                    c.iteration,
                    c.owner,
                    node,
                    c.path,
                    c.marker.files,
                    c.marker.to_json(),
                    incompatible(c.marker),
                    c.marker.save_id,
                )
            )
    return [offer for part in comm.agree_all(lambda: mine, "listing local-tier copies") for offer in part]


def plan(
    all_offers: Sequence[Offer], nodes: Nodes, newer_than: int, exact: int | None = None
) -> tuple[list[Candidate], str]:
    """The saves to try, newest first (iteration, then save id), or ``([], why none)``. Pure.

    A save is a candidate when every rank's files have a copy of that very save: copies
    of two saves of one iteration (a crash between two ranks' publishes) never mix.
    """
    usable = [o for o in all_offers if o.problem is None and 0 <= o.owner < nodes.world_size]
    wanted = [o for o in usable if (o.iteration == exact if exact is not None else o.iteration > newer_than)]
    by_save: dict[tuple[int, str], dict[int, list[Offer]]] = {}
    for o in wanted:
        by_save.setdefault(o.save, {}).setdefault(o.owner, []).append(o)
    complete = [
        Candidate(it, sid, {owner: _preferred(owner, copies, nodes) for owner, copies in sorted(owners.items())})
        for (it, sid), owners in sorted(by_save.items(), reverse=True)
        if len(owners) == nodes.world_size
    ]
    if complete:
        return complete, ""
    foreign = [o for o in all_offers if o.problem is not None]
    if not wanted and foreign:
        why = f"its checkpoints were {foreign[0].problem}: the local tier loads only at the layout it was saved at"
        return [], why
    if not wanted:
        target = f"iteration {exact}" if exact is not None else f"a checkpoint newer than iteration {newer_than}"
        return [], f"it has no {target}"
    newest = max(by_save)
    lost = sorted(set(range(nodes.world_size)) - set(by_save[newest]))
    return [], f"iteration {newest[0]} has no copy of rank(s) {lost[:8]}'s files of that save on any node"


def choose(
    storage: Storage,
    root: str,
    nodes: Nodes,
    incompatible: Incompatibility,
    *,
    newer_than: int,
    exact: int | None,
    verify: bool,
    skip: Collection[tuple[int, str]] = (),
) -> tuple[Choice | None, list[tuple[int, str]]]:
    """Collective: the newest verified choice (not among ``skip``), and the saves that failed verification.

    None means the persistent store is next; the log says why.
    """
    found = offers(storage, root, nodes, incompatible)
    candidates, why = plan(found, nodes, newer_than, exact)
    candidates = [c for c in candidates if c.save not in skip]
    if not candidates:
        if comm.rank() == 0:
            why = why or "no copy that was not tried already"
            (log.warning if found else log.info)("local tier (%s) not used: %s; next: the persistent store", root, why)
        return None, []
    failed: list[tuple[int, str]] = []
    for candidate in candidates:
        sources, why = _verify_rounds(storage, nodes, candidate, verify)
        if sources is not None:
            return Choice(candidate.iteration, sources, candidate.save_id), failed
        failed.append(candidate.save)
        log.warning("local tier: %s; trying the next older local checkpoint", why)
    log.warning(
        "local tier not used: no local checkpoint has an intact copy of every rank's files; next: the persistent store"
    )
    return None, failed


def _preferred(owner: int, copies: list[Offer], nodes: Nodes) -> list[Offer]:
    """The owner's own node first, then the next nodes of the ring (spreading fetches as placement spread copies)."""
    home = nodes.node_of(owner)
    return sorted(copies, key=lambda o: ((o.node - home) % nodes.count, o.path))


def _server(offer: Offer, nodes: Nodes) -> int:
    """The rank that reads ``offer``: its owner when the copy is on the owner's node, else a rank of that node."""
    ranks = nodes.members[offer.node]
    return offer.owner if offer.owner in ranks else ranks[offer.owner % len(ranks)]


def _verify_rounds(
    storage: Storage, nodes: Nodes, candidate: Candidate, verify: bool
) -> tuple[dict[int, Source] | None, str]:
    """Check each rank's preferred copy; a damaged one is named and the next copy tried, round by round."""
    me, iteration = comm.rank(), candidate.iteration
    remaining = {owner: list(copies) for owner, copies in candidate.copies.items()}
    chosen: dict[int, Source] = {}
    while len(chosen) < nodes.world_size:
        exhausted = sorted(o for o, copies in remaining.items() if o not in chosen and not copies)
        if exhausted:
            return None, f"no intact copy of rank(s) {exhausted[:8]}'s files of iteration {iteration} on any node"
        todo = {o: copies[0] for o, copies in remaining.items() if o not in chosen}
        checked = [(o, _check(storage, offer, verify)) for o, offer in todo.items() if _server(offer, nodes) == me]
        results = comm.agree_all(checked.copy, "verifying local-tier copies")
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
