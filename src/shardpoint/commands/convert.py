"""``shardpoint convert``: rewrite a checkpoint in another format, layout or tp/pp, offline.

Like Megatron's ``tools/checkpoint``, but for both formats: the source is read whole
into one process (:func:`shardpoint.offline.read_full`, checksums verified first),
and a new committed checkpoint is written into DST (:func:`shardpoint.offline.convert`).
The source is only ever read. ``torch``-format checkpoints can only be loaded at the
tp/pp they were saved at, so this is how one moves to another layout; ``dist`` ones
reshard on load and need conversion only to change format or directory names.

SRC and DST may each be a local path or ``s3://bucket/prefix``. A destination on
object storage is written in place and committed by its marker, then the tracker
(:mod:`shardpoint.commit`); unlike a local one it has no writer lock.

``--from-hf`` imports a Hugging Face model directory (local) instead (``shardpoint.demo.hf``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from shardpoint import offline
from shardpoint.commands._hf import hf_function
from shardpoint.commands._output import EXIT_OK, Output, add_output_flags, guarded
from shardpoint.storage import open_storage

__all__ = ["add_parser", "parse_split_dim", "run"]

EXAMPLES = """examples:
  shardpoint convert runs/gpt runs/gpt-tp1 --tp 1 --pp 1          # re-split a torch-format checkpoint
  shardpoint convert runs/gpt runs/gpt-dist --format dist         # torch -> dist (reshardable on load)
  shardpoint convert runs/gpt runs/gpt-neox --layout neox --iteration 200
  shardpoint convert runs/tp1 runs/tp2 --tp 2 --split-dim '*fc1.*=0' --split-dim '*fc2.weight=1'
  shardpoint convert --from-hf ./hf-model runs/imported --tp 2 --pp 1
  shardpoint convert s3://bucket/runs/gpt runs/gpt-copy            # download a verified copy
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert between formats, layouts and tp/pp (offline)",
        description="Write a converted copy of a checkpoint into DST: another format (dist/torch), another "
        "directory layout (megatron/neox), or a torch-format checkpoint re-split for another tp/pp. "
        "SRC is never modified. Per-rank RNG states are not carried over.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "src", metavar="SRC", help="a save directory or one checkpoint, local or s3:// (--from-hf: a local HF model)"
    )
    parser.add_argument(
        "dst", metavar="DST", help="the save directory to write the converted checkpoint into (local or s3://)"
    )
    parser.add_argument("--format", choices=("dist", "torch"), help="output format (default: the source's)")
    parser.add_argument("--tp", type=_positive, metavar="N", help="tensor-parallel size (default: the source's)")
    parser.add_argument("--pp", type=_positive, metavar="M", help="pipeline-parallel size (default: the source's)")
    parser.add_argument("--layout", choices=("megatron", "neox"), help="directory names (default: the source's)")
    parser.add_argument("--iteration", type=int, metavar="N", help="which checkpoint of SRC (default: the tracker's)")
    parser.add_argument(
        "--split-dim",
        action="append",
        type=parse_split_dim,
        default=[],
        metavar="PATTERN=DIM",
        help="tensor-parallel dim of keys matching PATTERN (needed for tp>1 from a tp=1 source); "
        "DIM 'none' means replicated; repeatable",
    )
    parser.add_argument("--from-hf", action="store_true", help="SRC is a Hugging Face model directory to import")
    add_output_flags(parser)
    parser.set_defaults(func=run)


def parse_split_dim(text: str) -> tuple[str, int | None]:
    """``'*fc1.weight=0'`` -> ``('*fc1.weight', 0)``; ``'*norm*=none'`` -> ``('*norm*', None)``."""
    pattern, sep, dim = text.rpartition("=")
    if not sep or not pattern:
        raise argparse.ArgumentTypeError(f"expected PATTERN=DIM, got {text!r}")
    if dim.lower() == "none":
        return pattern, None
    if not dim.isdigit():
        raise argparse.ArgumentTypeError(f"DIM must be a dimension number or 'none', got {dim!r}")
    return pattern, int(dim)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


@guarded
def run(args: argparse.Namespace) -> int:
    out = Output(args)
    if args.from_hf:
        return _from_hf(out, args)
    with out.progress() as progress:
        path = offline.convert(
            args.src,
            args.dst,
            iteration=args.iteration,
            format=args.format,
            tp=args.tp,
            pp=args.pp,
            layout=args.layout,
            split_overrides=dict(args.split_dim),
            progress=progress,
        )
    _, meta = offline.resolve(path)
    topo = meta.topology
    out.emit_json(
        {
            "source": open_storage(args.src).root,
            "destination": path,
            "format": meta.format,
            "layout": meta.layout,
            "topology": topo,
            "iteration": meta.iteration,
            "release": meta.release,
            "files": len(meta.files),
            "bytes": meta.total_bytes,
        }
    )
    out.print(
        f"wrote {path}: {meta.format} format, {meta.layout} layout, tp={topo['tp']} pp={topo['pp']}, "
        f"{len(meta.files)} files"
    )
    return EXIT_OK


def _from_hf(out: Output, args: argparse.Namespace) -> int:
    for name in ("iteration", "layout"):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name} does not apply to --from-hf")
    if "://" in args.src:
        raise ValueError(f"--from-hf reads a local Hugging Face model directory; got {args.src}")
    import_hf = hf_function("import_hf")
    path = import_hf(args.src, args.dst, args.tp or 1, args.pp or 1, args.format or "dist")
    out.emit_json({"source": os.path.abspath(args.src), "destination": str(path) if path else args.dst})
    out.print(f"imported {args.src} into {path or args.dst}")
    return EXIT_OK
