"""``shardpoint convert``: rewrite a checkpoint in another format, layout or tp/pp, offline.

Like Megatron's ``tools/checkpoint``, but for both formats: the source is read whole
into one process (:func:`shardpoint.offline.read_full`, checksums verified first),
and a new committed checkpoint is written into DST (:func:`shardpoint.offline.convert`).
The source is only ever read. ``torch``-format checkpoints can only be loaded at the
tp/pp they were saved at, so this is how one moves to another layout; ``dist`` ones
reshard on load and need conversion only to change format or directory names.

SRC and DST may each be a local path or ``s3://bucket/prefix``. A destination on
object storage is written in place and committed by its marker, then the tracker
(:mod:`shardpoint.lifecycle.commit`); unlike a local one it has no writer lock.

``--from-hf`` imports a Hugging Face model directory (local) instead (``shardpoint.demo.hf``).

``--from megatron|deepspeed|auto`` imports a Megatron-LM (legacy ``torch`` or
``torch_dist``) or DeepSpeed / GPT-NeoX checkpoint as a ``dist`` checkpoint, and
``--to megatron --tp N --pp M [--dp D --distributed-optimizer]`` writes Megatron-LM's
legacy format from such a source or from a shardpoint checkpoint imported from one
(:mod:`shardpoint.foreign`). Foreign pickles are read through an allow-list; nothing
in them runs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from shardpoint import offline
from shardpoint.commands._hf import hf_function
from shardpoint.commands._output import EXIT_OK, Output, add_output_flags, guarded
from shardpoint.storage.base import open_storage

__all__ = ["add_parser", "parse_split_dim", "run"]

EXAMPLES = """examples:
  shardpoint convert runs/gpt runs/gpt-tp1 --tp 1 --pp 1          # re-split a torch-format checkpoint
  shardpoint convert runs/gpt runs/gpt-dist --format dist         # torch -> dist (reshardable on load)
  shardpoint convert runs/gpt runs/gpt-neox --layout neox --iteration 200
  shardpoint convert runs/tp1 runs/tp2 --tp 2 --split-dim '*fc1.*=0' --split-dim '*fc2.weight=1'
  shardpoint convert --from-hf ./hf-model runs/imported --tp 2 --pp 1
  shardpoint convert s3://bucket/runs/gpt runs/gpt-copy            # download a verified copy
  shardpoint convert --from megatron /data/megatron/run runs/imported       # Megatron-LM -> dist
  shardpoint convert --from deepspeed /data/neox/run runs/imported          # DeepSpeed / GPT-NeoX -> dist
  shardpoint convert --to megatron runs/imported /data/run-tp1 --tp 1 --pp 1
  shardpoint convert --from megatron --to megatron /data/run-tp2 /data/run-tp1-dp4 --tp 1 --dp 4 --distributed-optimizer
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
    parser.add_argument(
        "--from",
        dest="from_tool",
        choices=("megatron", "deepspeed", "auto"),
        help="SRC is a Megatron-LM or DeepSpeed/GPT-NeoX checkpoint (save dir or iteration dir) to import",
    )
    parser.add_argument(
        "--to", dest="to_tool", choices=("megatron",), help="write Megatron-LM's legacy torch format (needs --tp/--pp)"
    )
    parser.add_argument("--dp", type=_positive, metavar="D", help="data-parallel size recorded in --to megatron args")
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="--to megatron: write distrib_optim.pt (Megatron's --use-distributed-optimizer)",
    )
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
    if args.from_tool or args.to_tool:
        return _foreign(out, args)
    if args.dp is not None or args.distributed_optimizer:
        raise ValueError("--dp and --distributed-optimizer apply to --to megatron only")
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


def _foreign(out: Output, args: argparse.Namespace) -> int:
    """``--from`` / ``--to``: import a Megatron-LM / DeepSpeed checkpoint, or export Megatron-LM's format."""
    from shardpoint import foreign
    from shardpoint.foreign.exporter import export_megatron, from_shardpoint

    for name in ("format", "layout", "split_dim"):
        if getattr(args, name):
            raise ValueError(f"--{name.replace('_', '-')} does not apply to --from/--to")
    source = None if args.from_tool in (None, "auto") else args.from_tool
    if args.to_tool is None:
        if args.tp or args.pp or args.dp or args.distributed_optimizer:
            raise ValueError(
                "importing keeps the source's layout (a dist checkpoint loads at any); drop --tp/--pp/--dp"
            )
        path = foreign.import_checkpoint(args.src, args.dst, source=source, iteration=args.iteration)
        _, meta = offline.resolve(path)
        out.emit_json(
            {
                "source": os.path.abspath(args.src),
                "destination": path,
                "iteration": meta.iteration,
                "files": len(meta.files),
                "bytes": meta.total_bytes,
                "consumed_samples": meta.consumed_samples,
            }
        )
        out.print(f"imported {args.src} into {path}: dist format, iteration {meta.iteration}, {len(meta.files)} files")
        return EXIT_OK
    if not args.tp or not args.pp:
        raise ValueError("--to megatron needs --tp and --pp (and --dp with --distributed-optimizer)")
    if args.from_tool:
        ckpt = foreign.read_foreign(args.src, source=source, iteration=args.iteration)
    else:
        ckpt = from_shardpoint(args.src, args.iteration)
    offline.refuse_writing_into_source(ckpt.path, args.dst)
    dp = args.dp or 1
    path = export_megatron(
        ckpt, args.dst, tp=args.tp, pp=args.pp, dp=dp, distributed_optimizer=args.distributed_optimizer
    )
    out.emit_json(
        {
            "source": ckpt.path,
            "destination": path,
            "tp": args.tp,
            "pp": args.pp,
            "dp": dp,
            "distributed_optimizer": args.distributed_optimizer,
            "iteration": ckpt.iteration,
        }
    )
    files = sorted(os.listdir(path))
    out.print(
        f"wrote Megatron-LM checkpoint {path}: tp={args.tp} pp={args.pp} dp={dp}, {len(files)} rank folders"
        + (", distributed optimizer" if args.distributed_optimizer else "")
    )
    return EXIT_OK
