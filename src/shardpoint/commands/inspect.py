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

A Megatron-LM (legacy ``torch``, ``torch_dist``) or DeepSpeed checkpoint directory,
or a save directory of one, is described too, without converting it: tool, format,
iteration, tp/pp/dp, optimizer sharding (distributed optimizer, ZeRO stage) and, for
``torch_dist``, the distributed optimizer's layout (``dp_reshardable`` bucket space or
``fully_reshardable``, decoded per parameter; a layout that cannot be decoded is named
as a problem and the weights are still described), the model's defining args and,
with ``--tensors``, every parameter under its global name (global layer numbers, TP
pieces joined) with the optimizer state it has. Its pickles
go through the allow-list of :mod:`shardpoint.foreign`. Limit: those readers assemble
whole tensors, so this reads every file of the checkpoint (optimizer state included)
into memory; inspecting a large foreign checkpoint costs its size in RAM and time.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import asdict
from typing import Any

from shardpoint import offline
from shardpoint.catalog.integrity import verify_files
from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata, listed_record, referred_dir
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
from shardpoint.lifecycle import commit, references
from shardpoint.storage.base import Storage, open_storage
from shardpoint.tier.marker import describe_local_dir, holds_local_tier

__all__ = ["add_parser", "describe_directory", "describe_foreign", "read_common", "run"]

EXAMPLES = """examples:
  shardpoint inspect runs/gpt                     # every checkpoint, the tracker's marked
  shardpoint inspect runs/gpt --iteration 200     # one checkpoint: metadata, config, training state
  shardpoint inspect runs/gpt/iter_0000200 --tensors --json
  shardpoint inspect s3://bucket/runs/gpt         # endpoint and credentials from AWS_* variables
  shardpoint inspect /data/megatron/run1 --tensors   # a Megatron-LM or DeepSpeed checkpoint, read in place
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
        "directory",
        metavar="DIR",
        help="a save directory, or one checkpoint's directory (local, s3://, gs:// or az://)",
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
    foreign_dir = _foreign_directory(path, args.iteration) if storage.is_local else None
    if foreign_dir is not None:
        return _show_foreign(out, path, foreign_dir, args.tensors)
    if args.iteration is None and holds_local_tier(storage, path):
        return _show_local_tier(out, storage, path)
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
    rows = [{**_entry_row(e, tracker.get("names")), "damaged": _size_damage(storage, e)} for e in entries]
    held = [_held_row(storage, root, name) for name in references.held_dirs(storage, root)]
    names = {e.name for e in entries if e.committed}
    if tracker["exists"] and tracker["problem"] is None and tracker["names"] not in names:
        target = storage.join(root, tracker["names"])
        tracker["problem"] = f"names {tracker['names']}, which " + (
            "is not committed (no shardpoint.json)" if storage.is_dir(target) else "does not exist"
        )
    stored = sum(r.get("stored_bytes", 0) for r in rows) + sum(h["bytes"] for h in held)
    return {
        "directory": root,
        "layout": layout.name,
        "tracker": tracker,
        "checkpoints": rows,
        "held": held,
        "stored_bytes": stored,
        "leftovers": leftovers,
    }


def _held_row(storage: Storage, root: str, name: str) -> dict[str, Any]:
    """A retired checkpoint kept for the files that later checkpoints refer to."""
    path = storage.join(root, name)
    files = references.referred_files(storage, root, name)
    size = sum(storage.size(storage.join(path, f)) for f in files if storage.exists(storage.join(path, f)))
    referrers = sorted({r for names in files.values() for r in names})
    return {"name": name, "files": len(files), "bytes": size, "referred_by": referrers}


def _tracker_state(storage: Storage, root: str, layout: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"file": layout.tracker_name, "exists": False, "names": None, "problem": None}
    try:
        found, iteration = commit.read_tracker(storage, root, layout)
    except CheckpointError as exc:
        return {**state, "exists": True, "problem": str(exc)}
    if found:
        state.update(exists=True, names=layout.dir_name(iteration))
    return state


def _size_damage(storage: Storage, entry: commit.CheckpointEntry) -> list[str]:
    """Files of a committed checkpoint that are missing or not their recorded size (no checksums: a listing
    stays cheap; ``shardpoint verify`` reads the bytes). A truncated checkpoint must not be listed as fine.
    """
    if not entry.committed or entry.meta is None:
        return []
    return [f"{p.file}: {p.problem}" for p in verify_files(storage, entry.path, entry.meta, checksums=False)]


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
            stored_bytes=meta.stored_bytes,
            referred_bytes=meta.referred_bytes,
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
            _size_cell(row),
            _status_cell(row),
            "[bold]<- tracker[/bold]" if row["tracked"] else "",
        )
    out.print(table)
    for held in report["held"]:
        out.print(
            f"{held['name']}: retired; {human_bytes(held['bytes'])} in {held['files']} file(s) kept because "
            f"{', '.join(held['referred_by'])} refer to them (frozen tensors stored once)"
        )
    if report["held"] or any(r.get("referred_bytes") for r in report["checkpoints"]):
        out.print(f"stored in this directory: {human_bytes(report['stored_bytes'])} (each byte counted once)")
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
        for damage in row["damaged"]:
            out.problem(f"{row['name']}: DAMAGED, {damage}; `shardpoint verify {root}` checks every file")
    bad = tracker["problem"] or any(not r["committed"] or r["damaged"] for r in report["checkpoints"])
    return EXIT_PROBLEM if bad else EXIT_OK


def _status_cell(row: dict[str, Any]) -> str:
    if not row["committed"]:
        return "[red]partial[/red] (no shardpoint.json)"
    if row["damaged"]:
        return f"[red]DAMAGED[/red] ({len(row['damaged'])} file(s) missing or truncated)"
    return "committed"


def _size_cell(row: dict[str, Any]) -> str:
    """The bytes a load reads, and how many of them this checkpoint's directory holds when some are referred."""
    if "bytes" not in row:
        return "-"
    if not row["referred_bytes"]:
        return human_bytes(row["bytes"])
    return f"{human_bytes(row['bytes'])} ({human_bytes(row['stored_bytes'])} own)"


