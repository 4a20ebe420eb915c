"""``shardpoint prune``: delete old checkpoints by the library's retention rules.

The rules are the ones a :class:`~shardpoint.Checkpointer` applies after each save
(``keep_last`` = :class:`~shardpoint.LatestN`, ``keep_every`` =
:class:`~shardpoint.KeepEvery`, decided by :func:`shardpoint.lifecycle.policy.select_for_deletion`),
so pruning by hand keeps what the job would have kept. Never deleted: the
checkpoint the tracker names (a resume needs it), ``release/``, and directories
without a marker (possibly a save in progress; ``verify --all`` reports them).
Leftover temporary directories of interrupted saves are removed too, first: a
checkpoint that a re-save which died had moved aside is put back before retention
decides, as a held directory's files may be kept only for it.

Pruning a local directory takes its writer lock (:mod:`shardpoint.storage.lock`), so it
refuses to run while a job saves there: that job's save in progress would look like
a leftover. Object storage (``s3://``) has no writer lock, so there pruning deletes
only what retention rules out, says that it ran unguarded, and leaves iteration
prefixes without a marker alone: a save in progress looks just like that, and the
job's next start removes real leftovers. ``--dry-run`` only reads.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from shardpoint import offline
from shardpoint.commands._other_tools import refuse_other_tool
from shardpoint.commands._output import EXIT_OK, Output, add_output_flags, guarded, human_bytes, new_table
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.lifecycle import commit, references
from shardpoint.lifecycle.policy import CheckpointInfo, KeepEvery, LatestN, PreservationPolicy, select_for_deletion
from shardpoint.storage.base import Storage, open_storage
from shardpoint.tier.marker import holds_local_tier

__all__ = ["add_parser", "plan", "run"]

log = logging.getLogger(__name__)

EXAMPLES = """examples:
  shardpoint prune runs/gpt --keep-last 3 --dry-run     # show what would go
  shardpoint prune runs/gpt --keep-last 3 --keep-every 1000
  shardpoint prune runs/gpt --keep-every 1000 --dry-run  # only multiples of 1000 (and the tracker's)
  shardpoint prune s3://bucket/runs/gpt --keep-last 2     # no writer lock on object storage
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "prune",
        help="delete old checkpoints (keep the last N, every K-th)",
        description="Delete checkpoints that the retention rules do not keep. The tracker's checkpoint and "
        "release/ are never deleted.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", metavar="DIR", help="the save directory (local, s3://, gs:// or az://)")
    parser.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N checkpoints")
    parser.add_argument(
        "--keep-every", type=int, metavar="K", help="also keep every checkpoint whose iteration is a multiple of K"
    )
    parser.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")
    add_output_flags(parser)
    parser.set_defaults(func=run)


