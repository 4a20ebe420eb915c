"""Megatron-LM mixture-of-experts GPTs with ``--qk-layernorm`` and Hugging Face ``Qwen3MoeForCausalLM``, both ways.

A Qwen3-MoE is a Mixtral (:mod:`.mixtral`: a Llama whose MLPs are softmax top-k routed SwiGLU
experts) with two differences, both mapped here on top of the shared code:

* per-head RMSNorm of queries and keys before RoPE: Megatron's ``--qk-layernorm``.
  megatron-core builds ``self_attention.q_layernorm`` / ``k_layernorm`` over
  ``hidden_size_per_attention_head`` with ``eps=layernorm_epsilon`` and applies them per head in
  ``get_query_key_value_tensors``, before the rotary embedding: Qwen3's ``self_attn.q_norm`` /
  ``k_norm`` ([head_dim], ``rms_norm_eps``) exactly (:data:`.llama.QK_NORM_MAP`);
* other names: the router is ``mlp.gate.weight``, expert ``g`` is ``mlp.experts.<g>.gate_proj``
  / ``up_proj`` / ``down_proj`` (Megatron's ``linear_fc1`` is ``[gate; up]``).

The router: Megatron's default softmax over the top-k logits equals Qwen3-MoE's softmax, top-k,
renormalised only with ``norm_topk_prob`` true; false (transformers' default) keeps the
unnormalised top-k probabilities, which no Megatron router without ``--moe-router-pre-softmax``
computes, so it is refused by name, and so are dense layers among the sparse ones
(``mlp_only_layers``, ``decoder_sparse_step`` > 1) and sliding windows. Everything Mixtral
cannot compute (:func:`.mixtral.mixtral_problems`) Qwen3-MoE cannot either.

Checked against Megatron-LM's own forward pass in
``tests/fixtures/megatron-moe/moe-torchdist-ep2-qwen3`` (its MANIFEST's ``hf_logits_check``).
"""

from __future__ import annotations

from typing import Any

import torch

from shardpoint.errors import CheckpointError
from shardpoint.foreign import llama, mixtral

__all__ = [
    "ARCHITECTURE",
    "MOE_MLP",
    "from_qwen3_moe_state_dict",
    "megatron_args_from_qwen3_moe",
    "qwen3_moe_config",
    "qwen3_moe_problems",
    "to_qwen3_moe_state_dict",
]

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL = "a Qwen3-MoE model"
MOE_MLP = mixtral.moe_mlp("mlp.gate.weight", "mlp.experts.{}.{}.weight", ("gate_proj", "up_proj", "down_proj"), MODEL)


def _arg(args: dict[str, Any], name: str, default: Any = None) -> Any:
    value = args.get(name, default)
    return default if value is None else value


def qwen3_moe_problems(args: dict[str, Any]) -> list[str]:
    """What in Megatron ``args`` ``Qwen3MoeForCausalLM`` cannot hold exactly, one phrase each (empty: Qwen3-MoE).

    Mixtral's refusals (the same router and experts, :func:`.mixtral.mixtral_problems`) less the
    query/key norms, which Qwen3-MoE has and needs.
    """
    problems = mixtral.mixtral_problems(args | {"qk_layernorm": False}, model="Qwen3-MoE")
    if not _arg(args, "qk_layernorm", False):
        problems.append("no query/key normalization (Qwen3-MoE normalises each query and key head: --qk-layernorm)")
    return problems


def to_qwen3_moe_state_dict(
    args: dict[str, Any], params: dict[str, torch.Tensor], vocab: int, layers: int, where: str
) -> dict[str, torch.Tensor]:
    """The ``Qwen3MoeForCausalLM`` state dict (``save_pretrained``'s names) of Megatron ``params``.

    ``args`` already checked (:func:`qwen3_moe_problems`); experts under global ids.

    Raises:
        CheckpointError: a tensor Qwen3-MoE needs is missing (the q/k norms included), a layer
            lacks experts, or a tensor Qwen3-MoE has no place for is present (named).
    """
    return llama.to_llama_state_dict(args, params, vocab, layers, where, mlp=MOE_MLP, model=MODEL)


def qwen3_moe_config(
    args: dict[str, Any], params: dict[str, torch.Tensor], vocab: int, layers: int, dtype: torch.dtype
) -> dict[str, Any]:
    """``config.json`` of the ``Qwen3MoeForCausalLM`` equal to a Megatron MoE model (``args`` already checked).

    Every layer is sparse (``decoder_sparse_step`` 1, no ``mlp_only_layers``); ``intermediate_size``
    (the width of dense layers, which this model has none of) is Megatron's ``ffn_hidden_size``, so
    an imported Qwen3-MoE exports back with its own config.
    """
    config = mixtral.moe_base_config(args, params, vocab, layers, dtype)
    experts_width = config["intermediate_size"]
    return config | {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_moe",
        "intermediate_size": int(_arg(args, "ffn_hidden_size", experts_width)),
        "moe_intermediate_size": experts_width,
        "num_experts": int(args["num_experts"]),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
    }


def megatron_args_from_qwen3_moe(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The model-defining Megatron-LM args (JSON form) of a ``Qwen3MoeForCausalLM`` ``config.json``.

    Raises:
        CheckpointError: a feature this mapping does not hold exactly (unnormalised top-k
            weights, dense layers, sliding windows, biases, ...), each named.
    """
    problems = []
    if not config.get("norm_topk_prob", False):  # transformers' default is false
        problems.append(
            "unnormalised top-k router weights (norm_topk_prob false; Megatron's softmax router renormalises the top-k)"
        )
    dense = sorted(config.get("mlp_only_layers") or [])
    if dense:
        problems.append(f"dense MLP layers among the MoE ones (mlp_only_layers {dense})")
    step = int(config.get("decoder_sparse_step") or 1)
    if step != 1:
        problems.append(f"dense MLP layers among the MoE ones (decoder_sparse_step {step}: only every {step}th is MoE)")
    if config.get("use_sliding_window") and config.get("sliding_window") is not None:
        problems.append(f"sliding-window attention (use_sliding_window, sliding_window {config['sliding_window']})")
    # transformers' defaults for what a config.json leaves out (save_pretrained writes num_local_experts)
    experts = int(config.get("num_experts", config.get("num_local_experts", 128)) or 0)
    if experts <= 0:
        problems.append("no experts (num_experts 0: every layer dense)")
    if problems:
        raise CheckpointError(f"{where}: this Qwen3-MoE model cannot be converted exactly: " + "; ".join(problems))
    args = llama.megatron_args_from_llama(config, where)  # intermediate_size -> ffn_hidden_size (dense width)
    moe = mixtral.megatron_moe_args(
        experts,
        int(config.get("num_experts_per_tok", 8)),
        int(config.get("moe_intermediate_size", 768)),
        float(config.get("router_aux_loss_coef", 0.001)),
    )
    return args | moe | {"qk_layernorm": True}


def from_qwen3_moe_state_dict(hf: dict[str, torch.Tensor], args: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """Megatron global tensors (legacy names, global expert ids) of a ``Qwen3MoeForCausalLM`` state dict.

    Raises:
        MissingKeysError: a tensor Qwen3-MoE has is missing, or one it has no place for is present.
    """
    return llama.from_llama_state_dict(hf, args, where, mlp=MOE_MLP)
