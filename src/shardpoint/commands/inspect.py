"""``shardpoint inspect``: what is in a save directory, or in one checkpoint.

Given a save directory it lists every checkpoint (committed or partial), which one
the tracker names, and leftovers of interrupted saves. Given one checkpoint (its
directory, or ``--iteration N``) it shows the metadata, the model config and the
training state saved beside the tensors; ``--tensors`` adds one row per tensor with
its global shape, dtype, size and how it was split when saved.

It reads ``shardpoint.json``, ``common.pt`` / ``model_optim_rng.pt`` (weights-only)
and DCP's ``.metadata`` (restricted unpickler): never code. Locally tensor data is
memory-mapped, not read; from ``s3://`` paths ``model_optim_rng.pt`` files are
downloaded whole, so inspecting a large torch-format checkpoint there costs its size.
Sizes are checked; checksums are ``shardpoint verify``'s job.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from shardpoint import commit, offline
from shardpoint.commands._output import (
    EXIT_OK,
    EXIT_PROBLEM,
    Output,
    add_output_flags,
    guarded,
    human_bytes,
    human_time,
    jsonable,
    new_table,
)
from shardpoint.errors import CheckpointError
from shardpoint.formats.base import read_torch_file
from shardpoint.formats.dist import COMMON_FILE
from shardpoint.formats.torch_format import MAIN_FILE
from shardpoint.integrity import verify_files
from shardpoint.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.storage import Storage, open_storage

__all__ = ["add_parser", "describe_directory", "read_common", "run"]

EXAMPLES = """examples:
  shardpoint inspect runs/gpt                     # every checkpoint, the tracker's marked
  shardpoint inspect runs/gpt --iteration 200     # one checkpoint: metadata, config, training state
  shardpoint inspect runs/gpt/iter_0000200 --tensors --json
  shardpoint inspect s3://bucket/runs/gpt         # endpoint and credentials from AWS_* variables
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="list the checkpoints in a directory, or describe one",
        description="List the checkpoints in a save directory, or describe one checkpoint.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "directory", metavar="DIR", help="a save directory, or one checkpoint's directory (local or s3://)"
    )
    parser.add_argument("--iteration", type=int, metavar="N", help="describe the checkpoint of iteration N")
    parser.add_argument("--tensors", action="store_true", help="also list every tensor: shape, dtype, bytes, sharding")
    add_output_flags(parser)
    parser.set_defaults(func=run)


@guarded
def run(args: argparse.Namespace) -> int:
    out = Output(args)
    storage = open_storage(args.directory)
    path = storage.root
    if args.iteration is not None or args.tensors or offline.is_checkpoint_dir(path, storage):
        return _show_one(out, storage, path, args.iteration, args.tensors)
    return _show_directory(out, storage, path)


# ----------------------------------------------------------------- a save directory


def describe_directory(root: str, storage: Storage | None = None) -> dict[str, Any]:
    """Every checkpoint under ``root``, the tracker's target and leftovers, as plain data.

    Args:
        root: a save directory, local or ``s3://bucket/prefix``.
        storage: the storage ``root`` lives on (default: ``open_storage(root)``).

    Raises:
        CheckpointError: ``root`` holds no checkpoint, partial or committed, and no tracker.
    """
    storage = storage or open_storage(root)
    if not storage.is_dir(root):
        offline.resolve(root, storage=storage)  # raises the one-sentence error for a missing path or a file
    layout = offline.find_layout(root, storage)
    tracker = _tracker_state(storage, root, layout)
    entries = commit.list_checkpoints(storage, root, layout)
    leftovers = [n for n in storage.listdir(root) if n.startswith(commit.TMP_PREFIX)]
    if not entries and not tracker["exists"]:
        offline.resolve(root, storage=storage)  # raises "not a checkpoint" (or "no committed checkpoint")
    rows = [_entry_row(e, tracker.get("names")) for e in entries]
    names = {e.name for e in entries if e.committed}
    if tracker["exists"] and tracker["problem"] is None and tracker["names"] not in names:
        target = storage.join(root, tracker["names"])
        tracker["problem"] = f"names {tracker['names']}, which " + (
            "is not committed (no shardpoint.json)" if storage.is_dir(target) else "does not exist"
        )
    return {"directory": root, "layout": layout.name, "tracker": tracker, "checkpoints": rows, "leftovers": leftovers}