def plan(root: str, policies: list[PreservationPolicy], storage: Storage | None = None) -> dict[str, Any]:
    """What pruning ``root`` would delete and keep, and why; touches nothing.

    ``leftovers`` are what saves that died left behind and pruning removes: local
    temporary directories. On object storage it is empty and ``partial`` lists the
    iteration prefixes without a marker, which pruning leaves alone (see the module docstring).

    Raises:
        CorruptCheckpointError: the tracker cannot be read, so what it protects is unknown.
    """
    storage = storage or open_storage(root)
    layout = offline.find_layout(root, storage) if storage.is_dir(root) else None
    listed = commit.list_checkpoints(storage, root, layout) if layout else []
    found, tracked = commit.read_tracker(storage, root, layout) if layout else (False, None)
    if not listed and not found:
        if holds_local_tier(storage, root):
            raise CheckpointError(
                f"{root} holds non-persistent local-tier checkpoints, not persistent ones: the Checkpointer with "
                "this local_dir keeps local_keep of them per node; prune works on persistent save directories"
            )
        offline.resolve(root, storage=storage)  # raises the one-sentence "not a checkpoint" error
    if found and layout is not None and not any(e.committed and e.iteration == tracked for e in listed):
        raise CorruptCheckpointError(
            f"the tracker {layout.tracker_name} under {root} names {layout.dir_name(tracked)}, which is not a "
            "committed checkpoint; fix the tracker first, since pruning keeps what it names"
        )
    entries = {e.iteration: e for e in listed if e.committed and e.iteration is not None}
    infos = [CheckpointInfo(it, e.marker().metrics) for it, e in sorted(entries.items())]
    doomed = set(select_for_deletion(infos, policies, {tracked} if tracked is not None else set()))
    rows = []
    for iteration, entry in sorted(entries.items()):
        reason = "tracker" if iteration == tracked else "retention" if iteration not in doomed else None
        rows.append(
            {
                "name": entry.name,
                "iteration": iteration,
                "bytes": entry.marker().stored_bytes,  # what deleting it frees (referred files stay with their owner)
                "delete": iteration in doomed,
                "kept_by": reason,
            }
        )
    leftovers = [n for n in storage.listdir(root) if n.startswith((commit.TMP_PREFIX, commit.TRASH_PREFIX))]
    partial = [] if storage.supports_rename else [e.name for e in listed if not e.committed]
    return {"directory": root, "checkpoints": rows, "leftovers": leftovers, "partial": partial}


def _policies(args: argparse.Namespace) -> list[PreservationPolicy]:
    """The retention the flags ask for; errors name the flags (a ValueError: exit 2)."""
    if args.keep_last is None and args.keep_every is None:
        raise ValueError("give --keep-last N, --keep-every K or both: prune keeps what they name")
    for flag, value in (("--keep-last", args.keep_last), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    policies: list[PreservationPolicy] = [] if args.keep_last is None else [LatestN(args.keep_last)]
    return policies + ([] if args.keep_every is None else [KeepEvery(args.keep_every)])


@guarded
def run(args: argparse.Namespace) -> int:
    out = Output(args)
    storage = open_storage(args.directory)
    root = storage.root
    refuse_other_tool(args.directory, "prune")
    policies = _policies(args)
    if args.dry_run:
        report = plan(root, policies, storage)
    else:
        # locally, refuses while a job saves here: its save in progress looks like a leftover
        with offline.writer_lock(storage):
            # leftovers first: a checkpoint a dead re-save moved aside is put back before anything is decided,
            # since it may be the only one that still refers to a held directory's files
            removed = commit.clean_leftovers(storage, root) if storage.supports_rename else []
            report = plan(root, policies, storage)
            report["leftovers"] = removed
            _delete(storage, root, report)
    report["dry_run"] = args.dry_run
    out.emit_json(report)
    _print(out, report)
    return EXIT_OK


def _delete(storage: Storage, root: str, report: dict[str, Any]) -> None:
    for row in report["checkpoints"]:
        if row["delete"]:
            commit.retire(storage, root, row["name"])  # keeps the files that kept checkpoints refer to
    for name in references.held_dirs(storage, root):
        commit.retire(storage, root, name)  # a held directory no one refers to any more goes


def _print(out: Output, report: dict[str, Any]) -> None:
    verb = "would delete" if report["dry_run"] else "deleted"
    table = new_table("checkpoint", "size", "action")
    for row in report["checkpoints"]:
        action = f"[red]{verb}[/red]" if row["delete"] else f"keep ({row['kept_by']})"
        table.add_row(row["name"], human_bytes(row["bytes"]), action)
    out.print(table)
    for name in report["leftovers"]:
        out.print(f"{verb} leftover of an interrupted save: {name}")
    for name in report["partial"]:
        out.print(f"kept {name}: no marker, maybe a save in progress (without a lock pruning cannot tell)")
    deleted = [r for r in report["checkpoints"] if r["delete"]]
    freed = sum(r["bytes"] for r in deleted)
    out.print(
        f"{verb} {len(deleted)} checkpoint(s), {human_bytes(freed)}"
        + (" (dry run: nothing was deleted)" if report["dry_run"] else "")
    )
