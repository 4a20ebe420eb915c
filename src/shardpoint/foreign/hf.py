"""A Megatron-LM GPT as a Hugging Face ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MixtralForCausalLM`` or
``Qwen3MoeForCausalLM`` directory.

:func:`model_family` picks the family the source's args describe exactly: GPT-2-like
(below), Llama-like (:mod:`.llama`: RoPE, SwiGLU, RMSNorm, grouped-query attention) or,
for a mixture of experts, Mixtral-like (:mod:`.mixtral`: a Llama with softmax top-k
routed SwiGLU experts) or, with per-head query/key norms (``--qk-layernorm``), Qwen3-MoE-like
(:mod:`.qwen3_moe`); a model that is none of them is refused naming what each family
lacks.

Only GPT-2-like Megatron models map onto GPT-2 exactly: learned absolute position
embeddings, LayerNorm, a plain (not gated) GeLU MLP, multi-head attention with
``kv_channels = hidden / heads``, pre-LayerNorm residuals. :func:`check_gpt2_like`
reads the source's args and refuses anything else, naming every feature GPT-2 has no
place for (SwiGLU, RoPE, RMSNorm, grouped-query attention, MoE, ...): a model that
cannot be expressed is an error, never an approximation.

The mapping (:func:`to_gpt2_state_dict`), from the global tensors of a
:class:`~shardpoint.foreign.ForeignCheckpoint` (TP pieces already concatenated, layer
numbers global):

* ``embedding.word_embeddings.weight`` -> ``transformer.wte.weight`` and, when
  untied, ``output_layer.weight`` -> ``lm_head.weight``: rows past the real
  vocabulary (Megatron pads to ``make_vocab_size_divisible_by * tp``) are dropped;
* ``embedding.position_embeddings.weight`` -> ``transformer.wpe.weight``;
* per layer ``input_layernorm`` (or Transformer Engine's fused
  ``self_attention.linear_qkv.layer_norm_*``) -> ``ln_1``, ``pre_mlp_layernorm`` (or
  ``mlp.linear_fc1.layer_norm_*``) -> ``ln_2``, ``decoder.final_layernorm`` -> ``ln_f``;
* ``self_attention.linear_qkv``: Megatron's rows are interleaved per query group
  (``[q heads of group g, k_g, v_g]``); GPT-2's ``c_attn`` is ``[Q; K; V]``, so rows
  are regrouped (:func:`~shardpoint.foreign.structure.qkv_to_separate`);
* ``linear_qkv``, ``linear_proj``, ``mlp.linear_fc1``, ``mlp.linear_fc2`` ->
  ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``: GPT-2's ``Conv1D``
  stores ``[in, out]``, so weights are transposed; biases absent from the source
  (``--disable-bias-linear``) are written as zeros, which is what the model computed.

The activation: Megatron's ``F.gelu`` is the exact (erf) GeLU, GPT-2's ``"gelu"``;
``--openai-gelu`` and the fused bias-GeLU kernel (``--bias-gelu-fusion``, Megatron's
default) compute the tanh approximation, GPT-2's ``"gelu_new"``.

:func:`export_hf` writes ``config.json`` and ``model.safetensors`` (sharded with an
index past ``max_shard_size``; :mod:`.hf_files`) that ``from_pretrained`` loads.

The way back (``convert --from hf``, :mod:`.hf_import`): :func:`megatron_args_from_gpt2`
and :func:`from_gpt2_state_dict` invert the GPT-2 mapping exactly.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch

from shardpoint.errors import CheckpointError, MissingKeysError
from shardpoint.foreign import llama, mixtral, qwen3_moe
from shardpoint.foreign._types import ForeignCheckpoint
from shardpoint.foreign.hf_files import write_hf_dir
from shardpoint.foreign.structure import qkv_to_separate, separate_to_qkv

__all__ = [
    "HF_CONFIG",
    "HF_WEIGHTS",
    "activation",
    "check_gpt2_like",
    "export_hf",
    "from_gpt2_state_dict",
    "hf_config",
    "megatron_args_from_gpt2",
    "model_family",
    "to_gpt2_state_dict",
]

log = logging.getLogger(__name__)

HF_WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")

# HF name inside a block -> Megatron names inside a layer (first found wins), is a Linear weight to transpose
_LAYER_MAP: list[tuple[str, tuple[str, ...], bool]] = [
    ("ln_1.weight", ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"), False),
    ("ln_1.bias", ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"), False),
    ("attn.c_attn.weight", ("self_attention.linear_qkv.weight",), True),
    ("attn.c_attn.bias", ("self_attention.linear_qkv.bias",), False),
    ("attn.c_proj.weight", ("self_attention.linear_proj.weight",), True),
    ("attn.c_proj.bias", ("self_attention.linear_proj.bias",), False),
    ("ln_2.weight", ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), False),
    ("ln_2.bias", ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"), False),
    ("mlp.c_fc.weight", ("mlp.linear_fc1.weight",), True),
    ("mlp.c_fc.bias", ("mlp.linear_fc1.bias",), False),
    ("mlp.c_proj.weight", ("mlp.linear_fc2.weight",), True),
    ("mlp.c_proj.bias", ("mlp.linear_fc2.bias",), False),
]
# biases a Megatron model may lack (--disable-bias-linear, no --add-qkv-bias): zero is what it computed
_OPTIONAL_BIAS = {"attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias"}
_TOP_MAP = [
    ("transformer.wpe.weight", "embedding.position_embeddings.weight"),
    ("transformer.ln_f.weight", "decoder.final_layernorm.weight"),
    ("transformer.ln_f.bias", "decoder.final_layernorm.bias"),
]
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"


def _arg(args: dict[str, Any], name: str, default: Any = None) -> Any:
    value = args.get(name, default)
    return default if value is None else value


_heads_and_groups = llama.heads_and_groups


def _unsupported(args: dict[str, Any]) -> list[str]:
    """What in ``args`` GPT-2 cannot express, one phrase each (empty: GPT-2-like)."""
    problems = []
    position = _arg(args, "position_embedding_type", "learned_absolute")
    if position != "learned_absolute" or _arg(args, "use_rotary_position_embeddings", False):
        problems.append(f"position embeddings {position!r} (GPT-2 learns absolute positions)")
    elif not _arg(args, "add_position_embedding", True):
        problems.append("no position embeddings (--no-position-embedding)")
    if _arg(args, "normalization", "LayerNorm") != "LayerNorm":
        problems.append(f"normalization {args['normalization']!r} (GPT-2 uses LayerNorm)")
    for flag, what in (
        ("swiglu", "gated MLP (--swiglu)"),
        ("quick_geglu", "gated MLP (--quick-geglu)"),
        ("squared_relu", "squared ReLU activation (--squared-relu)"),
        ("use_te_activation_func", "Transformer Engine activation functions (--use-te-activation-func)"),
        ("layernorm_zero_centered_gamma", "zero-centered LayerNorm gamma (--apply-layernorm-1p)"),
        ("apply_layernorm_1p", "zero-centered LayerNorm gamma (--apply-layernorm-1p)"),
        ("apply_residual_connection_post_layernorm", "post-LayerNorm residuals"),
        ("qk_layernorm", "query/key LayerNorm (--qk-layernorm)"),
        ("multi_latent_attention", "multi-latent attention"),
        ("attention_output_gate", "gated attention output"),
        ("num_experts", "mixture of experts (--num-experts)"),
        ("mtp_num_layers", "multi-token prediction layers"),
        ("window_size", "sliding-window attention (--window-size)"),
        ("heterogeneous_layers_config_path", "heterogeneous layers"),
        ("experimental_attention_variant", "an experimental attention variant"),
        ("activation_func_clamp_value", "a clamped activation"),
    ):
        if _arg(args, flag, False):
            problems.append(what)
    if _arg(args, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax type {args['softmax_type']!r}")
    heads, groups = _heads_and_groups(args)
    hidden = int(_arg(args, "hidden_size", 0))
    if groups != heads:
        problems.append(f"grouped-query attention ({groups} query groups for {heads} heads)")
    if heads <= 0 or hidden % heads:
        problems.append(f"hidden_size {hidden} not divisible into num_attention_heads {heads}")
    elif _arg(args, "kv_channels", hidden // heads) != hidden // heads:
        problems.append(f"kv_channels {args['kv_channels']} != hidden_size / num_attention_heads ({hidden // heads})")
    return problems


def _check_source(ckpt: ForeignCheckpoint) -> None:
    if ckpt.tool != "megatron":
        raise CheckpointError(
            f"{ckpt.path} is a {ckpt.tool} checkpoint; --to hf maps Megatron-LM GPT models (megatron-core names) only"
        )
    if not ckpt.args:
        raise CheckpointError(f"{ckpt.path} records no Megatron args; the model's shape and features are unknown")


def model_family(ckpt: ForeignCheckpoint) -> str:
    """``"gpt2"``, ``"llama"``, ``"mixtral"`` or ``"qwen3_moe"``: the HF family holding Megatron GPT ``ckpt`` exactly.

    A mixture of experts is Qwen3-MoE's with ``--qk-layernorm``, Mixtral's without.

    Raises:
        CheckpointError: not a Megatron checkpoint, args missing, or no family fits;
            the message names every feature that does not fit, the closer family first
            (for a mixture of experts: what Mixtral, or with q/k norms Qwen3-MoE, lacks).
    """
    _check_source(ckpt)
    gpt2, llama_like = _unsupported(ckpt.args), llama.llama_problems(ckpt.args)
    experts = _arg(ckpt.args, "num_experts", 0)
    if experts:
        qwen3 = bool(_arg(ckpt.args, "qk_layernorm", False))
        family, name, architecture = (
            ("qwen3_moe", "Qwen3-MoE", qwen3_moe.ARCHITECTURE)
            if qwen3
            else ("mixtral", "Mixtral", mixtral.ARCHITECTURE)
        )
        moe = qwen3_moe.qwen3_moe_problems(ckpt.args) if qwen3 else mixtral.mixtral_problems(ckpt.args)
        if not any(n.endswith(".mlp.router.weight") for n in ckpt.params):
            moe.append(f"no router in the weights, although the args say num_experts={experts}")
        if not moe:
            return family
        parts = [f"not {name}-like ({architecture}): " + "; ".join(moe)]
        parts.append("not Llama-like (LlamaForCausalLM): " + "; ".join(llama_like))
    elif not gpt2:
        return "gpt2"
    elif not llama_like:
        return "llama"
    else:
        parts = [
            "not GPT-2-like (GPT2LMHeadModel): " + "; ".join(gpt2),
            "not Llama-like (LlamaForCausalLM): " + "; ".join(llama_like),
        ]
        if llama.looks_like_llama(ckpt.args):
            parts.reverse()
    raise CheckpointError(
        f"{ckpt.path}: this Megatron model is " + ", and ".join(parts) + ". Export it with --to safetensors "
        "instead (Megatron's own names) or convert it with a tool for that architecture"
    )


def check_gpt2_like(ckpt: ForeignCheckpoint) -> None:
    """Raise unless ``ckpt`` is a Megatron GPT that GPT-2 expresses exactly.

    Raises:
        CheckpointError: not a Megatron checkpoint, args missing, or (all named at once)
            the model features GPT-2 has no equivalent for.
    """
    _check_source(ckpt)
    problems = _unsupported(ckpt.args)
    if problems:
        raise CheckpointError(
            f"{ckpt.path}: this Megatron model is not GPT-2-like, so GPT2LMHeadModel cannot hold it exactly: "
            + "; ".join(problems)
            + ". Export it with --to safetensors instead (Megatron's own names) or convert it with a tool for that "
            "architecture"
        )


def activation(args: dict[str, Any]) -> str:
    """GPT-2's ``activation_function`` for Megatron's GeLU: erf ``"gelu"``, or tanh ``"gelu_new"``."""
    fused = _arg(args, "bias_gelu_fusion", False) and _arg(args, "add_bias_linear", True)
    return "gelu_new" if _arg(args, "openai_gelu", False) or fused else "gelu"


def _vocab(ckpt: ForeignCheckpoint, vocab_size: int | None) -> int:
    rows = ckpt.params[WORD_EMBEDDINGS].shape[0] if WORD_EMBEDDINGS in ckpt.params else 0
    vocab = vocab_size if vocab_size is not None else ckpt.args.get("vocab_size")
    if vocab is None:
        raise CheckpointError(
            f"{ckpt.path}: the args record no vocab_size (the tokenizer set it), so the {rows} embedding rows "
            "cannot be told from Megatron's padding; pass the tokenizer's vocabulary size (--vocab-size)"
        )
    if not 0 < int(vocab) <= rows:
        raise CheckpointError(f"{ckpt.path}: vocabulary size {vocab} does not fit the {rows} rows of {WORD_EMBEDDINGS}")
    return int(vocab)


def _num_layers(ckpt: ForeignCheckpoint) -> int:
    layers = sorted({int(m.group(1)) for n in ckpt.params if (m := _LAYER.match(n))})
    if layers != list(range(len(layers))) or not layers:
        raise CheckpointError(f"{ckpt.path}: transformer layers {layers} are not numbered 0..N-1")
    expected = ckpt.args.get("num_layers")
    if expected is not None and int(expected) != len(layers):
        raise CheckpointError(f"{ckpt.path}: the args say num_layers={expected} but the weights hold {len(layers)}")
    return len(layers)


def hf_config(
    ckpt: ForeignCheckpoint, vocab_size: int | None = None, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """``config.json`` of the ``GPT2LMHeadModel`` equal to Megatron GPT ``ckpt`` (checked GPT-2-like first)."""
    check_gpt2_like(ckpt)
    args = ckpt.args
    hidden = int(args["hidden_size"])
    positions = ckpt.params.get("embedding.position_embeddings.weight")
    n_positions = int(positions.shape[0]) if positions is not None else int(_arg(args, "max_position_embeddings", 0))
    fc1 = ckpt.params.get("decoder.layers.0.mlp.linear_fc1.weight")
    dtype = dtype or ckpt.params[WORD_EMBEDDINGS].dtype
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": _vocab(ckpt, vocab_size),
        "n_positions": n_positions,
        "n_ctx": n_positions,
        "n_embd": hidden,
        "n_layer": _num_layers(ckpt),
        "n_head": int(args["num_attention_heads"]),
        "n_inner": int(fc1.shape[0]) if fc1 is not None else _arg(args, "ffn_hidden_size"),
        "activation_function": activation(args),
        "resid_pdrop": float(_arg(args, "hidden_dropout", 0.1)),
        "embd_pdrop": float(_arg(args, "hidden_dropout", 0.1)),
        "attn_pdrop": float(_arg(args, "attention_dropout", 0.1)),
        "layer_norm_epsilon": float(_arg(args, "layernorm_epsilon", 1e-5)),
        "initializer_range": float(_arg(args, "init_method_std", 0.02)),
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": not _arg(args, "untie_embeddings_and_output_weights", False),
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def to_gpt2_state_dict(
    ckpt: ForeignCheckpoint, vocab_size: int | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The ``GPT2LMHeadModel`` state dict of Megatron GPT ``ckpt`` (contiguous; ``dtype`` or as saved).

    Raises:
        CheckpointError: the model is not GPT-2-like, a tensor GPT-2 needs is missing
            (named), or the checkpoint holds tensors GPT-2 has no place for (named).
    """
    check_gpt2_like(ckpt)
    params, where = ckpt.params, ckpt.path
    vocab = _vocab(ckpt, vocab_size)
    heads, groups = _heads_and_groups(ckpt.args)
    used = {WORD_EMBEDDINGS}
    out = {"transformer.wte.weight": params[WORD_EMBEDDINGS][:vocab]}
    tied = not _arg(ckpt.args, "untie_embeddings_and_output_weights", False)
    if not tied:
        out["lm_head.weight"] = _need(params, OUTPUT_LAYER, where)[:vocab]
    used.add(OUTPUT_LAYER)  # with tied embeddings a copy is the embedding itself
    for hf, ours in _TOP_MAP:
        out[hf] = _need(params, ours, where)
        used.add(ours)
    for i in range(_num_layers(ckpt)):
        prefix = f"decoder.layers.{i}."
        for hf, candidates, linear in _LAYER_MAP:
            name = next((prefix + c for c in candidates if prefix + c in params), None)
            if name is None:
                if hf not in _OPTIONAL_BIAS:
                    _need(params, prefix + candidates[0], where)
                continue
            used.add(name)
            t = params[name]
            if "linear_qkv" in name and "layer_norm" not in name:
                t = torch.cat(qkv_to_separate(name, t, heads, groups))
            out[f"transformer.h.{i}.{hf}"] = t.t() if linear else t
        _zero_biases(out, i)
    unused = sorted(set(params) - used)
    if unused:
        raise CheckpointError(
            f"{where} holds tensors a GPT-2 model has no place for: {unused[:5]}"
            + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            + "; this is not a plain Megatron GPT"
        )
    return {k: (v.to(dtype) if dtype is not None else v).detach().contiguous().clone() for k, v in out.items()}