def _tracker_state(storage: Storage, root: str, layout: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"file": layout.tracker_name, "exists": False, "names": None, "problem": None}
    try:
        found, iteration = commit.read_tracker(storage, root, layout)
    except CheckpointError as exc:
        return {**state, "exists": True, "problem": str(exc)}
    if found:
        state.update(exists=True, names=layout.dir_name(iteration))
    return state


def _entry_row(entry: commit.CheckpointEntry, tracked: str | None) -> dict[str, Any]:
    meta = entry.meta
    row: dict[str, Any] = {
        "name": entry.name,
        "path": entry.path,
        "iteration": entry.iteration,
        "release": entry.iteration is None,
        "committed": entry.committed,
        "tracked": entry.name == tracked,
        "problem": entry.problem,
    }
    if meta is not None:
        row.update(
            format=meta.format,
            layout=meta.layout,
            topology=meta.topology,
            bytes=meta.total_bytes,
            files=len(meta.files),
            wall_time=meta.wall_time,
            saved=human_time(meta.wall_time),
            consumed_samples=meta.consumed_samples,
            metrics=meta.metrics,
        )
    return row


def _show_directory(out: Output, storage: Storage, root: str) -> int:
    report = describe_directory(root, storage)
    out.emit_json(report)
    table = new_table(
        "checkpoint",
        "iteration",
        "saved",
        "format",
        "tp/pp/dp",
        "size",
        "status",
        "",
        title=f"{root}  ({report['layout']} layout)",
    )
    for row in report["checkpoints"]:
        topo = row.get("topology")
        table.add_row(
            row["name"],
            "release" if row["release"] else str(row["iteration"]),
            row.get("saved", "-"),
            row.get("format", "-"),
            f"{topo['tp']}/{topo['pp']}/{topo['dp']}" if topo else "-",
            human_bytes(row["bytes"]) if "bytes" in row else "-",
            "committed" if row["committed"] else "[red]partial[/red] (no shardpoint.json)",
            "[bold]<- tracker[/bold]" if row["tracked"] else "",
        )
    out.print(table)
    tracker = report["tracker"]
    if tracker["problem"]:
        out.problem(f"tracker {tracker['file']}: {tracker['problem']}")
    elif not tracker["exists"]:
        out.print(f"no tracker file ({tracker['file']}); a load picks the newest committed checkpoint")
    for name in report["leftovers"]:
        out.print(f"leftover of an interrupted save: {name} (removed at the next start, or by `shardpoint prune`)")
    for row in report["checkpoints"]:
        if not row["committed"]:
            out.problem(f"{row['name']}: partial checkpoint, not committed (no {MARKER_NAME}); it is never loaded")
    bad = tracker["problem"] or any(not r["committed"] for r in report["checkpoints"])
    return EXIT_PROBLEM if bad else EXIT_OK


# ----------------------------------------------------------------- one checkpoint


def read_common(directory: str, meta: CheckpointMetadata, storage: Storage | None = None) -> dict[str, Any]:
    """The state shared by all ranks: ``common.pt`` (dist) or the first ``model_optim_rng.pt`` (torch)."""
    storage = storage or open_storage(directory)
    if meta.format == "dist":
        return dict(read_torch_file(storage, storage.join(directory, COMMON_FILE)))
    first = sorted(n for n in meta.files if n.endswith("/" + MAIN_FILE))
    if not first:
        raise CheckpointError(f"{directory} lists no {MAIN_FILE}; the checkpoint is incomplete")
    payload = read_torch_file(storage, storage.join(directory, first[0]), mmap=True)
    common = dict(payload.get("common", {}))
    common["checkpoint_version"] = payload.get("checkpoint_version")
    common["num_floating_point_operations_so_far"] = payload.get("num_floating_point_operations_so_far")
    return common


