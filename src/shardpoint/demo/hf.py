"""Convert demo GPT checkpoints to and from Hugging Face ``GPT2LMHeadModel`` files.

Export reads a ``dist`` checkpoint's full tensors in one process with plain
``torch.distributed.checkpoint`` (the checkpoint's ``.metadata`` read by shardpoint's
restricted unpickler, the files checked against ``shardpoint.json`` first): DCP
reassembles each global tensor from the tp / pp shards it was saved in. The global
keys are then renamed and re-laid out for GPT-2:

* HF's ``Conv1D`` stores weights as ``[in, out]``, the transpose of ``nn.Linear``'s;
* HF's fused ``c_attn`` orders its output as ``[q of all heads | k | v]``, ours head by
  head (``[heads, q|k|v, head_dim]``, see :mod:`shardpoint.demo.model`), so the rows
  are regrouped before the transpose;
* the head is tied to ``wte``, so no ``lm_head.weight`` is written.

Import does the reverse and writes a *release* checkpoint (loading it enters finetune
mode). For ``format="dist"`` it is written offline by one process holding the full
tensors (a tp=1, pp=1 model): the ``dist`` format stores global tensors, so that
checkpoint loads at any layout, including the requested one, which is only checked
for divisibility. ``format="torch"`` stores one file per model-parallel rank, so it
starts ``tp * pp`` local gloo ranks that each save their own shard.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import shardpoint as sp
from shardpoint.catalog.integrity import verify_files
from shardpoint.catalog.layout import get_layout
from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.demo.model import WORD_EMBEDDINGS, GPTConfig, GPTModel
from shardpoint.demo.parallel import build_parallel_state
from shardpoint.demo.procs import run_function
from shardpoint.demo.rng_tracker import RNGTracker
from shardpoint.formats.dist import dcp_reader
from shardpoint.lifecycle import commit
from shardpoint.state.sharding import copy_overlap
from shardpoint.storage.base import open_storage

__all__ = ["export_hf", "from_hf_state_dict", "import_hf", "read_full_model", "to_hf_state_dict"]

log = logging.getLogger(__name__)

HF_WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"  # DCP's note that it runs in one process: intended
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# (our name inside a layer, HF name inside a block, is an nn.Linear weight to transpose)
_LAYER_MAP = [
    ("input_layernorm.weight", "ln_1.weight", False),
    ("input_layernorm.bias", "ln_1.bias", False),
    ("self_attention.linear_qkv.weight", "attn.c_attn.weight", True),
    ("self_attention.linear_qkv.bias", "attn.c_attn.bias", False),
    ("self_attention.linear_proj.weight", "attn.c_proj.weight", True),
    ("self_attention.linear_proj.bias", "attn.c_proj.bias", False),
    ("pre_mlp_layernorm.weight", "ln_2.weight", False),
    ("pre_mlp_layernorm.bias", "ln_2.bias", False),
    ("mlp.linear_fc1.weight", "mlp.c_fc.weight", True),
    ("mlp.linear_fc1.bias", "mlp.c_fc.bias", False),
    ("mlp.linear_fc2.weight", "mlp.c_proj.weight", True),
    ("mlp.linear_fc2.bias", "mlp.c_proj.bias", False),
]
_TOP_MAP = [
    (WORD_EMBEDDINGS, "transformer.wte.weight"),
    ("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    ("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
    ("decoder.final_layernorm.bias", "transformer.ln_f.bias"),
]


# ------------------------------------------------------------------ layout of the tensors
def _qkv_to_hf(t: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Rows ``[heads, 3, head_dim]`` (ours) -> ``[3, heads, head_dim]`` (HF), any trailing dims."""
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    return t.reshape(heads, 3, hd, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _qkv_from_hf(t: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    return t.reshape(3, heads, hd, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def to_hf_state_dict(
    tensors: dict[str, torch.Tensor], cfg: GPTConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Our global-key tensors -> ``GPT2LMHeadModel`` state dict (contiguous, ``dtype``)."""
    out = {hf: tensors[ours] for ours, hf in _TOP_MAP}
    for i in range(cfg.num_layers):
        for ours, hf, linear in _LAYER_MAP:
            t = tensors[f"decoder.layers.{i}.{ours}"]
            if ours.startswith("self_attention.linear_qkv"):
                t = _qkv_to_hf(t, cfg)
            out[f"transformer.h.{i}.{hf}"] = t.t() if linear else t
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in out.items()}


def from_hf_state_dict(
    hf: dict[str, torch.Tensor], cfg: GPTConfig, where: str = "the Hugging Face weights"
) -> dict[str, torch.Tensor]:
    """``GPT2LMHeadModel`` (or ``GPT2Model``) state dict -> our global-key float32 tensors.

    Raises:
        MissingKeysError: a GPT-2 tensor the model needs is not in ``hf``.
    """
    hf = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in hf.items()}
    wanted = [hf_key for _, hf_key in _TOP_MAP] + [
        f"transformer.h.{i}.{hf_key}" for i in range(cfg.num_layers) for _, hf_key, _ in _LAYER_MAP
    ]
    missing = [k for k in wanted if k not in hf]
    if missing:
        raise sp.MissingKeysError(where, missing, [])
    out = {ours: hf[hf_key] for ours, hf_key in _TOP_MAP}
    for i in range(cfg.num_layers):
        for ours, hf_key, linear in _LAYER_MAP:
            t = hf[f"transformer.h.{i}.{hf_key}"]
            t = t.t() if linear else t
            if ours.startswith("self_attention.linear_qkv"):
                t = _qkv_from_hf(t, cfg)
            out[f"decoder.layers.{i}.{ours}"] = t
    return {k: v.float().contiguous() for k, v in out.items()}


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """``config.json`` of the equivalent ``GPT2LMHeadModel``."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_length,
        "n_ctx": cfg.seq_length,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads,
        "n_inner": cfg.ffn_hidden_size,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "layer_norm_epsilon": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_std,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def config_from_hf(config: dict[str, Any], where: str) -> GPTConfig:
    """The GPTConfig of a GPT-2 ``config.json``; refuses what the demo model cannot represent."""
    if config.get("model_type") != "gpt2" or config.get("activation_function", "gelu_new") not in _ACTIVATIONS:
        raise sp.CheckpointError(
            f"{where} is not a GPT-2 config with a tanh GELU (model_type "
            f"{config.get('model_type')!r}, activation {config.get('activation_function')!r})"
        )
    if not config.get("tie_word_embeddings", True) or config.get("scale_attn_by_inverse_layer_idx"):
        raise sp.CheckpointError(f"{where}: untied heads and per-layer attention scaling are not supported")
    hidden = config.get("n_embd", 768)
    return GPTConfig(
        num_layers=config.get("n_layer", 12),
        hidden_size=hidden,
        num_attention_heads=config.get("n_head", 12),
        seq_length=config.get("n_positions", 1024),
        vocab_size=config.get("vocab_size", 50257),
        ffn_hidden_size=config.get("n_inner") or 4 * hidden,
        hidden_dropout=config.get("resid_pdrop", 0.1),
        attention_dropout=config.get("attn_pdrop", 0.1),
        layernorm_epsilon=config.get("layer_norm_epsilon", 1e-5),
        init_std=config.get("initializer_range", 0.02),
    )


# ------------------------------------------------------------------ reading our checkpoints
def _find_checkpoint(run_dir: str, iteration: int | None) -> tuple[str, CheckpointMetadata]:
    """The committed checkpoint directory to export (a save root, or a checkpoint itself) and its marker."""
    storage = open_storage(run_dir)
    root = storage.root
    if storage.exists(storage.join(root, MARKER_NAME)) and iteration is None:
        return root, commit.read_marker(storage, root)
    if not storage.is_dir(root):
        raise sp.CheckpointError(f"{root} is not a directory; pass the save directory of a demo run")
    layout = commit.detect_layout(storage, root, get_layout("megatron"))
    if iteration is None:
        found, iteration = commit.read_tracker(storage, root, layout)
        if not found:
            committed = [e for e in commit.list_checkpoints(storage, root, layout) if e.committed]
            if not committed:
                raise sp.CheckpointError(f"{root} holds no committed checkpoint to export")
            iteration = committed[-1].iteration
    path = storage.join(root, layout.dir_name(iteration))
    return path, commit.read_marker(storage, path)


def read_full_model(path: str, meta: CheckpointMetadata) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of a ``dist`` checkpoint, full size, by global key (without ``model.``).

    Raises:
        CorruptCheckpointError: a file is missing or fails its checksum.
    """
    if meta.format != "dist":
        raise sp.CheckpointError(
            f"{path} is a {meta.format!r} checkpoint; export reads the reshardable 'dist' "
            "format: convert it first (`shardpoint convert --format dist`)"
        )
    storage = open_storage(path)
    problems = verify_files(storage, path, meta)
    if problems:
        raise sp.CorruptCheckpointError(f"cannot export {path}: " + "; ".join(map(str, problems)))
    reader = dcp_reader(storage, path, listed=meta.files)
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


def _model_config(meta: CheckpointMetadata, path: str) -> GPTConfig:
    names = {f.name for f in fields(GPTConfig)}
    saved = {k: v for k, v in meta.config.items() if k in names}
    missing = {"num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"} - set(saved)
    if missing:
        raise sp.CheckpointError(
            f"{path} does not record the model's {sorted(missing)} in its config; it was not saved by the demo trainer"
        )
    return GPTConfig(**saved)


_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)} or a torch.dtype, got {dtype!r}")
    return _DTYPE_NAMES[dtype]


def export_hf(
    run_dir: str, out_dir: str, iteration: int | None = None, dtype: torch.dtype | str | None = torch.float32
) -> None:
    """Write ``config.json`` and ``model.safetensors`` that ``GPT2LMHeadModel.from_pretrained(out_dir)`` loads.

    Args:
        run_dir: a demo run's save directory (its tracker picks the checkpoint) or a checkpoint directory.
        out_dir: created if needed; existing files of the same names are replaced.
        iteration: export this iteration instead of the latest.
        dtype: dtype of the written weights: a ``torch.dtype``, ``"fp32"``, ``"fp16"``, ``"bf16"``
            (None: float32, the demo's training dtype).

    Raises:
        CheckpointError: no checkpoint, not the ``dist`` format, not a demo model, or damaged files.

    Example:
        >>> export_hf("runs/demo/run", "hf-out")
        >>> transformers.GPT2LMHeadModel.from_pretrained("hf-out")
    """
    path, meta = _find_checkpoint(run_dir, iteration)
    cfg = _model_config(meta, path)
    tensors = to_hf_state_dict(read_full_model(path, meta), cfg, _as_dtype(dtype))
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, HF_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, HF_CONFIG), "w") as f:
        json.dump(hf_config(cfg), f, indent=2)
    log.info("exported %s (iteration %d) to %s", path, meta.iteration, out_dir)


# ------------------------------------------------------------------ writing release checkpoints
def _read_hf(hf_dir: str) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    config_path, weights_path = os.path.join(hf_dir, HF_CONFIG), os.path.join(hf_dir, HF_WEIGHTS)
    for path in (config_path, weights_path):
        if not os.path.exists(path):
            raise sp.CheckpointError(
                f"{path} is missing; import_hf reads a GPT-2 directory with {HF_CONFIG} and {HF_WEIGHTS}"
            )
    with open(config_path) as f:
        cfg = config_from_hf(json.load(f), config_path)
    return cfg, from_hf_state_dict(load_file(weights_path), cfg, weights_path)


def _save_release(
    cfg: GPTConfig, tensors: dict[str, torch.Tensor], dst_dir: str, tp: int, pp: int, format: str
) -> None:
    """Build this rank's model at (tp, pp), fill it from the full tensors, save it as the release checkpoint."""
    ps = build_parallel_state(tp, pp, 1, device=torch.device("cpu"))
    model = GPTModel(cfg, ps, RNGTracker(0, ps))
    shards = model.sharded_state_dict()
    unknown = sorted(set(shards) - set(tensors))
    if unknown:
        raise sp.MissingKeysError("the converted Hugging Face weights", unknown, [])
    for key, value in shards.items():
        shard = value if isinstance(value, sp.Shard) else sp.Shard(value, tuple(value.shape), (0,) * value.dim())
        copy_overlap(shard, tensors[key], (0,) * shard.tensor.dim())
    ckpt = sp.Checkpointer(dst_dir, topology=ps.topology, format=format, config=cfg.checkpoint_config())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
            ckpt.save_release(sp.TrainState(model=model))
    finally:
        ckpt.close()


def _import_rank(rank: int, world: int, hf_dir: str, dst_dir: str, tp: int, pp: int, format: str) -> None:
    cfg, tensors = _read_hf(hf_dir)
    _save_release(cfg, tensors, dst_dir, tp, pp, format)


def import_hf(hf_dir: str, dst_dir: str, tp: int, pp: int, format: str = "dist") -> None:
    """Write a release checkpoint of a GPT-2 directory that the demo model loads at ``tp`` x ``pp``.

    Args:
        hf_dir: holds ``config.json`` and ``model.safetensors`` (e.g. from :func:`export_hf`).
        dst_dir: the save directory to create; its tracker will read ``release``.
        tp, pp: the layout to load at; checked to divide the model.
        format: ``"dist"`` (one process, loads at any layout) or ``"torch"`` (local gloo ranks
            save one file per tp x pp rank; loads at exactly this layout).

    Raises:
        TopologyMismatchError: the model does not divide over ``tp`` x ``pp``.
        CheckpointError: the directory is not a GPT-2 the demo model can represent.
    """
    if format not in ("dist", "torch"):
        raise ValueError(f"format must be 'dist' or 'torch', got {format!r}")
    cfg, tensors = _read_hf(hf_dir)
    cfg.check_layout(tp, pp)
    if format == "dist":
        if dist.is_available() and dist.is_initialized():
            raise sp.CheckpointError(
                "import_hf writes the dist format from one process; call it outside a torch.distributed job"
            )
        _save_release(cfg, tensors, dst_dir, 1, 1, format)
    else:
        run_function(_import_rank, tp * pp, hf_dir, dst_dir, tp, pp, format)
    log.info(
        "imported %s into %s as a release checkpoint (%s format, for tp=%d pp=%d)", hf_dir, dst_dir, format, tp, pp
    )
