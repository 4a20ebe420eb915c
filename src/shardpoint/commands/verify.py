"""``shardpoint verify``: is a checkpoint complete and unchanged since it was saved?

Every file listed in ``shardpoint.json`` is checked for presence, size and XXH3
checksum (:func:`shardpoint.catalog.integrity.verify_files`); each bad file is named. Also
reported as problems: files in the checkpoint directory that the marker does not
list (something wrote there after the commit), a checkpoint directory without a
marker (a save that never committed), and a tracker naming a checkpoint that does
not exist or is not committed (a resume would fail). Leftover temporary directories
of interrupted saves are listed but are not problems: the next start removes them.
Nor is a leftover ``.shardpoint-in-progress`` object: a save on object storage
writes it before its data and removes it after the marker, so a save that died in
between leaves it beside a complete, committed checkpoint.

Works on local paths and ``s3://bucket/prefix`` alike; on object storage every
object is downloaded once to checksum it (streamed, not held in memory).

Exit status: 0 when everything checked is intact, 1 when anything is wrong, 2 when
the path is not a shardpoint checkpoint (missing, or another tool's: the message says
which command reads it).
"""

from __future__ import annotations

import argparse
import posixpath
from typing import Any

from shardpoint import offline
from shardpoint.catalog.integrity import verify_files
from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.commands._other_tools import refuse_other_tool
from shardpoint.commands._output import EXIT_OK, EXIT_PROBLEM, Output, add_output_flags, guarded, human_bytes, new_table
from shardpoint.commands.inspect import describe_directory
from shardpoint.errors import CheckpointError, NotACheckpointError
from shardpoint.formats.dist import DCP_METADATA, dcp_reader
from shardpoint.lifecycle import commit
from shardpoint.storage.base import Storage, open_storage

__all__ = ["add_parser", "check_checkpoint", "run", "unrecorded_files"]