def _need(params: dict[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    if name not in params:
        raise CheckpointError(f"{where} has no {name}, which a GPT-2 model needs; is this a megatron-core GPTModel?")
    return params[name]


def _zero_biases(out: dict[str, torch.Tensor], i: int) -> None:
    """Zero biases for the linear layers a ``--disable-bias-linear`` model has without them."""
    block = f"transformer.h.{i}."
    for bias in sorted(_OPTIONAL_BIAS):
        if block + bias not in out:
            weight = out[block + bias.replace(".bias", ".weight")]
            out[block + bias] = weight.new_zeros(weight.shape[1])


_LLAMA_LIKE = {
    "llama": (llama.to_llama_state_dict, llama.llama_config),
    "mixtral": (mixtral.to_mixtral_state_dict, mixtral.mixtral_config),
    "qwen3_moe": (qwen3_moe.to_qwen3_moe_state_dict, qwen3_moe.qwen3_moe_config),
}


def export_hf(
    ckpt: ForeignCheckpoint,
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    vocab_size: int | None = None,
    max_shard_size: int | str = "5GB",
) -> str:
    """Write ``config.json`` and the safetensors weights of Megatron GPT ``ckpt``; return ``out_dir``.

    A GPT-2-like model becomes ``GPT2LMHeadModel``, a Llama-like one ``LlamaForCausalLM``,
    a Mixtral-like mixture of experts ``MixtralForCausalLM``, one with q/k norms
    ``Qwen3MoeForCausalLM`` (:func:`model_family`).

    Args:
        ckpt: from :func:`~shardpoint.foreign.read_foreign` or
            :func:`~shardpoint.foreign.exporter.from_shardpoint` (an imported checkpoint).
        out_dir: a local directory, created if needed; files of the same names are replaced.
        dtype: cast the weights (default: as saved).
        vocab_size: the real vocabulary size, when the args do not record it.
        max_shard_size: weights past this size are split into shards with an index.

    Raises:
        CheckpointError: neither family holds the model (every unsupported feature named),
            or tensors are missing or left over (named).

    Example:
        >>> export_hf(read_foreign("/data/megatron/llama-run"), "hf-llama")
        >>> transformers.AutoModelForCausalLM.from_pretrained("hf-llama")
    """
    family = model_family(ckpt)
    if family == "gpt2":
        config, tensors = hf_config(ckpt, vocab_size, dtype), to_gpt2_state_dict(ckpt, vocab_size, dtype)
    else:
        vocab, layers = _vocab(ckpt, vocab_size), _num_layers(ckpt)
        llama.check_head_dim(ckpt.args, ckpt.params, ckpt.path)
        to_state_dict, to_config = _LLAMA_LIKE[family]
        tensors = to_state_dict(ckpt.args, ckpt.params, vocab, layers, ckpt.path)
        tensors = {
            k: (v.to(dtype) if dtype is not None else v).detach().contiguous().clone() for k, v in tensors.items()
        }
        config = to_config(ckpt.args, ckpt.params, vocab, layers, dtype or ckpt.params[WORD_EMBEDDINGS].dtype)
    out = os.path.abspath(os.fspath(out_dir))
    files = write_hf_dir(out, config, tensors, max_shard_size)
    rows = ckpt.params[WORD_EMBEDDINGS].shape[0]
    log.info(
        "exported %s (iteration %d) to %s: %s, %d weight file(s), vocabulary %d (%d padding rows dropped)",
        ckpt.path,
        ckpt.iteration,
        out,
        config["architectures"][0],
        sum(1 for f in files if f.endswith(".safetensors")),
        config["vocab_size"],
        rows - config["vocab_size"],
    )
    return out


# ------------------------------------------------------------------ Hugging Face GPT-2 -> Megatron


def megatron_args_from_gpt2(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The model-defining Megatron-LM args (JSON form) of a ``GPT2LMHeadModel`` ``config.json``.

    Raises:
        CheckpointError: what Megatron's GPT computes differently, each named.
    """
    act = config.get("activation_function", "gelu_new")
    problems = []
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation {act!r} (Megatron computes erf or tanh GeLU)")
    for key, what in (
        ("scale_attn_by_inverse_layer_idx", "attention scaled by the inverse layer index"),
        ("reorder_and_upcast_attn", "reordered, upcast attention"),
        ("add_cross_attention", "cross-attention"),
    ):
        if config.get(key):
            problems.append(what)
    if config.get("scale_attn_weights", True) is False:
        problems.append("unscaled attention (scale_attn_weights false)")
    if problems:
        raise CheckpointError(f"{where}: this GPT-2 model cannot be converted exactly: " + "; ".join(problems))
    hidden, heads = int(config.get("n_embd", 768)), int(config.get("n_head", 12))
    positions = int(config.get("n_positions", 1024))
    return {
        "num_layers": int(config.get("n_layer", 12)),
        "hidden_size": hidden,
        "ffn_hidden_size": int(config.get("n_inner") or 4 * hidden),
        "num_attention_heads": heads,
        "group_query_attention": False,
        "num_query_groups": None,
        "kv_channels": hidden // heads,
        "seq_length": positions,
        "max_position_embeddings": positions,
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "layernorm_epsilon": float(config.get("layer_norm_epsilon", 1e-5)),
        "swiglu": False,
        "add_bias_linear": True,
        "add_qkv_bias": False,
        "openai_gelu": act != "gelu",
        "bias_gelu_fusion": False,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
        "attention_dropout": float(config.get("attn_pdrop", 0.1)),
        "hidden_dropout": float(config.get("resid_pdrop", 0.1)),
        "init_method_std": float(config.get("initializer_range", 0.02)),
        "apply_query_key_layer_scaling": False,
    }


def from_gpt2_state_dict(hf: dict[str, torch.Tensor], args: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """Megatron global tensors (legacy names, unpadded vocabulary) of a ``GPT2LMHeadModel`` state dict.

    The inverse of :func:`to_gpt2_state_dict`: ``Conv1D`` weights transposed back,
    ``c_attn``'s ``[Q; K; V]`` rows regrouped per head.

    Raises:
        MissingKeysError: GPT-2 tensors missing, or tensors GPT-2 has no place for.
    """
    hf = {(k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): v for k, v in hf.items()}
    hf = {k: v for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # causal-mask buffers
    tied = not args["untie_embeddings_and_output_weights"]
    if tied:
        hf.pop("lm_head.weight", None)
    heads, layers = int(args["num_attention_heads"]), int(args["num_layers"])
    wanted = ["transformer.wte.weight"] + [hf_key for hf_key, _ in _TOP_MAP] + ([] if tied else ["lm_head.weight"])
    wanted += [f"transformer.h.{i}.{hf_name}" for i in range(layers) for hf_name, _, _ in _LAYER_MAP]
    missing, unexpected = [k for k in wanted if k not in hf], sorted(set(hf) - set(wanted))
    if missing or unexpected:
        raise MissingKeysError(where, missing, unexpected)
    out = {WORD_EMBEDDINGS: hf["transformer.wte.weight"]}
    out |= {ours: hf[hf_key] for hf_key, ours in _TOP_MAP}
    for i in range(layers):
        for hf_name, candidates, is_linear in _LAYER_MAP:
            t = hf[f"transformer.h.{i}.{hf_name}"]
            t = t.t() if is_linear else t
            if hf_name.startswith("attn.c_attn."):
                q, k, v = torch.chunk(t, 3, dim=0)
                t = separate_to_qkv(q, k, v, heads, heads)
            out[f"decoder.layers.{i}.{candidates[0]}"] = t.contiguous()
    if not tied:
        out[OUTPUT_LAYER] = hf["lm_head.weight"]
    return out
