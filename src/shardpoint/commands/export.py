"""``shardpoint export``: model weights out of a training checkpoint.

* ``--to safetensors``: one flat ``.safetensors`` file of the full model tensors,
  keys without the ``model.`` prefix, for any tool that reads safetensors.
* ``--to release``: a Megatron *release* checkpoint (weights only, ``release/`` and a
  tracker saying ``release``), which ``Checkpointer.load`` loads in finetune mode.
* ``--to hf``: a Hugging Face ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` directory
  (``config.json``, ``model.safetensors``, sharded with an index past
  ``--max-shard-size``). From a Megatron-LM checkpoint (legacy ``torch`` or
  ``torch_dist``, read in place, its optimizer state not read) or a shardpoint
  checkpoint imported from one (``convert --from megatron|hf``), via
  :func:`shardpoint.foreign.hf.export_hf`: GPT-2-like and Llama-like models, anything
  else is refused naming the features each family lacks. From a demo GPT run, via
  ``shardpoint.demo.hf.export_hf``.

SRC may be local or ``s3://bucket/prefix``. A release checkpoint may be written to
either too; safetensors files and Hugging Face directories are written locally only.

An export writes something new and never into or over what exists, checked before
anything is read (:func:`shardpoint.commands.targets.refuse_export_target`): ``hf`` and
``release`` need a new or empty directory, a safetensors file a name not taken, and
none may lie inside a shardpoint checkpoint.

safetensors stores metadata as strings only and reserves the name ``__metadata__``
(safetensors issue 849: such a file could be written but not read back), so names
and metadata are validated before anything is written; the file is written under a
temporary name and renamed, so a failed export leaves no half file.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from shardpoint import offline
from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.commands import targets
from shardpoint.commands._hf import hf_function
from shardpoint.commands._output import EXIT_OK, Output, add_output_flags, guarded, human_bytes
from shardpoint.commands.inspect import read_common
from shardpoint.errors import CheckpointError
from shardpoint.state.train_state import MODEL_PREFIX
from shardpoint.storage.base import open_storage
from shardpoint.storage.permissions import as_umask_allows

if TYPE_CHECKING:
    from shardpoint.foreign import ForeignCheckpoint

__all__ = ["DTYPES", "add_parser", "model_tensors", "run", "write_safetensors"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RESERVED = "__metadata__"

EXAMPLES = """examples:
  shardpoint export runs/gpt --to safetensors model.safetensors --dtype bf16
  shardpoint export runs/gpt --to release runs/gpt-release --iteration 200
  shardpoint export runs/gpt --to hf ./hf-model
  shardpoint export /data/megatron/gpt2-run --to hf ./hf-model      # Megatron-LM, read in place
  shardpoint export /data/megatron/llama-run --to hf ./hf-llama --dtype bf16 --max-shard-size 2GB
  shardpoint export s3://bucket/runs/gpt --to safetensors ./model.safetensors