EXAMPLES = """examples:
  shardpoint verify runs/gpt                  # the checkpoint the tracker names
  shardpoint verify runs/gpt --all            # every checkpoint in the directory
  shardpoint verify runs/gpt/iter_0000200 --json
  shardpoint verify s3://bucket/runs/gpt --all
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check files, sizes and checksums of checkpoints",
        description="Check that checkpoints are complete and unchanged: every recorded file present, "
        "with its recorded size and checksum. Exit 1 if anything is wrong.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "directory",
        metavar="DIR",
        help="a save directory, or one checkpoint's directory (local, s3://, gs:// or az://)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=int, metavar="N", help="verify the checkpoint of iteration N")
    which.add_argument("--all", action="store_true", help="verify every checkpoint in DIR (committed or not)")
    add_output_flags(parser)
    parser.set_defaults(func=run)


@guarded
def run(args: argparse.Namespace) -> int:
    out = Output(args)
    refuse_other_tool(args.directory, "verify")
    storage = open_storage(args.directory)
    path = storage.root
    if offline.is_checkpoint_dir(path, storage):
        if args.all:
            raise ValueError(f"--all applies to a save directory; {path} is one checkpoint")
        targets, listing = [(posixpath.basename(path), path)], None
    else:
        listing = describe_directory(path, storage)
        targets = _targets(listing, path, args)
    with out.progress() as progress:
        reports = [check_checkpoint(name, directory, progress, storage) for name, directory in targets]
    tracker = listing["tracker"] if listing else None
    leftovers = listing["leftovers"] if listing else []
    ok = all(r["ok"] for r in reports) and not (tracker and tracker["problem"])
    out.emit_json({"ok": ok, "directory": path, "checkpoints": reports, "tracker": tracker, "leftovers": leftovers})
    _print(out, reports, tracker, leftovers)
    return EXIT_OK if ok else EXIT_PROBLEM


def _targets(listing: dict[str, Any], root: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = listing["checkpoints"]
    if args.all:
        return [(r["name"], r["path"]) for r in rows]
    if args.iteration is not None:
        chosen = [r for r in rows if r["iteration"] == args.iteration]
        if not chosen:
            names = ", ".join(r["name"] for r in rows) or "none"
            raise NotACheckpointError(f"no checkpoint of iteration {args.iteration} under {root}; found: {names}")
        return [(chosen[0]["name"], chosen[0]["path"])]
    tracked = [r for r in rows if r["tracked"]]
    committed = [r for r in rows if r["committed"]]
    chosen = tracked or committed[-1:] or rows[-1:]
    return [(r["name"], r["path"]) for r in chosen]


def check_checkpoint(name: str, directory: str, progress: Any = None, storage: Storage | None = None) -> dict[str, Any]:
    """One checkpoint's report: committed or not, bad files, files the marker does not list.

    ``storage`` is the one ``directory`` lives on (default: ``open_storage(directory)``).
    """
    report: dict[str, Any] = {
        "name": name,
        "path": directory,
        "committed": False,
        "ok": False,
        "files": 0,
        "bytes": 0,
        "problems": [],
        "unrecorded": [],
    }
    storage = storage or open_storage(directory)
    try:
        meta = commit.read_marker(storage, directory)
    except CheckpointError as exc:
        report["problems"].append({"file": MARKER_NAME, "problem": str(exc)})
        return report
    names = sorted(meta.files)
    for done, file in enumerate(names, 1):
        report["problems"] += [
            {"file": p.file, "problem": p.problem} for p in verify_files(storage, directory, meta, [file])
        ]
        if progress:
            progress(f"verifying {name}", done, len(names))
    if not report["problems"]:
        report["problems"] += _stored_item_problems(storage, directory, meta)
    report["unrecorded"] = unrecorded_files(directory, meta, storage)
    report.update(
        committed=True, files=len(names), bytes=meta.total_bytes, ok=not report["problems"] and not report["unrecorded"]
    )
    return report


def _stored_item_problems(storage: Storage, directory: str, meta: CheckpointMetadata) -> list[dict[str, str]]:
    """Whether DCP's ``.metadata`` names only files the marker lists, each item within its file.

    A load refuses such a ``.metadata`` (:func:`~shardpoint.formats.dcp_metadata.check_stored_items`);
    ``verify`` must say so too, or it would pass a checkpoint whose data lies elsewhere.
    Checked after the files themselves, so ``.metadata`` is unpickled only once its checksum matches.
    """
    if meta.format not in ("dist", "torchtitan"):  # the formats written through DCP
        return []
    if DCP_METADATA not in meta.files:
        return [{"file": DCP_METADATA, "problem": f"not listed in {MARKER_NAME}"}]
    try:
        dcp_reader(storage, directory, listed=meta.files).read_metadata()
    except CheckpointError as exc:
        return [{"file": DCP_METADATA, "problem": str(exc)}]
    return []


def unrecorded_files(directory: str, meta: CheckpointMetadata, storage: Storage | None = None) -> list[str]:
    """Files under ``directory`` that ``shardpoint.json`` does not list (relative paths).

    shardpoint's own ``.shardpoint-in-progress`` object is not reported: it is written
    before the data and removed after the marker, so a save that died in between
    leaves it beside a complete, committed checkpoint.
    """
    storage = storage or open_storage(directory)
    return sorted(_unknown_files(storage, directory, {*meta.files, MARKER_NAME, commit.IN_PROGRESS_NAME}))


def _unknown_files(storage: Storage, directory: str, known: set[str], prefix: str = "") -> list[str]:
    """Files under ``directory`` not in ``known`` (``/``-separated paths relative to it).

    Only names that are not known files are asked whether they are folders: on object
    storage each question is a request.
    """
    found = []
    for name in storage.listdir(directory):
        rel = prefix + name
        if rel in known:
            continue
        path = storage.join(directory, name)
        if storage.is_dir(path):
            found += _unknown_files(storage, path, known, rel + "/")
        else:
            found.append(rel)
    return found


def _print(out: Output, reports: list[dict[str, Any]], tracker: dict[str, Any] | None, leftovers: list[str]) -> None:
    table = new_table("checkpoint", "files", "size", "status")
    for r in reports:
        status = "[green]ok[/green]" if r["ok"] else "[red]DAMAGED[/red]" if r["committed"] else "[red]PARTIAL[/red]"
        table.add_row(r["name"], str(r["files"]), human_bytes(r["bytes"]), status)
    out.print(table)
    for r in reports:
        for p in r["problems"]:
            out.problem(f"BAD {r['name']}/{p['file']}: {p['problem']}")
        for file in r["unrecorded"]:
            out.problem(f"UNRECORDED {r['name']}/{file}: not listed in {MARKER_NAME} (written after the save?)")
    if tracker and tracker["problem"]:
        out.problem(f"TRACKER {tracker['file']}: {tracker['problem']}; a resume would fail")
    for name in leftovers:
        out.print(f"note: {name} is left over from an interrupted save (removed at the next start)")
    bad = [r for r in reports if not r["ok"]]
    if bad or (tracker and tracker["problem"]):
        out.problem(
            f"problems found in {len(bad)} of {len(reports)} checkpoint(s)"
            + (" and the tracker" if tracker and tracker["problem"] else "")
        )
    else:
        out.print(f"{len(reports)} checkpoint(s) verified: every file present, with its recorded size and checksum")
