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
DST is never inside a checkpoint, and a shardpoint checkpoint is never written where
another tool (Megatron-LM, DeepSpeed) wrote the tracker: both are refused before
anything is written (:mod:`shardpoint.lifecycle.tracker_owner`).

``--from megatron|deepspeed|auto`` imports a Megatron-LM (legacy ``torch`` or
``torch_dist``, distributed optimizer included) or DeepSpeed / GPT-NeoX checkpoint as a
``dist`` checkpoint (``--no-optimizer``: the weights only), ``--from hf`` (alias
``--from-hf``) a local Hugging Face ``LlamaForCausalLM`` or ``GPT2LMHeadModel``
directory, under megatron-core's names, as a release (weights only). ``--to megatron
--tp N --pp M [--dp D --distributed-optimizer]`` writes Megatron-LM's legacy format
from such a source or from a shardpoint checkpoint imported from one
(:mod:`shardpoint.foreign`), or with ``--ckpt-format torch_dist`` megatron-core's
``torch_dist`` format (dense models); a mixture-of-experts model also needs ``--ep E`` (its
expert-parallel ranks' ``mp_rank_TT[_PPP]_EEE`` folders); a Hugging Face source becomes
Megatron's release checkpoint. ``--to deepspeed --dp D [--zero-stage 1|2|3]`` writes DeepSpeed's
own ZeRO files for D ranks, which DeepSpeed's ``load_checkpoint`` reads (from the DeepSpeed
integration's reshardable mode, or any ``--from`` source; :mod:`shardpoint.foreign.deepspeed_export`);
a pipeline engine's reshardable save is written as its ``PipelineEngine`` writes it (``--pp``: its stages).
Foreign pickles are read through an allow-list; nothing in them runs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from shardpoint import offline
from shardpoint.commands import targets
from shardpoint.commands._output import EXIT_OK, Output, add_output_flags, guarded
from shardpoint.storage.base import open_storage

__all__ = ["add_parser", "parse_split_dim", "run"]

EXAMPLES = """examples:
  shardpoint convert runs/gpt runs/gpt-tp1 --tp 1 --pp 1          # re-split a torch-format checkpoint
  shardpoint convert runs/gpt runs/gpt-dist --format dist         # torch -> dist (reshardable on load)
  shardpoint convert runs/gpt runs/gpt-neox --layout neox --iteration 200
  shardpoint convert runs/tp1 runs/tp2 --tp 2 --split-dim '*fc1.*=0' --split-dim '*fc2.weight=1'
  shardpoint convert --from hf ./Llama-3.2-1B runs/llama                  # HF Llama / GPT-2 -> dist (release)
  shardpoint convert --from hf --to megatron ./Llama-3.2-1B /data/llama-tp2pp2 --tp 2 --pp 2
  shardpoint convert s3://bucket/runs/gpt runs/gpt-copy            # download a verified copy
  shardpoint convert --from megatron /data/megatron/run runs/imported       # Megatron-LM -> dist
  shardpoint convert --from deepspeed /data/neox/run runs/imported          # DeepSpeed / GPT-NeoX -> dist
  shardpoint convert --to megatron runs/imported /data/run-tp1 --tp 1 --pp 1
  shardpoint convert --from megatron --to megatron /data/run-tp2 /data/run-tp1-dp4 --tp 1 --dp 4 --distributed-optimizer
  shardpoint convert --from megatron --to megatron /data/run-tp2 /data/tp1-dist --tp 1 --pp 1 --ckpt-format torch_dist
  shardpoint convert --to megatron runs/moe-imported /data/moe-ep4 --tp 1 --pp 1 --dp 4 --ep 4
  shardpoint convert --to deepspeed runs/neox /data/neox-dp8 --dp 8 --zero-stage 1   # reshardable mode -> DeepSpeed
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
        "src",
        metavar="SRC",
        help="a save directory or one checkpoint, local or s3:// gs:// az:// (--from hf: a local HF model)",
    )
    parser.add_argument(
        "dst",
        metavar="DST",
        help="the save directory to write the converted checkpoint into (local, s3://, gs:// or az://)",
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
    parser.add_argument(
        "--from",
        dest="from_tool",
        choices=("megatron", "deepspeed", "hf", "auto"),
        help="SRC is a Megatron-LM or DeepSpeed/GPT-NeoX checkpoint (save dir or iteration dir), or a Hugging Face "
        "Llama / GPT-2 model directory (hf), to import",
    )
    parser.add_argument("--from-hf", dest="from_tool", action="store_const", const="hf", help="the same as --from hf")
    parser.add_argument(
        "--no-optimizer",
        action="store_true",
        help="--from megatron|deepspeed: import the model weights only (e.g. when the optimizer layout is refused)",
    )
    parser.add_argument(
        "--to",
        dest="to_tool",
        choices=("megatron", "deepspeed"),
        help="write Megatron-LM's legacy torch format (needs --tp/--pp), or DeepSpeed's ZeRO-1/2 files (--dp)",
    )
    parser.add_argument(
        "--dp",
        type=_positive,
        metavar="D",
        help="data-parallel size recorded in --to megatron args; --to deepspeed: the ranks the files are for",
    )
    parser.add_argument(
        "--zero-stage", type=int, choices=(1, 2, 3), default=2, help="--to deepspeed: the ZeRO stage (default 2)"
    )
    parser.add_argument(
        "--ep",
        type=_positive,
        metavar="E",
        help="--to megatron of a mixture-of-experts model: expert-parallel size (divides the experts and --dp)",
    )
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="--to megatron: write the distributed optimizer's state (Megatron's --use-distributed-optimizer)",
    )
    parser.add_argument(
        "--ckpt-format",
        choices=("torch", "torch_dist"),
        help="--to megatron: the format Megatron-LM loads with the same --ckpt-format: torch (legacy "
        "mp_rank_* files, the default) or torch_dist (megatron-core's dist checkpointing)",
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
    if open_storage(args.dst).is_local:  # a checkpoint's files are the ones its marker lists: none added
        targets.refuse_inside_checkpoint(args.dst, args.dst)
    if args.from_tool or args.to_tool:
        return _foreign(out, args)
    if args.dp is not None or args.ep is not None or args.distributed_optimizer or args.ckpt_format:
        raise ValueError("--dp, --ep, --distributed-optimizer and --ckpt-format apply to --to megatron only")
    if args.no_optimizer:
        raise ValueError("--no-optimizer applies to --from megatron|deepspeed|auto only")
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


def _foreign(out: Output, args: argparse.Namespace) -> int:
    """``--from`` / ``--to``: import a Megatron-LM / DeepSpeed checkpoint, or export Megatron-LM's format."""
    from shardpoint import foreign
    from shardpoint.foreign.exporter import export_megatron, from_shardpoint

    for name in ("format", "layout", "split_dim"):
        if getattr(args, name):
            raise ValueError(f"--{name.replace('_', '-')} does not apply to --from/--to")
    source = None if args.from_tool in (None, "auto") else args.from_tool
    if args.ckpt_format and args.to_tool != "megatron":
        raise ValueError("--ckpt-format applies to --to megatron only")
    if args.to_tool == "deepspeed":
        return _export_deepspeed(out, args, source)
    if source == "hf" and (args.iteration is not None or args.no_optimizer):
        raise ValueError("--iteration and --no-optimizer do not apply to --from hf (weights only, one model)")
    if args.to_tool is None:
        if args.tp or args.pp or args.dp or args.ep or args.distributed_optimizer:
            raise ValueError(
                "importing keeps the source's layout (a dist checkpoint loads at any); drop --tp/--pp/--dp/--ep"
            )
        if source == "hf":
            return _import_hf(out, args)
        path = foreign.import_checkpoint(
            args.src, args.dst, source=source, iteration=args.iteration, optimizer=not args.no_optimizer
        )
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
    if source == "hf":
        from shardpoint.foreign.hf_import import read_hf

        ckpt = read_hf(args.src)
    elif args.from_tool:
        ckpt = foreign.read_foreign(args.src, source=source, iteration=args.iteration, optimizer=not args.no_optimizer)
    else:
        ckpt = from_shardpoint(args.src, args.iteration)
    offline.refuse_writing_into_source(ckpt.path, args.dst)
    dp = args.dp or 1
    if args.ckpt_format == "torch_dist":
        return _export_torch_dist(out, args, ckpt, dp)
    path = export_megatron(
        ckpt, args.dst, tp=args.tp, pp=args.pp, dp=dp, distributed_optimizer=args.distributed_optimizer, ep=args.ep
    )
    ep = args.ep or 1
    out.emit_json(
        {
            "source": ckpt.path,
            "destination": path,
            "tp": args.tp,
            "pp": args.pp,
            "dp": dp,
            "ep": ep,
            "distributed_optimizer": args.distributed_optimizer,
            "iteration": ckpt.iteration,
            "release": bool(ckpt.extra.get("release")),
        }
    )
    files = sorted(os.listdir(path))
    out.print(
        f"wrote Megatron-LM checkpoint {path}: tp={args.tp} pp={args.pp} dp={dp}"
        + (f" ep={ep}" if args.ep else "")
        + f", {len(files)} rank folders"
        + (", distributed optimizer" if args.distributed_optimizer else "")
        + (", release (weights only: Megatron-LM starts at iteration 0)" if ckpt.extra.get("release") else "")
    )
    return EXIT_OK


def _export_torch_dist(out: Output, args: argparse.Namespace, ckpt: Any, dp: int) -> int:
    """``--to megatron --ckpt-format torch_dist`` (see :mod:`.foreign.megatron_torch_dist_export`)."""
    from shardpoint.foreign.megatron_torch_dist_export import export_megatron_torch_dist

    if args.ep:
        raise ValueError("--ep: mixture-of-experts models are written in the legacy format only (--ckpt-format torch)")
    if args.no_optimizer:
        ckpt.optimizer.clear()
    path = export_megatron_torch_dist(
        ckpt, args.dst, tp=args.tp, pp=args.pp, dp=dp, distributed_optimizer=args.distributed_optimizer
    )
    optimizer = any(ckpt.optimizer.values())
    out.emit_json(
        {
            "source": ckpt.path,
            "destination": path,
            "ckpt_format": "torch_dist",
            "tp": args.tp,
            "pp": args.pp,
            "dp": dp,
            "distributed_optimizer": args.distributed_optimizer,
            "optimizer": optimizer,
            "iteration": ckpt.iteration,
            "release": bool(ckpt.extra.get("release")),
        }
    )
    out.print(
        f"wrote Megatron-LM torch_dist checkpoint {path}: tp={args.tp} pp={args.pp} dp={dp}"
        + (", distributed optimizer (fully_reshardable)" if args.distributed_optimizer and optimizer else "")
        + ("" if optimizer else ", weights only: start Megatron-LM with --no-load-optim (or --finetune)")
    )
    return EXIT_OK


def _export_deepspeed(out: Output, args: argparse.Namespace, source: str | None) -> int:
    """``--to deepspeed``: DeepSpeed's ZeRO-1/2 files for ``--dp`` ranks (see :mod:`.foreign.deepspeed_export`)."""
    from shardpoint import foreign
    from shardpoint.foreign.deepspeed_export import export_deepspeed, from_reshardable

    if args.tp or args.ep or args.distributed_optimizer:  # --pp: a pipeline engine's checkpoint at its stages
        raise ValueError(
            "--to deepspeed writes data and pipeline parallelism only: drop --tp/--ep/--distributed-optimizer"
        )
    if source == "hf":
        from shardpoint.foreign.hf_import import read_hf

        ckpt = read_hf(args.src)
    elif args.from_tool:
        ckpt = foreign.read_foreign(args.src, source=source, iteration=args.iteration, optimizer=not args.no_optimizer)
    else:
        ckpt = from_reshardable(args.src, args.iteration)
    if args.no_optimizer:
        ckpt.optimizer.clear()
    offline.refuse_writing_into_source(ckpt.path, args.dst)
    dp = args.dp or 1
    path = export_deepspeed(ckpt, args.dst, dp=dp, stage=args.zero_stage, pp=args.pp)
    optimizer = any(name.startswith("zero_pp_rank_") for name in os.listdir(path))
    out.emit_json(
        {
            "source": ckpt.path,
            "destination": path,
            "dp": dp,
            "zero_stage": args.zero_stage,
            "iteration": ckpt.iteration,
            "optimizer": optimizer,
        }
    )
    out.print(
        f"wrote DeepSpeed checkpoint {path}: ZeRO-{args.zero_stage}, dp={dp}"
        + ("" if optimizer else ", weights only: load_checkpoint(..., load_optimizer_states=False)")
    )
    return EXIT_OK


def _import_hf(out: Output, args: argparse.Namespace) -> int:
    """``--from hf`` without ``--to``: a Hugging Face model as a ``dist`` release checkpoint under Megatron's names."""
    from shardpoint.foreign.hf_import import import_hf

    with out.progress() as progress:
        path = import_hf(args.src, args.dst, progress=progress)
    _, meta = offline.resolve(path)
    out.emit_json(
        {
            "source": os.path.abspath(args.src),
            "destination": path,
            "release": meta.release,
            "files": len(meta.files),
            "bytes": meta.total_bytes,
            "config": meta.config,
        }
    )
    out.print(
        f"imported {args.src} into {path}: dist format, release (weights only), {len(meta.files)} files, "
        f"{meta.config['num_layers']} layers under megatron-core names"
    )
    return EXIT_OK