"""


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export model weights: safetensors, a release checkpoint, or Hugging Face",
        description="Export the model weights of a checkpoint (optimizer state and RNG are left out).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", metavar="SRC", help="a save directory or one checkpoint (local, s3://, gs:// or az://)")
    parser.add_argument("--to", required=True, choices=("safetensors", "release", "hf"), help="what to write")
    parser.add_argument(
        "out",
        metavar="OUT",
        help="safetensors: a local file (or a directory for model.safetensors); hf: a local directory; "
        "release: a save directory (local, s3://, gs:// or az://)",
    )
    parser.add_argument("--iteration", type=int, metavar="N", help="which checkpoint of SRC (default: the tracker's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating-point weights (default: as saved)")
    parser.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="hf from Megatron-LM: the tokenizer's vocabulary size when the args do not record it "
        "(embedding rows past it are Megatron's padding and are dropped)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="hf from Megatron-LM: split the weights into safetensors shards of at most SIZE, with an index "
        "(default 5GB, as transformers)",
    )
    add_output_flags(parser)
    parser.set_defaults(func=run)


@guarded
def run(args: argparse.Namespace) -> int:
    out = Output(args)
    if args.to != "release" and "://" in args.out:
        raise ValueError(
            f"--to {args.to} writes a local {'file' if args.to == 'safetensors' else 'directory'}; "
            f"OUT must be a local path, got {args.out}"
        )
    if args.vocab_size is not None and args.to != "hf":
        raise ValueError("--vocab-size applies to --to hf only")
    targets.refuse_export_target(args.to, args.out)
    if args.to == "hf":
        megatron = _megatron_source(args.src, args.iteration)
        if megatron is not None:
            return _megatron_hf(out, args, megatron)
        if args.vocab_size is not None:
            raise ValueError("--vocab-size applies to Megatron-LM sources only; the demo GPT records its vocabulary")
        export_hf = hf_function("export_hf")
        written = export_hf(args.src, args.out, args.iteration, args.dtype)
        source = open_storage(args.src).root
        out.emit_json({"to": "hf", "source": source, "destination": str(written or args.out)})
        out.print(f"exported {args.src} to {written or args.out} (Hugging Face)")
        return EXIT_OK
    with out.progress() as progress:
        full = offline.read_full(args.src, args.iteration, progress=progress)
        tensors = model_tensors(full.tensors, DTYPES.get(args.dtype), full.path)
        if args.to == "safetensors":
            written = write_safetensors(tensors, args.out, _safetensors_metadata(full))
        else:
            written = _write_release(full, tensors, args.out, progress)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    out.emit_json(
        {
            "to": args.to,
            "source": full.path,
            "destination": written,
            "tensors": len(tensors),
            "bytes": size,
            "dtype": args.dtype,
        }
    )
    out.print(f"exported {len(tensors)} tensors ({human_bytes(size)}) from {full.path} to {written}")
    return EXIT_OK


def _megatron_source(src: str, iteration: int | None) -> ForeignCheckpoint | None:
    """The Megatron-LM model ``src`` holds (read in place, or imported by shardpoint), or None."""
    from shardpoint import foreign
    from shardpoint.foreign.exporter import from_shardpoint, holds_megatron_model

    directory = foreign.find_foreign(src, iteration)
    if directory is not None:
        return foreign.read_foreign(directory, optimizer=False)  # weights only: any optimizer layout will do
    try:
        path, meta = offline.resolve(src, iteration)
    except CheckpointError:
        return None  # the demo bridge says what is wrong with it, in its own words
    common = read_common(path, meta)
    tool = (common.get("foreign") or {}).get("tool")
    if holds_megatron_model(common, meta.release, dict(meta.config)):
        return from_shardpoint(path)
    if tool is not None:
        raise CheckpointError(f"{path} was imported from {tool}; --to hf maps Megatron-LM GPT models only")
    return None


def _megatron_hf(out: Output, args: argparse.Namespace, ckpt: ForeignCheckpoint) -> int:
    from shardpoint.foreign.hf import export_hf

    written = export_hf(
        ckpt, args.out, dtype=DTYPES.get(args.dtype), vocab_size=args.vocab_size, max_shard_size=args.max_shard_size
    )
    with open(os.path.join(written, "config.json")) as f:
        config = json.load(f)
    rows = ckpt.params["embedding.word_embeddings.weight"].shape[0]
    architecture = config["architectures"][0]
    layers = config.get("n_layer", config.get("num_hidden_layers"))
    weights = sorted(n for n in os.listdir(written) if n.endswith(".safetensors"))
    out.emit_json(
        {
            "to": "hf",
            "source": ckpt.path,
            "destination": written,
            "tool": ckpt.tool,
            "format": ckpt.format,
            "imported": os.path.exists(os.path.join(ckpt.path, MARKER_NAME)),
            "iteration": ckpt.iteration,
            "architecture": architecture,
            "layers": layers,
            "vocab_size": config["vocab_size"],
            "padding_rows_dropped": rows - config["vocab_size"],
            "activation_function": config.get("activation_function", config.get("hidden_act")),
            "tie_word_embeddings": config["tie_word_embeddings"],
            "dtype": config["torch_dtype"],
            "weight_files": weights,
        }
    )
    imported = os.path.exists(os.path.join(ckpt.path, MARKER_NAME))
    what = f"{ckpt.path} (imported from Megatron-LM {ckpt.format})" if imported else f"Megatron-LM {ckpt.path}"
    details = (
        f"{config['activation_function']}"
        if "activation_function" in config
        else f"{config['num_key_value_heads']} kv heads, rope_theta {config['rope_theta']:g}"
    )
    if "num_local_experts" in config:
        details += f", {config['num_local_experts']} experts (top-{config['num_experts_per_tok']})"
    out.print(
        f"exported {what}, iteration {ckpt.iteration}, to {written}: Hugging Face {architecture}, "
        f"{layers} layers, vocabulary {config['vocab_size']}, {details}, {len(weights)} safetensors file(s)"
    )
    return EXIT_OK


def model_tensors(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, where: str
) -> dict[str, torch.Tensor]:
    """The ``model.*`` tensors, prefix kept, floating-point ones cast to ``dtype`` when given."""
    found = {
        key: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
        for key, t in tensors.items()
        if key.startswith(MODEL_PREFIX)
    }
    if not found:
        raise CheckpointError(f"{where} holds no model tensors (no key starts with {MODEL_PREFIX!r}); nothing to do")
    return found


def write_safetensors(tensors: Mapping[str, torch.Tensor], out: str, metadata: Mapping[str, str]) -> str:
    """Write ``tensors`` (``model.`` prefix removed) to ``out`` atomically; returns the file written.

    Raises:
        ValueError: a tensor name or metadata entry safetensors cannot store or read back.
        CheckpointError: ``out`` exists already.
    """
    from safetensors.torch import save_file

    flat = {key[len(MODEL_PREFIX) :]: t for key, t in tensors.items()}
    _validate_names(flat, metadata)
    path = targets.safetensors_path(out)
    if os.path.exists(path):
        raise CheckpointError(f"{path} exists already; remove it or choose another output name")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(flat, tmp, metadata=dict(metadata))
        as_umask_allows(tmp)  # safetensors writes 0600; an exported model is for others to read
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _validate_names(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    for name in tensors:
        if not name or name == RESERVED:
            raise ValueError(f"tensor name {name!r} cannot be stored in safetensors (empty or reserved {RESERVED!r})")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"safetensors metadata must map strings to strings; {key!r}: {value!r} does not")


def _safetensors_metadata(full: offline.FullCheckpoint) -> dict[str, str]:
    meta = full.metadata
    return {
        "format": "pt",
        "shardpoint.source": full.path,
        "shardpoint.iteration": "release" if meta.release else str(meta.iteration),
        "shardpoint.config": json.dumps(meta.config, sort_keys=True),
    }


def _write_release(full: offline.FullCheckpoint, tensors: dict[str, torch.Tensor], out: str, progress: Any) -> str:
    meta = full.metadata
    offline.refuse_writing_into_source(full.path, out)
    return offline.write_checkpoint(
        out,
        None,
        tensors,
        full.common,
        meta.topology["tp"],
        meta.topology["pp"],
        meta.format,
        meta.layout,
        full.split_dims,
        release=True,
        config=meta.config,
        stages=full.stages,
        progress=progress,
    )
