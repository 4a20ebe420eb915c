"""What a node's ``local_dir`` holds, and how a copy in it starts and stops existing.

::

    local_dir/
      run-persistent-3f2a9c1d/              # one run's copies: named for its persistent path
        local_0000014/                      # a non-persistent checkpoint: never iter_*/global_step*
          rank_00001/                       # rank 1's files, held by this node (rank 1's own, or a replica)
            state.pt                        # the rank's snapshot (shardpoint.tier.snapshot)
            shardpoint-local.json           # the copy's marker, written last ("persistent": false)
          .shardpoint-tmp-rank_00003-<tok>/ # a copy being written or received: invisible
      run-other-0b1c2d3e/                   # another run's: never loaded, never deleted, reported

Each run has its own directory (:func:`run_dir_name`, from the persistent path the
Checkpointer was given), and each marker records that path and the save it belongs
to (``save_id``, one per save, the same on every rank's copy): a run never loads,
prunes or overwrites another run's copies, and one rank's copy of one save is never
mixed with another rank's copy of another save of the same iteration.

Each copy is committed on its own, as a persistent checkpoint is (marker last, then
one rename): a directory named ``rank_NNNNN`` with a valid marker is a complete copy,
anything else is not looked at. A rank's copy is only published after every rank
agreed that all of that save's files and replicas were written (see
:mod:`shardpoint.tier.local_save`), so a published copy always belongs to a save that
was complete everywhere.

The names keep the tiers apart: persistent tools (``inspect``, ``prune``, retention,
discovery) only ever look at ``iter_*`` / ``global_step*`` / ``release`` directories
and at ``shardpoint.json``; a local copy has neither, and its marker says
``"persistent": false``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardpoint._version import __version__
from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord
from shardpoint.errors import CorruptCheckpointError
from shardpoint.lifecycle.commit import TMP_PREFIX, TRASH_PREFIX
from shardpoint.storage.base import Storage

__all__ = [
    "LOCAL_MARKER",
    "HeldCopy",
    "LocalMarker",
    "copy_dir",
    "describe_local_dir",
    "held_copies",
    "holds_local_tier",
    "is_local_tier_dir",
    "iteration_dir",
    "mark_copy",
    "other_runs",
    "publish_copy",
    "remove_copy",
    "remove_leftovers",
    "run_dir_name",
    "tmp_copy_dir",
]

log = logging.getLogger(__name__)

LOCAL_MARKER = "shardpoint-local.json"
_ITERATION = re.compile(r"^local_(\d{7,})$")
_OWNER = re.compile(r"^rank_(\d{5,})$")
_RUN = re.compile(r"^run-[A-Za-z0-9._-]{0,40}-[0-9a-f]{8}$")


def run_dir_name(run: str) -> str:
    """The directory of ``local_dir`` that holds the copies of the run whose persistent path is ``run``.

    Readable (the path's last part) and distinct per path (a digest of all of it), so two
    runs sharing a ``local_dir`` never write into, prune or load each other's copies.
    """
    slug = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(run.rstrip("/")))[:40]
    return f"run-{slug}-{hashlib.sha256(run.encode()).hexdigest()[:8]}"


def _copy_roots(storage: Storage, local_dir: str) -> list[str]:
    """Every directory of ``local_dir`` holding ``local_*`` directories: each run's, and ``local_dir`` itself
    when copies were saved there before runs had directories of their own."""
    if not storage.is_dir(local_dir):
        return []
    names = storage.listdir(local_dir)
    roots = [local_dir] if any(is_local_tier_dir(n) for n in names) else []
    return roots + [storage.join(local_dir, n) for n in sorted(names) if _RUN.match(n)]


def other_runs(storage: Storage, local_dir: str, mine: str) -> list[str]:
    """What ``local_dir`` holds besides the run directory ``mine``: one line per other run (for the log)."""
    lines = []
    for root in _copy_roots(storage, local_dir):
        if os.path.abspath(root) == os.path.abspath(mine):
            continue
        copies = held_copies(storage, root)
        if copies:
            runs = sorted({c.marker.run for c in copies}) or [""]
            saved = ", ".join(repr(r) if r else "an unrecorded run" for r in runs)
            its = sorted({c.iteration for c in copies})
            lines.append(f"{root}: {len(copies)} copies of iteration(s) {its[:6]} saved by {saved}")
    return lines


def iteration_dir(storage: Storage, root: str, iteration: int) -> str:
    return storage.join(root, f"local_{iteration:07d}")


def copy_dir(storage: Storage, root: str, iteration: int, owner: int) -> str:
    """Where this node keeps (committed) ``owner``'s files of ``iteration``."""
    return storage.join(iteration_dir(storage, root, iteration), f"rank_{owner:05d}")


def tmp_copy_dir(storage: Storage, root: str, iteration: int, owner: int) -> str:
    """A fresh, invisible directory to write or receive ``owner``'s files into."""
    parent = iteration_dir(storage, root, iteration)
    return storage.join(parent, f"{TMP_PREFIX}rank_{owner:05d}-{secrets.token_hex(4)}")


def is_local_tier_dir(name: str) -> bool:
    """Whether a directory name is one of the local tier's (``local_0000014``)."""
    return _ITERATION.match(name) is not None


@dataclass(frozen=True)
class LocalMarker:
    """``shardpoint-local.json``: one rank's files of one non-persistent checkpoint.

    ``nodes`` are the ranks of each node at the save; with ``topology`` and
    ``world_size`` they bind the copy to the layout it was saved at.
    """

    iteration: int
    owner: int
    world_size: int
    topology: dict[str, int]
    nodes: tuple[tuple[int, ...], ...]
    files: dict[str, FileRecord]
    config: dict[str, Any] = field(default_factory=dict)
    consumed_samples: int | None = None
    flops: float | None = None
    wall_time: float = 0.0
    library_version: str = __version__
    run: str = ""  # the persistent path of the run that saved it ("": written before runs were recorded)
    save_id: str = ""  # the same on every rank's copy of one save, never on two saves ("": unknown)

    def to_json(self) -> str:
        return json.dumps(
            {
                "persistent": False,
                "tier": "local",
                "iteration": self.iteration,
                "owner": self.owner,
                "world_size": self.world_size,
                "topology": self.topology,
                "nodes": [list(n) for n in self.nodes],
                "files": {k: {"size": r.size, "xxh3_64": r.xxh3_64} for k, r in sorted(self.files.items())},
                "config": self.config,
                "consumed_samples": self.consumed_samples,
                "flops": self.flops,
                "wall_time": self.wall_time,
                "library_version": self.library_version,
                "run": self.run,
                "save_id": self.save_id,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> LocalMarker:
        try:
            data = json.loads(text)
            if data.get("persistent") is not False:
                raise ValueError("not marked non-persistent")
            marker = cls(
                iteration=int(data["iteration"]),
                owner=int(data["owner"]),
                world_size=int(data["world_size"]),
                topology={k: int(v) for k, v in data["topology"].items()},
                nodes=tuple(tuple(int(r) for r in n) for n in data["nodes"]),
                files={str(k): FileRecord(int(v["size"]), str(v["xxh3_64"])) for k, v in data["files"].items()},
                config=dict(data.get("config") or {}),
                consumed_samples=data.get("consumed_samples"),
                flops=data.get("flops"),
                wall_time=float(data.get("wall_time") or 0.0),
                library_version=str(data.get("library_version", "")),
                run=str(data.get("run") or ""),
                save_id=str(data.get("save_id") or ""),
            )
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptCheckpointError(
                f"{where} is not a valid local-tier marker ({exc}); delete its directory (it is non-persistent)"
            ) from None
        if any(name.startswith("/") or ".." in name.split("/") for name in marker.files):
            raise CorruptCheckpointError(f"{where}: a file name points outside the copy")
        return marker

    @property
    def node_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(len(n) for n in self.nodes))

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.files.values())

    def describe_layout(self) -> str:
        t = self.topology
        return f"tp={t.get('tp')} pp={t.get('pp')} dp={t.get('dp')} on {len(self.nodes)} node(s)"

    def incompatibility(self, topology: Mapping[str, int], world_size: int, node_sizes: tuple[int, ...]) -> str | None:
        """Why this copy cannot be loaded by a job at this layout, or None (the tier is bound to its layout)."""
        if dict(self.topology) != dict(topology) or self.world_size != world_size:
            now = f"tp={topology['tp']} pp={topology['pp']} dp={topology['dp']}"
            return f"saved at {self.describe_layout()}, this job runs {now}"
        if self.node_sizes != tuple(node_sizes):
            saved, now = (
                f"{len(self.nodes)} node(s) of {self.node_sizes} ranks",
                f"{len(node_sizes)} of {tuple(node_sizes)}",
            )
            return f"saved on {saved}, this job has {now}"
        return None

    def to_metadata(self) -> CheckpointMetadata:
        """The description a :class:`~shardpoint.lifecycle.load_pipeline.LoadResult` carries (format ``"local"``)."""
        return CheckpointMetadata(
            iteration=self.iteration,
            format="local",
            topology=dict(self.topology),
            config=dict(self.config),
            files=dict(self.files),
            consumed_samples=self.consumed_samples,
            flops=self.flops,
            wall_time=self.wall_time,
            library_version=self.library_version,
            canonical_keys=True,
        )


@dataclass(frozen=True)
class HeldCopy:
    """A committed copy found in this node's ``local_dir``."""

    iteration: int
    owner: int
    path: str
    marker: LocalMarker


def held_copies(storage: Storage, root: str) -> list[HeldCopy]:
    """Every committed copy under ``root`` (this node's ``local_dir``), oldest first; damaged markers are skipped."""
    if not storage.is_dir(root):
        return []
    found = []
    for name in storage.listdir(root):
        match = _ITERATION.match(name)
        if match is None or not storage.is_dir(storage.join(root, name)):
            continue
        for child in storage.listdir(storage.join(root, name)):
            owner = _OWNER.match(child)
            path = storage.join(root, name, child)
            marker_path = storage.join(path, LOCAL_MARKER)
            if owner is None or not storage.exists(marker_path):
                continue
            try:
                marker = LocalMarker.from_json(storage.read_bytes(marker_path), marker_path)
            except CorruptCheckpointError as exc:
                log.warning("ignoring a local copy: %s", exc)
                continue
            if (marker.iteration, marker.owner) != (int(match.group(1)), int(owner.group(1))):
                log.warning(
                    "ignoring %s: its marker names iteration %d of rank %d", path, marker.iteration, marker.owner
                )
                continue
            found.append(HeldCopy(marker.iteration, marker.owner, path, marker))
    return sorted(found, key=lambda c: (c.iteration, c.owner))


def mark_copy(storage: Storage, tmp: str, marker: LocalMarker) -> None:
    """Write the marker into a finished temporary directory (still invisible: its name is temporary)."""
    storage.write_atomic(storage.join(tmp, LOCAL_MARKER), marker.to_json().encode())


def publish_copy(storage: Storage, tmp: str, owner: int) -> str:
    """One rename of a marked temporary directory to ``rank_NNNNN``: the copy now exists. Returns its path."""
    final = storage.join(os.path.dirname(tmp.rstrip("/")), f"rank_{owner:05d}")
    storage.publish_dir(tmp, final)
    return final


def remove_copy(storage: Storage, path: str) -> None:
    """Delete a committed copy so that a crash at any moment leaves nothing that looks complete.

    It is renamed to a temporary name first (it stops being a copy in one step), then
    deleted; the iteration directory goes too once it is empty.
    """
    parent = os.path.dirname(path.rstrip("/"))
    doomed = storage.join(parent, f"{TMP_PREFIX}retired-{os.path.basename(path)}-{secrets.token_hex(4)}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    try:
        os.rmdir(parent)
    except OSError:
        pass  # other copies (or another rank's save in progress) still live there


def remove_leftovers(storage: Storage, root: str) -> list[str]:
    """Delete what interrupted saves and transfers left under ``root`` (the node's leader, at start-up)."""
    removed: list[str] = []
    if not storage.is_dir(root):
        return removed
    for name in storage.listdir(root):
        parent = storage.join(root, name)
        if not is_local_tier_dir(name) or not storage.is_dir(parent):
            continue
        for child in storage.listdir(parent):
            if child.startswith((TMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(storage.join(parent, child), ignore_errors=True)
                removed.append(f"{name}/{child}")
        try:
            os.rmdir(parent)
        except OSError:
            pass
    if removed:
        log.warning("removed %d partial local-tier copies left by an interrupted save: %s", len(removed), removed)
    return removed


def describe_local_dir(storage: Storage, local_dir: str) -> dict[str, Any]:
    """What one node's ``local_dir`` holds, as plain data (for ``shardpoint inspect``); reads markers only.

    Every row is a non-persistent checkpoint of one run as this node sees it: the ranks
    whose files it holds (its own ranks' and the replicas it keeps for other nodes).
    ``local_dir`` may also be one run's directory.
    """
    roots = [local_dir] if _RUN.match(os.path.basename(local_dir.rstrip("/"))) else _copy_roots(storage, local_dir)
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for root in roots:
        for c in held_copies(storage, root):
            row = rows.setdefault(
                (root, c.iteration),
                {
                    "name": os.path.relpath(os.path.dirname(c.path), local_dir),
                    "iteration": c.iteration,
                    "persistent": False,
                    "tier": "local",
                    "run": c.marker.run or None,
                    "ranks_held": [],
                    "world_size": c.marker.world_size,
                    "topology": c.marker.topology,
                    "nodes": len(c.marker.nodes),
                    "bytes": 0,
                    "wall_time": c.marker.wall_time,
                },
            )
            row["ranks_held"].append(c.owner)
            row["bytes"] += c.marker.total_bytes
    leftovers = [
        os.path.relpath(storage.join(root, name, child), local_dir)
        for root in roots
        for name in storage.listdir(root)
        if is_local_tier_dir(name) and storage.is_dir(storage.join(root, name))
        for child in storage.listdir(storage.join(root, name))
        if child.startswith((TMP_PREFIX, TRASH_PREFIX))
    ]
    return {
        "directory": local_dir,
        "persistent": False,
        "checkpoints": [rows[k] for k in sorted(rows, key=lambda k: (k[1], k[0]))],
        "leftovers": leftovers,
    }


def holds_local_tier(storage: Storage, root: str) -> bool:
    """Whether ``root`` is a local tier's directory (a ``local_dir``, or one run's directory in it)."""
    if not (storage.is_local and storage.is_dir(root)):
        return False
    names = storage.listdir(root)
    return any(is_local_tier_dir(n) for n in names) or any(_RUN.match(n) for n in names)
