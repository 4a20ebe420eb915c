"""Hugging Face models as Megatron-LM checkpoints: ``convert --from hf``.

:func:`read_hf` reads a local model directory (``config.json`` and safetensors,
single or sharded; :mod:`.hf_files`) of a ``LlamaForCausalLM`` (:mod:`.llama`), a
``MixtralForCausalLM`` (:mod:`.mixtral`: experts under global ids, loadable at any ep), a
``Qwen3MoeForCausalLM`` (:mod:`.qwen3_moe`: the same, with ``--qk-layernorm``) or a
``GPT2LMHeadModel`` (:mod:`.hf`) into a :class:`~shardpoint.foreign.ForeignCheckpoint`
that looks like one read from Megatron-LM: megatron-core GPTModel's legacy names in
model order, global layers, the embedding padded to Megatron's vocabulary size, and
Megatron args. Then

* :func:`import_hf` writes it as a shardpoint ``dist`` *release* checkpoint (weights
  only: loading it enters finetune mode), which loads at any tp/pp and exports back
  to Megatron-LM (``convert --to megatron``) or Hugging Face (``export --to hf``);
* :func:`shardpoint.foreign.exporter.export_megatron` writes it straight into
  Megatron-LM's legacy format at any tp/pp, as a release checkpoint.

The args: the model-defining ones (each family's mapping) and those Megatron-LM's
loader reads from a checkpoint (``check_checkpoint_args``, ``load_args_from_checkpoint``
in ``megatron/training/checkpointing.py``), with the values of Megatron's defaults and
of the fixtures' runs: the local layer spec (``--transformer-impl local``, the
fixtures' names), ``make_vocab_size_divisible_by`` 128, the HF directory as the
tokenizer. Training args (learning rate, batch sizes, ...) are left to the run that
loads it; the checkpoint has no optimizer state.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from shardpoint.errors import CheckpointError
from shardpoint.foreign import llama, mixtral, qwen3_moe
from shardpoint.foreign._types import ForeignCheckpoint, args_to_json
from shardpoint.foreign.hf import from_gpt2_state_dict, megatron_args_from_gpt2
from shardpoint.foreign.hf_files import read_hf_dir
from shardpoint.foreign.importer import to_shardpoint
from shardpoint.foreign.megatron_torch_dist import model_order
from shardpoint.foreign.structure import VOCAB_KEYS, padded_vocab_size, repad_vocab, split_dim
from shardpoint.offline import ProgressFn, refuse_writing_into_source, write_checkpoint

__all__ = ["MAKE_VOCAB_SIZE_DIVISIBLE_BY", "import_hf", "read_hf"]

log = logging.getLogger(__name__)

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron-LM's default
_FAMILIES = {
    "llama": (llama.megatron_args_from_llama, llama.from_llama_state_dict),
    "mixtral": (mixtral.megatron_args_from_mixtral, mixtral.from_mixtral_state_dict),
    "qwen3_moe": (qwen3_moe.megatron_args_from_qwen3_moe, qwen3_moe.from_qwen3_moe_state_dict),
    "gpt2": (megatron_args_from_gpt2, from_gpt2_state_dict),
}


def _layout_args(directory: str, vocab: int, dtype: torch.dtype) -> dict[str, Any]:
    """Megatron args beside the model's: vocabulary, precision, a tp=pp=1 layout, fresh training counters."""
    return {
        "vocab_size": vocab,
        "make_vocab_size_divisible_by": MAKE_VOCAB_SIZE_DIVISIBLE_BY,
        "padded_vocab_size": padded_vocab_size(vocab, MAKE_VOCAB_SIZE_DIVISIBLE_BY, 1),
        "tokenizer_type": "HuggingFaceTokenizer",
        "tokenizer_model": directory,
        "params_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "add_position_embedding": True,  # Megatron's default; RoPE models build none whatever it says
        "transformer_impl": "local",
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "num_experts": None,  # a mixture of experts' own args set it
        "data_parallel_size": 1,
        "world_size": 1,
        "rank": 0,
        "local_rank": 0,
        "ckpt_format": "torch",
        "use_dist_ckpt": False,
        "use_distributed_optimizer": False,
        "iteration": 0,
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "skipped_train_samples": 0,
    }