def _show_local_tier(out: Output, storage: Storage, root: str) -> int:
    """A node's ``local_dir``: its non-persistent checkpoints (own ranks' files and replicas held for others)."""
    report = describe_local_dir(storage, root)
    out.emit_json(report)
    table = new_table("checkpoint", "iteration", "saved", "tp/pp/dp", "ranks held", "size", "tier", title=root)
    for row in report["checkpoints"]:
        topo, held = row["topology"], row["ranks_held"]
        table.add_row(
            row["name"],
            str(row["iteration"]),
            human_time(row["wall_time"]),
            f"{topo['tp']}/{topo['pp']}/{topo['dp']}",
            f"{len(held)} of {row['world_size']} ({', '.join(map(str, held[:8]))}{', ...' if len(held) > 8 else ''})",
            human_bytes(row["bytes"]),
            "[yellow]non-persistent[/yellow] (local tier)",
        )
    out.print(table)
    out.print(
        "local-tier checkpoints are non-persistent: a Checkpointer with this local_dir loads them at the layout "
        "they were saved at, and they are never a persistent checkpoint (no shardpoint.json, no tracker)"
    )
    for name in report["leftovers"]:
        out.print(f"leftover of an interrupted local save: {name} (removed at the next start)")
    return EXIT_OK


# ----------------------------------------------------------------- one checkpoint


def read_common(directory: str, meta: CheckpointMetadata, storage: Storage | None = None) -> dict[str, Any]:
    """The state shared by all ranks: ``common.pt`` (dist) or the first ``model_optim_rng.pt`` (torch)."""
    storage = storage or open_storage(directory)
    if meta.format == "dist":
        listed_record(meta.files, COMMON_FILE, directory, "the dist format")  # read only what the marker lists
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


def _referred_line(meta: CheckpointMetadata) -> str:
    if not meta.referred_bytes:
        return "-"
    dirs = sorted({d for n in meta.files if (d := referred_dir(n)) is not None})
    return f"refers to {human_bytes(meta.referred_bytes)} of files in {', '.join(dirs)} (frozen tensors not rewritten)"


def _print_summary(out: Output, directory: str, meta: CheckpointMetadata) -> None:
    table = new_table("", "", title=directory)
    topo = meta.topology
    rows = [
        ("iteration", "release" if meta.release else str(meta.iteration)),
        ("format / layout", f"{meta.format} / {meta.layout}"),
        ("layout at save", f"tp={topo['tp']} pp={topo['pp']} dp={topo['dp']}"),
        ("files", f"{len(meta.files)} ({human_bytes(meta.total_bytes)})"),
        ("stored once", _referred_line(meta)),
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


# ----------------------------------------------------------------- another tool's checkpoint

# Megatron-LM's (and NeoX's) args that define the model, shown in this order when present.
MODEL_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "seq_length",
    "max_position_embeddings",
    "vocab_size",
    "padded_vocab_size",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "params_dtype",
    "bf16",
    "fp16",
)
_TOOL_NAMES = {"megatron": "Megatron-LM", "deepspeed": "DeepSpeed"}
_SHARDING_TEXT = {
    None: "none (full state on every data-parallel rank)",
    "distributed-optimizer": "distributed optimizer",
}


def _foreign_directory(path: str, iteration: int | None) -> str | None:
    from shardpoint.foreign import find_foreign

    return find_foreign(path, iteration)


