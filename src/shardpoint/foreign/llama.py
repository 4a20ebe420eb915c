"""Llama-family models between Megatron-LM (megatron-core GPTModel) and Hugging Face ``LlamaForCausalLM``.

One table (:data:`LAYER_MAP`) is read both ways. Megatron's side is what
:class:`~shardpoint.foreign.ForeignCheckpoint` holds: legacy names, global layer
numbers, TP pieces joined. The conventions, each checked against Megatron-LM's own
forward pass in the ``megatron-llama`` fixtures (their MANIFEST's naming facts and
``hf_logits_check``):

* ``linear_qkv`` rows are interleaved per query group, ``[q heads of group g; k_g; v_g]``
  with query head ``h`` in group ``h // (heads / groups)``: this is HF's order of
  ``q_proj`` heads and ``k_proj`` / ``v_proj`` kv heads (HF repeats kv heads with
  ``repeat_interleave``), so rows are only regrouped
  (:func:`~shardpoint.foreign.structure.qkv_to_separate`);
* RoPE: Megatron's default (``rotary_interleaved`` false) is HF's rotate-half, so q/k
  rows are copied *without* the permutation used for Meta's original checkpoints;
  ``rotary_base`` is ``rope_theta``;
* ``linear_fc1`` is ``[gate; up]`` (the first half goes through SiLU);
* RMSNorm ``layernorm_epsilon`` is ``rms_norm_eps``; ``kv_channels`` is ``head_dim``;
* embedding rows past the vocabulary are Megatron's padding, dropped on export and
  added (copies of the last row, as Megatron's converter does) on import;
* the output layer is ``lm_head`` (absent when tied).

Anything else is refused naming each feature (:func:`llama_problems`): biases
(including Qwen2's QKV biases: no fixture has them, so Megatron's convention for
them cannot be verified here), partial or interleaved or scaled RoPE, MoE, MLA, ...

The MLP is a plug-in (:class:`MlpMapping`, Llama's dense SwiGLU :data:`DENSE_MLP`): Mixtral
(:mod:`.mixtral`) reuses everything else here with its experts in the MLP's place. Per-head
query/key RMSNorms (Megatron's ``--qk-layernorm``, Qwen3's ``q_norm`` / ``k_norm``:
:data:`QK_NORM_MAP`) are mapped when the args say ``qk_layernorm``; Llama itself refuses them,
Qwen3-MoE (:mod:`.qwen3_moe`) is the family that admits them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardpoint.errors import CheckpointError, MissingKeysError
from shardpoint.foreign.structure import qkv_to_separate, separate_to_qkv

__all__ = [
    "ARCHITECTURE",
    "ATTENTION_MAP",
    "DENSE_MLP",
    "LAYER_MAP",
    "QK_NORM_MAP",
    "MlpMapping",
    "check_head_dim",
    "from_llama_state_dict",
    "heads_and_groups",
    "llama_config",
    "llama_problems",
    "looks_like_llama",
    "megatron_args_from_llama",
    "to_llama_state_dict",
]

ARCHITECTURE = "LlamaForCausalLM"
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
QKV, FC1 = "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"

# Megatron names inside a layer (local spec first, then Transformer Engine's fused name) -> HF names inside
# ``model.layers.<i>.``; QKV and FC1 map to several HF tensors and are handled apart.
ATTENTION_MAP: list[tuple[tuple[str, ...], str]] = [
    (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"), "input_layernorm.weight"),
    (("self_attention.linear_proj.weight",), "self_attn.o_proj.weight"),
    (("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), "post_attention_layernorm.weight"),
]
# --qk-layernorm: RMSNorm over one head (shared by all heads), before RoPE; same names in both specs
QK_NORM_MAP: list[tuple[tuple[str, ...], str]] = [
    (("self_attention.q_layernorm.weight",), "self_attn.q_norm.weight"),
    (("self_attention.k_layernorm.weight",), "self_attn.k_norm.weight"),
]
LAYER_MAP: list[tuple[tuple[str, ...], str]] = [*ATTENTION_MAP, (("mlp.linear_fc2.weight",), "mlp.down_proj.weight")]
_QKV_HF = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_FC1_HF = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
# transformers' non-persistent buffers that some older files still carry
_IGNORED_HF = ("rotary_emb.inv_freq",)

_REFUSED_FLAGS = (
    ("add_bias_linear", "linear-layer biases (--add-bias-linear; Llama has none)"),
    (
        "add_qkv_bias",
        "QKV biases (--add-qkv-bias): Qwen2ForCausalLM would hold them, but no fixture verifies "
        "Megatron's convention for them",
    ),
    ("rotary_interleaved", "interleaved RoPE (--rotary-interleaved; HF Llama rotates halves)"),
    ("use_rope_scaling", "RoPE frequency scaling (--use-rope-scaling)"),
    ("rotary_seq_len_interpolation_factor", "RoPE sequence-length interpolation"),
    ("apply_layernorm_1p", "zero-centered norm weights (--apply-layernorm-1p)"),
    ("layernorm_zero_centered_gamma", "zero-centered norm weights"),
    ("apply_residual_connection_post_layernorm", "post-norm residuals"),
    ("qk_layernorm", "query/key normalization (--qk-layernorm)"),
    ("qk_l2_norm", "L2-normalised queries and keys (--qk-l2-norm)"),
    ("multi_latent_attention", "multi-latent attention (MLA)"),
    ("num_experts", "mixture of experts (--num-experts)"),
    ("mtp_num_layers", "multi-token prediction layers"),
    ("window_size", "sliding-window attention (--window-size)"),
    ("no_rope_freq", "layers without RoPE (--no-rope-freq)"),
    ("squared_relu", "squared ReLU activation"),
    ("quick_geglu", "quick GeGLU activation"),
    ("attention_output_gate", "gated attention output"),
    ("heterogeneous_layers_config_path", "heterogeneous layers"),
    ("experimental_attention_variant", "an experimental attention variant"),
    ("activation_func_clamp_value", "a clamped activation"),
)


@dataclass(frozen=True)
class MlpMapping:
    """How one layer's MLP maps between Megatron and Hugging Face (the rest of the layer is Llama's).

    Attributes:
        to_hf: ``(params, megatron prefix, where) -> ({HF name inside the layer: tensor}, Megatron names used)``.
        hf_names: ``(args) -> HF names inside a layer`` the MLP needs.
        from_hf: ``(hf, HF layer prefix, args) -> {Megatron name inside the layer: tensor}``, in GPTModel's order.
    """

    to_hf: Callable[[dict[str, torch.Tensor], str, str], tuple[dict[str, torch.Tensor], set[str]]]
    hf_names: Callable[[dict[str, Any]], list[str]]
    from_hf: Callable[[dict[str, torch.Tensor], str, dict[str, Any]], dict[str, torch.Tensor]]


def _dense_to_hf(params: dict[str, torch.Tensor], prefix: str, where: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    gate, up = torch.chunk(_need(params, prefix + FC1, where), 2, dim=0)
    fc2 = prefix + "mlp.linear_fc2.weight"
    tensors = dict(zip((*_FC1_HF, "mlp.down_proj.weight"), (gate, up, _need(params, fc2, where))))
    return tensors, {prefix + FC1, fc2}


def _dense_from_hf(hf: dict[str, torch.Tensor], src: str, args: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {FC1: torch.cat([hf[src + n] for n in _FC1_HF]), "mlp.linear_fc2.weight": hf[src + "mlp.down_proj.weight"]}


DENSE_MLP = MlpMapping(
    to_hf=_dense_to_hf, hf_names=lambda args: [*_FC1_HF, "mlp.down_proj.weight"], from_hf=_dense_from_hf
)


def _arg(args: dict[str, Any], name: str, default: Any = None) -> Any:
    value = args.get(name, default)
    return default if value is None else value


def heads_and_groups(args: dict[str, Any]) -> tuple[int, int]:
    """``(num_attention_heads, query groups)``; the groups equal the heads without ``--group-query-attention``."""
    heads = int(_arg(args, "num_attention_heads", 0))
    groups = int(_arg(args, "num_query_groups", heads)) if _arg(args, "group_query_attention", False) else heads
    return heads, groups


def looks_like_llama(args: dict[str, Any]) -> bool:
    """Whether the args name any Llama feature (RoPE, RMSNorm, SwiGLU): the family to explain refusals for."""
    return (
        _arg(args, "position_embedding_type", "") == "rope"
        or _arg(args, "normalization", "") == "RMSNorm"
        or bool(_arg(args, "swiglu", False))
    )


def llama_problems(args: dict[str, Any]) -> list[str]:
    """What in Megatron ``args`` ``LlamaForCausalLM`` cannot hold exactly, one phrase each (empty: Llama)."""
    problems = []
    position = _arg(args, "position_embedding_type", "learned_absolute")
    if position != "rope":
        problems.append(f"position embeddings {position!r} (Llama uses RoPE)")
    elif float(_arg(args, "rotary_percent", 1.0)) < 1.0:
        problems.append(f"partial rotary embeddings (rotary_percent {args['rotary_percent']} < 1)")
    if _arg(args, "normalization", "LayerNorm") != "RMSNorm":
        problems.append(f"normalization {_arg(args, 'normalization', 'LayerNorm')!r} (Llama uses RMSNorm)")
    if not _arg(args, "swiglu", False):
        problems.append("a non-gated MLP (Llama's MLP is SwiGLU: --swiglu)")
    problems += [what for flag, what in _REFUSED_FLAGS if _arg(args, flag, False)]
    if _arg(args, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax type {args['softmax_type']!r}")
    heads, groups = heads_and_groups(args)
    if heads <= 0 or groups <= 0 or heads % groups:
        problems.append(f"{heads} attention heads in {groups} query groups")
    return problems


def _head_dim(args: dict[str, Any]) -> int:
    heads, _ = heads_and_groups(args)
    return int(_arg(args, "kv_channels", int(args["hidden_size"]) // heads))


def llama_config(
    args: dict[str, Any], params: dict[str, torch.Tensor], vocab: int, layers: int, dtype: torch.dtype
) -> dict[str, Any]:
    """``config.json`` of the ``LlamaForCausalLM`` equal to a Megatron model (``args`` already checked)."""
    heads, groups = heads_and_groups(args)
    theta = float(_arg(args, "rotary_base", 10000))
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": int(args["hidden_size"]),
        "intermediate_size": int(params[f"decoder.layers.0.{FC1}"].shape[0]) // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": _head_dim(args),
        "hidden_act": "silu",
        "max_position_embeddings": int(_arg(args, "max_position_embeddings", _arg(args, "seq_length", 0))),
        "rms_norm_eps": float(_arg(args, "layernorm_epsilon", _arg(args, "norm_epsilon", 1e-5))),
        "rope_theta": theta,  # transformers 4; transformers 5 reads rope_parameters
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": not _arg(args, "untie_embeddings_and_output_weights", False),
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": float(_arg(args, "attention_dropout", 0.0)),
        "initializer_range": float(_arg(args, "init_method_std", 0.02)),
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def _one_of(params: dict[str, torch.Tensor], prefix: str, candidates: tuple[str, ...], where: str) -> str:
    for candidate in candidates:
        if prefix + candidate in params:
            return prefix + candidate
    raise CheckpointError(f"{where} has no {prefix + candidates[0]}, which a Llama model needs")


def to_llama_state_dict(
    args: dict[str, Any],
    params: dict[str, torch.Tensor],
    vocab: int,
    layers: int,
    where: str,
    *,
    mlp: MlpMapping = DENSE_MLP,
    model: str = "a Llama model",
) -> dict[str, torch.Tensor]:
    """The ``LlamaForCausalLM`` state dict of Megatron ``params`` (global names, ``args`` already checked).

    ``mlp`` maps each layer's MLP (Llama's dense SwiGLU by default); ``model`` names the
    target in errors. With ``qk_layernorm`` in the args the q/k norms are mapped too
    (:data:`QK_NORM_MAP`; only a family that admits them gets here with it set).

    Raises:
        CheckpointError: a tensor Llama needs is missing, or one it has no place for is present (named).
    """
    heads, groups = heads_and_groups(args)
    out = {"model.embed_tokens.weight": _need(params, WORD_EMBEDDINGS, where)[:vocab]}
    used = {WORD_EMBEDDINGS, OUTPUT_LAYER}  # a tied output layer is the embedding itself
    if _arg(args, "untie_embeddings_and_output_weights", False):
        out["lm_head.weight"] = _need(params, OUTPUT_LAYER, where)[:vocab]
    out["model.norm.weight"] = _need(params, FINAL_NORM, where)
    used.add(FINAL_NORM)
    attention = ATTENTION_MAP + (QK_NORM_MAP if _arg(args, "qk_layernorm", False) else [])
    for i in range(layers):
        prefix, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        for candidates, hf_name in attention:
            name = _one_of(params, prefix, candidates, where)
            out[hf + hf_name] = params[name]
            used.add(name)
        q, k, v = qkv_to_separate(prefix + QKV, _need(params, prefix + QKV, where), heads, groups)
        out.update(zip((hf + n for n in _QKV_HF), (q, k, v)))
        used.add(prefix + QKV)
        mlp_tensors, mlp_used = mlp.to_hf(params, prefix, where)
        out.update((hf + n, t) for n, t in mlp_tensors.items())
        used |= mlp_used
    unused = sorted(set(params) - used)
    if unused:
        raise CheckpointError(
            f"{where} holds tensors {model} has no place for: {unused[:5]}"
            + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        )
    return out


def _need(params: dict[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    if name not in params:
        raise CheckpointError(f"{where} has no {name}, which a Llama model needs; is this a megatron-core GPTModel?")
    return params[name]


def _rope_theta(config: dict[str, Any], where: str) -> float:
    """``rope_theta`` of a default (unscaled) RoPE; any scaling is refused naming its type."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if kind not in (None, "default"):
        raise CheckpointError(
            f"{where}: RoPE scaling {kind!r} has no exact Megatron-LM equivalent verified here; only default RoPE "
            "is converted"
        )
    theta = (rope if isinstance(rope, dict) else {}).get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta)