def _family(config: dict[str, Any], where: str) -> str:
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        names = config.get("architectures") or [model_type]
        raise CheckpointError(
            f"{where}: model_type {model_type!r} ({', '.join(map(str, names))}) is not converted; --from hf "
            f"reads {', '.join(sorted(_FAMILIES))} models (LlamaForCausalLM, GPT2LMHeadModel, MixtralForCausalLM, "
            "Qwen3MoeForCausalLM)"
        )
    return model_type


def read_hf(path: str | os.PathLike[str]) -> ForeignCheckpoint:
    """A Hugging Face Llama or GPT-2 model directory as a Megatron-LM checkpoint (release, no optimizer).

    Raises:
        CheckpointError: another architecture, or a feature Megatron's GPT does not hold exactly (named).
        CorruptCheckpointError: a damaged config, index or safetensors file (named).
        MissingKeysError: tensors missing, or present without a place in the model.

    Example:
        >>> ckpt = read_hf("Llama-3.2-1B")
        >>> export_megatron(ckpt, "/data/llama-tp2", tp=2, pp=1)
    """
    directory = os.path.abspath(os.fspath(path))
    config, hf = read_hf_dir(directory)
    where = os.path.join(directory, "config.json")
    to_args, to_params = _FAMILIES[_family(config, where)]
    model_args = to_args(config, where)
    params = to_params(hf, model_args, directory)
    embedding = params[llama.WORD_EMBEDDINGS]
    vocab = int(config.get("vocab_size") or embedding.shape[0])
    if embedding.shape[0] != vocab:
        raise CheckpointError(f"{where}: vocab_size {vocab}, but the embedding has {embedding.shape[0]} rows")
    args = _layout_args(directory, vocab, embedding.dtype) | model_args
    rows = args["padded_vocab_size"]
    params = {
        n: repad_vocab(n, t, vocab, rows, is_param=True) if VOCAB_KEYS.search(n) else t for n, t in params.items()
    }
    ckpt = ForeignCheckpoint(
        tool="megatron",  # Megatron's names and args: every Megatron exporter takes it
        format="hf",
        path=directory,
        iteration=0,
        params=model_order(params),
        args=args_to_json(args),
        extra={"release": True, "architecture": (config.get("architectures") or ["?"])[0]},
    )
    ckpt.optimizer = {name: {} for name in ckpt.params}
    ckpt.split_dims = {name: split_dim(name) for name in ckpt.params}
    if ckpt.args["swiglu"]:
        llama.check_head_dim(ckpt.args, ckpt.params, where)
    return ckpt


def import_hf(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, progress: ProgressFn | None = None) -> str:
    """Import a Hugging Face Llama or GPT-2 directory into ``dst`` as a ``dist`` release checkpoint.

    Keys are megatron-core's (``model.decoder.layers.0.self_attention.linear_qkv.weight``),
    ``shardpoint.json``'s config is the Megatron args; it loads at any tp/pp that divides
    the model (finetune mode: weights only) and exports to Megatron-LM or back to HF.

    Example:
        >>> import_hf("Llama-3.2-1B", "runs/llama")
    """
    ckpt = read_hf(src)
    refuse_writing_into_source(ckpt.path, dst)
    tensors, common, split_dims = to_shardpoint(ckpt)
    written = write_checkpoint(
        dst,
        None,
        tensors,
        common,
        format="dist",
        layout="megatron",
        split_dims=split_dims,
        release=True,
        config=ckpt.args,
        progress=progress,
    )
    log.info("imported %s (%s) into %s", ckpt.path, ckpt.extra["architecture"], written)
    return written