def _show_one(out: Output, storage: Storage, path: str, iteration: int | None, tensors: bool) -> int:
    directory, meta = offline.resolve(path, iteration, storage=storage)
    problems = [str(p) for p in verify_files(storage, directory, meta, checksums=False)]
    try:
        common, common_error = read_common(directory, meta, storage), None
    except CheckpointError as exc:
        common, common_error = {}, str(exc)
    infos = offline.describe_tensors(directory, meta, storage=storage) if tensors and not problems else []
    summary = {k: v for k, v in asdict(meta).items() if k != "files"}
    out.emit_json(
        {
            "directory": directory,
            "metadata": summary,
            "files": len(meta.files),
            "bytes": meta.total_bytes,
            "state": {k: v for k, v in common.items() if k != "config"},
            "problems": problems + ([common_error] if common_error else []),
            "tensors": [_tensor_json(i) for i in infos] if tensors else None,
        }
    )
    _print_summary(out, directory, meta)
    _print_mapping(out, "config", meta.config)
    _print_mapping(out, "training state", {k: v for k, v in common.items() if k != "config"})
    if infos:
        _print_tensors(out, infos)
    for text in problems:
        out.problem(f"damaged: {text} (run `shardpoint verify` for a full check)")
    if common_error:
        out.problem(f"training state unreadable: {common_error}")
    if tensors and problems:
        out.problem("tensors not listed: files are missing or truncated")
    return EXIT_PROBLEM if problems or common_error else EXIT_OK


def _print_summary(out: Output, directory: str, meta: CheckpointMetadata) -> None:
    table = new_table("", "", title=directory)
    topo = meta.topology
    rows = [
        ("iteration", "release" if meta.release else str(meta.iteration)),
        ("format / layout", f"{meta.format} / {meta.layout}"),
        ("layout at save", f"tp={topo['tp']} pp={topo['pp']} dp={topo['dp']}"),
        ("files", f"{len(meta.files)} ({human_bytes(meta.total_bytes)})"),
        ("saved", f"{human_time(meta.wall_time)} in {meta.save_seconds:.2f} s"),
        ("consumed samples", "-" if meta.consumed_samples is None else str(meta.consumed_samples)),
        ("flops", "-" if meta.flops is None else f"{meta.flops:.4g}"),
        ("metrics", ", ".join(f"{k}={v:.6g}" for k, v in meta.metrics.items()) or "-"),
        ("shardpoint", f"{meta.library_version or '?'} (format version {meta.format_version})"),
    ]
    for key, value in rows:
        table.add_row(f"[bold]{key}[/bold]", value)
    out.print(table)


def _print_mapping(out: Output, title: str, values: dict[str, Any]) -> None:
    if not values:
        return
    table = new_table("key", "value", title=title)
    for key, value in sorted(values.items()):
        table.add_row(key, _short(jsonable(value)))
    out.print(table)


def _short(value: Any, limit: int = 120) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tensor_json(info: offline.TensorInfo) -> dict[str, Any]:
    return {
        "key": info.key,
        "shape": list(info.shape),
        "dtype": info.dtype,
        "bytes": info.nbytes,
        "split_dims": list(info.split_dims),
        "pieces": len(info.boxes),
        "boxes": [{"offset": list(o), "shape": list(s)} for o, s in info.boxes],
    }


def _print_tensors(out: Output, infos: list[offline.TensorInfo]) -> None:
    table = new_table("tensor", "global shape", "dtype", "bytes", "sharding", title=f"{len(infos)} tensors")
    for info in infos:
        table.add_row(
            info.key, "x".join(map(str, info.shape)) or "()", info.dtype, human_bytes(info.nbytes), _sharding_text(info)
        )
    out.print(table)


def _sharding_text(info: offline.TensorInfo) -> str:
    if len(info.boxes) == 1:
        return "whole"
    dims = ",".join(map(str, info.split_dims)) or "?"
    return f"{len(info.boxes)} pieces along dim {dims}"