def megatron_args_from_llama(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The model-defining Megatron-LM args (JSON form) of a ``LlamaForCausalLM`` ``config.json``.

    Raises:
        CheckpointError: a feature this mapping does not hold exactly (biases, scaled RoPE,
            another activation, ...), each named.
    """
    problems = [
        what
        for key, bad, what in (
            ("attention_bias", True, "attention biases (attention_bias; Qwen2-style QKV biases are not verified)"),
            ("mlp_bias", True, "MLP biases (mlp_bias)"),
        )
        if config.get(key) == bad
    ]
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"activation {config['hidden_act']!r} (Megatron's --swiglu is SiLU-gated)")
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    if heads % groups:
        problems.append(f"{heads} attention heads over {groups} key/value heads")
    if problems:
        raise CheckpointError(f"{where}: this Llama model cannot be converted exactly: " + "; ".join(problems))
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    positions = int(config.get("max_position_embeddings", 2048))
    return {
        "num_layers": int(config["num_hidden_layers"]),
        "hidden_size": hidden,
        "ffn_hidden_size": int(config["intermediate_size"]),
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "num_query_groups": groups,
        "kv_channels": head_dim,
        "seq_length": positions,
        "max_position_embeddings": positions,
        "position_embedding_type": "rope",
        "use_rotary_position_embeddings": False,
        "rotary_base": _rope_theta(config, where),
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "rotary_seq_len_interpolation_factor": None,
        "use_rope_scaling": False,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "swiglu": True,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "attention_dropout": float(config.get("attention_dropout", 0.0)),
        "hidden_dropout": 0.0,
        "init_method_std": float(config.get("initializer_range", 0.02)),
        "apply_query_key_layer_scaling": False,
        "qk_layernorm": False,
    }


def from_llama_state_dict(
    hf: dict[str, torch.Tensor], args: dict[str, Any], where: str, *, mlp: MlpMapping = DENSE_MLP
) -> dict[str, torch.Tensor]:
    """Megatron global tensors (legacy names, unpadded vocabulary) of a ``LlamaForCausalLM`` state dict.

    ``mlp`` maps each layer's MLP (Llama's dense SwiGLU by default); ``q_norm`` / ``k_norm``
    are read when the args say ``qk_layernorm``.

    Raises:
        MissingKeysError: a tensor Llama has is missing, or one it has no place for is present.
    """
    heads, groups = heads_and_groups(args)
    qk_norm = QK_NORM_MAP if _arg(args, "qk_layernorm", False) else []
    tied = not args["untie_embeddings_and_output_weights"]
    hf = {k: v for k, v in hf.items() if not k.endswith(_IGNORED_HF)}
    if tied:
        hf.pop("lm_head.weight", None)  # some files keep the tied copy
    wanted = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    for i in range(int(args["num_layers"])):
        names = [n for _, n in ATTENTION_MAP + qk_norm] + list(_QKV_HF) + mlp.hf_names(args)
        wanted += [f"model.layers.{i}.{n}" for n in names]
    missing, unexpected = [k for k in wanted if k not in hf], sorted(set(hf) - set(wanted))
    if missing or unexpected:
        raise MissingKeysError(where, missing, unexpected)
    out = {WORD_EMBEDDINGS: hf["model.embed_tokens.weight"]}
    for i in range(int(args["num_layers"])):  # each layer in GPTModel's order
        prefix, src = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[prefix + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[prefix + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        q, k, v = (hf[src + n] for n in _QKV_HF)
        out[prefix + QKV] = separate_to_qkv(q, k, v, heads, groups)
        out.update((prefix + names[0], hf[src + n]) for names, n in qk_norm)  # SelfAttention builds them after QKV
        out[prefix + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out.update((prefix + n, t) for n, t in mlp.from_hf(hf, src, args).items())
    out[FINAL_NORM] = hf["model.norm.weight"]
    if not tied:
        out[OUTPUT_LAYER] = hf["lm_head.weight"]
    return out


def check_head_dim(args: dict[str, Any], params: dict[str, torch.Tensor], where: str) -> None:
    """The QKV rows must be ``(heads + 2 * groups) * head_dim``: a mismatch means the args do not fit the weights."""
    heads, groups = heads_and_groups(args)
    rows = params[f"decoder.layers.0.{QKV}"].shape[0]
    if rows != (heads + 2 * groups) * _head_dim(args):
        raise CheckpointError(
            f"{where}: {QKV} of layer 0 has {rows} rows, not (heads {heads} + 2 x groups {groups}) x head_dim "
            f"{_head_dim(args)}; the args do not describe these weights"
        )
