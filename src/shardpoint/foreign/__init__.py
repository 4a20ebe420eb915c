"""Megatron-LM and DeepSpeed checkpoints: read safely, import, reshard, export.

* :func:`read_foreign` reads a Megatron-LM (legacy ``torch``, ``torch_dist``) or
  DeepSpeed / GPT-NeoX (ZeRO-1/2, pipeline) checkpoint into full global tensors with
  their optimizer state, never unpickling code (:mod:`._unpickle`).
* :func:`import_checkpoint` writes it as a shardpoint ``dist`` checkpoint.
* :func:`find_foreign` tells another tool's checkpoint from shardpoint's own.
* :func:`export_megatron` writes Megatron-LM's legacy format at a new tp/pp (and dp
  with the distributed optimizer), from either kind of source.
* :func:`shardpoint.foreign.hf.export_hf` writes a GPT-2-like, Llama-like, Mixtral-like or
  Qwen3-MoE-like Megatron GPT as a Hugging Face ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
  ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` directory, and
  :mod:`shardpoint.foreign.hf_import` reads such a directory back as a Megatron model.

Modules: ``_unpickle`` (allow-list loading), ``_types``, ``structure`` (split dims,
QKV, GLU, vocab padding), ``megatron``, ``megatron_torch_dist``, ``megatron_distopt``
(the distributed optimizer's bucket space), ``megatron_moe`` (mixture-of-experts names,
order and limits), ``deepspeed``, ``importer``, ``exporter``,
``llama`` (the Llama mapping, both ways), ``mixtral`` (Mixtral's MoE block on top of it), ``qwen3_moe`` (Mixtral's block
under Qwen3's names, with per-head q/k norms),
``hf`` (GPT-2 mapping, family choice),
``hf_files`` (safetensors directories), ``hf_import``.
"""

from shardpoint.foreign._types import ForeignCheckpoint
from shardpoint.foreign.importer import detect, find_foreign, import_checkpoint, locate, read_foreign, to_shardpoint

__all__ = [
    "ForeignCheckpoint",
    "detect",
    "find_foreign",
    "import_checkpoint",
    "locate",
    "read_foreign",
    "to_shardpoint",
]