def describe_foreign(path: str, directory: str, tensors: bool = False) -> dict[str, Any]:
    """A Megatron-LM or DeepSpeed checkpoint as plain data (what ``inspect --json`` prints).

    Args:
        path: what the user named (a save directory or the iteration directory).
        directory: the iteration directory to read (:func:`shardpoint.foreign.find_foreign`).
        tensors: also list every parameter: global name, shape, dtype, bytes, TP split dim,
            and the names of its optimizer state.

    Raises:
        CheckpointError: the reader refuses the checkpoint (the message names file and reason).
    """
    from shardpoint.foreign import read_foreign

    try:
        ckpt, optimizer_problem = read_foreign(directory), None
    except CheckpointError as exc:
        try:  # the weights may still be readable when only the optimizer state is not
            ckpt, optimizer_problem = read_foreign(directory, optimizer=False), str(exc)
        except CheckpointError:
            raise exc from None
    files = [os.path.join(d, f) for d, _, names in os.walk(directory) for f in names]
    model = {k: _plain(ckpt.args[k]) for k in MODEL_ARGS if ckpt.args.get(k) is not None}
    if not ckpt.args.get("group_query_attention", True):
        model.pop("num_query_groups", None)  # Megatron ignores it without --group-query-attention
    siblings = sorted(n for n in os.listdir(path) if _ITERATION_DIR.fullmatch(n)) if path != directory else []
    report = ckpt.describe() | {
        "directory": directory,
        "foreign": True,
        "files": len(files),
        "bytes": sum(os.path.getsize(f) for f in files),
        "parameter_bytes": sum(t.numel() * t.element_size() for t in ckpt.params.values()),
        "checkpoint_version": ckpt.extra.get("checkpoint_version"),
        "optimizer_layout": ckpt.extra.get("optimizer_layout"),
        "optimizer_problem": optimizer_problem,
        "model": model,
        "args": ckpt.args,
        "iterations_in_save_directory": siblings,
        "tensors": None,
    }
    if tensors:
        report["tensors"] = [
            {
                "key": name,
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "bytes": t.numel() * t.element_size(),
                "split_dim": ckpt.split_dims.get(name),
                "optimizer_state": sorted(ckpt.optimizer.get(name, {})),
            }
            for name, t in ckpt.params.items()
        ]
    return report


def _plain(value: Any) -> Any:
    """An arg as a person reads it: ``{"__dtype__": "float32"}`` -> ``"float32"``."""
    return value["__dtype__"] if isinstance(value, dict) and "__dtype__" in value else value


_LAYOUT_TEXT = {
    "dp_reshardable": "dp_reshardable layout (bucket space), decoded per parameter",
    "fully_reshardable": "fully_reshardable layout (model space)",
}
_ITERATION_DIR = re.compile(r"iter_\d+|global_step\d+|release")


def _show_foreign(out: Output, path: str, directory: str, tensors: bool) -> int:
    report = describe_foreign(path, directory, tensors)
    out.emit_json(report)
    sharding = report["optimizer_sharding"]
    text = _SHARDING_TEXT.get(sharding) or sharding.replace("zero-", "ZeRO stage ")
    if report["optimizer_layout"]:
        text += f", {_LAYOUT_TEXT.get(report['optimizer_layout'], report['optimizer_layout'])}"
    table = new_table("", "", title=directory)
    rows = [
        ("checkpoint of", f"{_TOOL_NAMES.get(report['tool'], report['tool'])}, read in place (not shardpoint's)"),
        ("format", report["format"]),
        ("iteration", str(report["iteration"])),
        ("layout at save", f"tp={report['tp']} pp={report['pp']} dp={report['dp']}"),
        ("optimizer sharding", text),
        (
            "parameters",
            f"{report['parameters']} ({human_bytes(report['parameter_bytes'])}), "
            f"{report['with_optimizer_state']} with optimizer state",
        ),
        ("files", f"{report['files']} ({human_bytes(report['bytes'])})"),
        ("consumed samples", "-" if report["consumed_samples"] is None else str(report["consumed_samples"])),
        ("checkpoint version", "-" if report["checkpoint_version"] is None else str(report["checkpoint_version"])),
    ]
    for key, value in rows:
        table.add_row(f"[bold]{key}[/bold]", value)
    out.print(table)
    _print_mapping(out, "model", report["model"])
    if report["tensors"]:
        listing = new_table(
            "tensor",
            "global shape",
            "dtype",
            "bytes",
            "tp split",
            "optimizer state",
            title=f"{len(report['tensors'])} parameters",
        )
        for row in report["tensors"]:
            listing.add_row(
                row["key"],
                "x".join(map(str, row["shape"])) or "()",
                row["dtype"],
                human_bytes(row["bytes"]),
                "-" if row["split_dim"] is None else f"dim {row['split_dim']}",
                ", ".join(row["optimizer_state"]) or "-",
            )
        out.print(listing)
    others = [n for n in report["iterations_in_save_directory"] if n != os.path.basename(directory)]
    if others:
        out.print(f"other checkpoints in {path}: {', '.join(others)} (pass --iteration N)")
    if report["optimizer_problem"]:
        out.problem(f"optimizer state not decoded: {report['optimizer_problem']}")
        out.print(f"import the weights with `shardpoint convert --from {report['tool']} {path} DST --no-optimizer`")
        return EXIT_PROBLEM
    out.print(f"import it with `shardpoint convert --from {report['tool']} {path} DST`")
    return EXIT_OK
