"""Megatron-LM mixture-of-experts GPTs and Hugging Face ``MixtralForCausalLM``, both ways.

A Mixtral is a Llama (:mod:`.llama`: attention, RoPE, norms, embeddings, read by the same
table) whose every MLP is a sparse MoE block; only that block is mapped here
(:data:`MOE_MLP`). Megatron's side is what :mod:`.megatron_moe` reads: routed experts under
their *global* ids. Checked against Megatron-LM's own forward pass in
``tests/fixtures/megatron-moe/moe-torchdist-ep2-mixtral`` (its MANIFEST's
``hf_logits_check``):

* ``mlp.router.weight`` ``[experts, hidden]`` is ``block_sparse_moe.gate.weight``;
* global expert ``g``'s ``linear_fc1`` is ``[gate; up]``: the gate is ``experts.<g>.w1``,
  up is ``w3``; ``linear_fc2`` is ``w2`` (the per-expert names ``save_pretrained`` writes and
  ``from_pretrained`` reads; transformers 5 fuses them in memory);
* the router: Megatron's default softmax score function without ``--moe-router-pre-softmax``
  takes the top-k *logits* and softmaxes them, which equals Mixtral's softmax over all
  experts, top-k, renormalised to sum 1; ``moe_router_topk`` is ``num_experts_per_tok``,
  ``moe_ffn_hidden_size`` is ``intermediate_size``.

What else can change the forward is refused, each named (:func:`mixtral_problems`):
sigmoid routers, expert bias, shared experts, pre-softmax, a top-k scaling factor,
group-limited routing, token dropping (a capacity factor), dense layers among MoE ones,
grouped-GEMM or latent experts, probabilities applied to the expert input, ... The
load-balancing loss (``aux_loss`` and its variants) only adds a training loss and is kept
as ``router_aux_loss_coef``.

Qwen3-MoE (:mod:`.qwen3_moe`) has the same MoE block under other names: :func:`moe_mlp` builds
the mapping for either naming, :func:`moe_base_config` and :func:`megatron_moe_args` are the
config and args both share.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from shardpoint.errors import CheckpointError
from shardpoint.foreign import llama

__all__ = [
    "ARCHITECTURE",
    "MOE_MLP",
    "from_mixtral_state_dict",
    "megatron_args_from_mixtral",
    "megatron_moe_args",
    "mixtral_config",
    "mixtral_problems",
    "moe_base_config",
    "moe_mlp",
    "to_mixtral_state_dict",
]

ARCHITECTURE = "MixtralForCausalLM"
ROUTER = "mlp.router.weight"
_EXPERT_FC = "mlp.experts.local_experts.{}.linear_fc{}.weight"
_LOCAL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")

# Megatron flag -> what Mixtral cannot compute (set and not false/None/0: refused)
_REFUSED_MOE_FLAGS = (
    ("moe_router_enable_expert_bias", "a router expert bias (--moe-router-enable-expert-bias)"),
    ("moe_shared_expert_intermediate_size", "shared experts (--moe-shared-expert-intermediate-size)"),
    ("moe_router_pre_softmax", "softmax before top-k (--moe-router-pre-softmax: top-k weights not renormalised)"),
    ("moe_router_topk_scaling_factor", "a top-k scaling factor (--moe-router-topk-scaling-factor)"),
    ("moe_router_num_groups", "group-limited routing (--moe-router-num-groups)"),
    ("moe_router_group_topk", "group-limited routing (--moe-router-group-topk)"),
    ("moe_expert_capacity_factor", "token dropping (--moe-expert-capacity-factor)"),
    ("moe_grouped_gemm", "grouped-GEMM experts (--moe-grouped-gemm)"),
    ("moe_use_legacy_grouped_gemm", "grouped-GEMM experts (--moe-use-legacy-grouped-gemm)"),
    ("moe_latent_size", "latent MoE (--moe-latent-size)"),
    ("moe_apply_probs_on_input", "router probabilities applied to the expert input (--moe-apply-probs-on-input)"),
    ("moe_router_force_load_balancing", "forced (random) routing (--moe-router-force-load-balancing)"),
    ("moe_input_jitter_eps", "router input jitter (--moe-input-jitter-eps; Megatron applies it in eval too)"),
)


def _arg(args: dict[str, Any], name: str, default: Any = None) -> Any:
    value = args.get(name, default)
    return default if value is None else value


def _balancing(args: dict[str, Any]) -> list[str]:
    kinds = _arg(args, "moe_router_load_balancing_type", "aux_loss")
    return list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]


def mixtral_problems(args: dict[str, Any], model: str = "Mixtral") -> list[str]:
    """What in Megatron ``args`` ``MixtralForCausalLM`` cannot hold exactly, one phrase each (empty: Mixtral).

    Everything :func:`.llama.llama_problems` names but the experts themselves, and the MoE
    features above. ``model`` names the family in the phrases (Qwen3-MoE shares the router).
    """
    if not _arg(args, "num_experts", 0):
        return ["no experts (a dense model: LlamaForCausalLM holds it)"]
    problems = llama.llama_problems(args | {"num_experts": None})
    score = _arg(args, "moe_router_score_function", "softmax")
    if score != "softmax":
        problems.append(f"a {score} router (--moe-router-score-function {score}; {model}'s router is a softmax)")
    problems += [what for flag, what in _REFUSED_MOE_FLAGS if _arg(args, flag, False)]
    if _arg(args, "moe_shared_expert_gate", False) and not _arg(args, "moe_shared_expert_intermediate_size", 0):
        problems.append("a shared-expert gate (--moe-shared-expert-gate)")
    if "sinkhorn" in _balancing(args):
        problems.append("Sinkhorn routing (--moe-router-load-balancing-type sinkhorn)")
    freq = _arg(args, "moe_layer_freq", 1)
    if not (freq == 1 or (isinstance(freq, (list, tuple)) and all(f == 1 for f in freq))):
        problems.append(f"dense layers among the MoE layers (--moe-layer-freq {freq!r})")
    if int(_arg(args, "moe_router_topk", 2)) > int(args["num_experts"]):
        problems.append(f"top-{args['moe_router_topk']} routing over {args['num_experts']} experts")
    return problems


def _experts(args: dict[str, Any]) -> int:
    return int(args["num_experts"])


def moe_mlp(gate: str, expert: str, weights: tuple[str, str, str], model: str) -> llama.MlpMapping:
    """The MoE block's mapping for one Hugging Face naming (Mixtral's or Qwen3-MoE's: same block, other names).

    Args:
        gate: the router's HF name inside a layer (``block_sparse_moe.gate.weight``).
        expert: the experts' HF name pattern, ``{}`` for the expert id then the weight.
        weights: the HF names of the gate, up and down projections (``w1``, ``w3``, ``w2``).
        model: the target, as errors name it (``"a Mixtral model"``).
    """
    w_gate, w_up, w_down = weights

    def need(params: dict[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
        if name not in params:
            raise CheckpointError(f"{where} has no {name}, which {model} needs; is this a megatron-core MoE GPT?")
        return params[name]

    def to_hf(params: dict[str, torch.Tensor], prefix: str, where: str) -> tuple[dict[str, torch.Tensor], set[str]]:
        """One layer's router and experts (``prefix``: ``decoder.layers.<l>.``) under the HF names."""
        found = (m for n in params if n.startswith(prefix) and (m := _LOCAL.match(n[len(prefix) :])))
        experts = sorted(int(m.group(1)) for m in found)
        count = experts[-1] + 1 if experts else 0
        out = {gate: need(params, prefix + ROUTER, where)}
        if out[gate].shape[0] != count:
            raise CheckpointError(
                f"{where}: {prefix + ROUTER} routes to {out[gate].shape[0]} experts, but the layer holds experts "
                f"{sorted(set(experts))}; {model} needs every expert 0..E-1 in every layer"
            )
        used = {prefix + ROUTER}
        for g in range(count):
            fc1, fc2 = (prefix + _EXPERT_FC.format(g, i) for i in (1, 2))
            up_gate, up = torch.chunk(need(params, fc1, where), 2, dim=0)
            out |= {expert.format(g, w_gate): up_gate, expert.format(g, w_up): up}
            out[expert.format(g, w_down)] = need(params, fc2, where)
            used |= {fc1, fc2}
        return out, used

    def hf_names(args: dict[str, Any]) -> list[str]:
        return [gate] + [expert.format(g, w) for g in range(_experts(args)) for w in (w_gate, w_down, w_up)]

    def from_hf(hf: dict[str, torch.Tensor], src: str, args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One layer's Megatron router and experts (GPTModel order: router, then each expert's fc1, fc2)."""
        out = {ROUTER: hf[src + gate]}
        for g in range(_experts(args)):
            out[_EXPERT_FC.format(g, 1)] = torch.cat([hf[src + expert.format(g, w)] for w in (w_gate, w_up)])
            out[_EXPERT_FC.format(g, 2)] = hf[src + expert.format(g, w_down)]
        return out

    return llama.MlpMapping(to_hf=to_hf, hf_names=hf_names, from_hf=from_hf)


MOE_MLP = moe_mlp(
    "block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.{}.weight", ("w1", "w3", "w2"), "a Mixtral model"
)


def to_mixtral_state_dict(
    args: dict[str, Any], params: dict[str, torch.Tensor], vocab: int, layers: int, where: str
) -> dict[str, torch.Tensor]:
    """The ``MixtralForCausalLM`` state dict (``save_pretrained``'s names) of Megatron ``params``.

    ``args`` already checked (:func:`mixtral_problems`); experts under global ids.

    Raises:
        CheckpointError: a tensor Mixtral needs is missing, a layer lacks experts, or a tensor
            Mixtral has no place for is present (named).
    """
    return llama.to_llama_state_dict(args, params, vocab, layers, where, mlp=MOE_MLP, model="a Mixtral model")


def moe_base_config(
    args: dict[str, Any], params: dict[str, torch.Tensor], vocab: int, layers: int, dtype: torch.dtype
) -> dict[str, Any]:
    """The Llama ``config.json`` a Megatron MoE model shares with Mixtral's and Qwen3-MoE's (``args`` checked).

    ``intermediate_size`` is the experts' (``moe_ffn_hidden_size``); ``num_experts_per_tok`` and
    ``router_aux_loss_coef`` are set; Llama's ``mlp_bias`` and ``pretraining_tp`` are gone.
    """
    config = llama.llama_config(args, params | {f"decoder.layers.0.{llama.FC1}": _fc1(params)}, vocab, layers, dtype)
    for key in ("mlp_bias", "pretraining_tp"):  # Llama's only
        config.pop(key)
    aux = _arg(args, "moe_aux_loss_coeff", 0.0)
    return config | {
        "num_experts_per_tok": int(_arg(args, "moe_router_topk", 2)),
        "router_aux_loss_coef": float(aux[0] if isinstance(aux, (list, tuple)) else aux),
        "output_router_logits": False,
    }


def mixtral_config(
    args: dict[str, Any], params: dict[str, torch.Tensor], vocab: int, layers: int, dtype: torch.dtype
) -> dict[str, Any]:
    """``config.json`` of the ``MixtralForCausalLM`` equal to a Megatron MoE model (``args`` already checked)."""
    config = moe_base_config(args, params, vocab, layers, dtype)
    config.pop("attention_bias")  # not MixtralConfig's
    return config | {
        "architectures": [ARCHITECTURE],
        "model_type": "mixtral",
        "num_local_experts": int(args["num_experts"]),
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def _fc1(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Expert 0's ``linear_fc1`` of layer 0: its rows give ``intermediate_size`` (``moe_ffn_hidden_size``) x 2."""
    name = "decoder.layers.0." + _EXPERT_FC.format(0, 1)
    if name not in params:
        raise CheckpointError(f"the checkpoint has no {name}; is this a megatron-core MoE GPT?")
    return params[name]


def megatron_args_from_mixtral(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The model-defining Megatron-LM args (JSON form) of a ``MixtralForCausalLM`` ``config.json``.

    Raises:
        CheckpointError: a feature this mapping does not hold exactly (sliding windows, router
            jitter, another activation, ...), each named.
    """
    problems = []
    if config.get("sliding_window") is not None:
        problems.append(f"sliding-window attention (sliding_window {config['sliding_window']})")
    if float(config.get("router_jitter_noise") or 0.0):
        problems.append("router jitter (router_jitter_noise; Megatron's --moe-input-jitter-eps is not verified equal)")
    if problems:
        raise CheckpointError(f"{where}: this Mixtral model cannot be converted exactly: " + "; ".join(problems))
    args = llama.megatron_args_from_llama(config, where)
    return args | megatron_moe_args(
        int(config["num_local_experts"]),
        int(config.get("num_experts_per_tok", 2)),
        int(config["intermediate_size"]),
        float(config.get("router_aux_loss_coef", 0.0)),
    )


def megatron_moe_args(experts: int, topk: int, ffn: int, aux_loss_coeff: float) -> dict[str, Any]:
    """Megatron's MoE args for the block Mixtral and Qwen3-MoE share: softmax top-k routing over
    ``experts`` SwiGLU experts of width ``ffn``, renormalised, nothing dropped or added."""
    return {
        "num_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": ffn,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": False,
        "moe_router_topk_scaling_factor": None,
        "moe_router_enable_expert_bias": False,
        "moe_shared_expert_intermediate_size": None,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": aux_loss_coeff,
        "moe_expert_capacity_factor": None,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_layer_freq": 1,
    }


def from_mixtral_state_dict(hf: dict[str, torch.Tensor], args: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """Megatron global tensors (legacy names, global expert ids) of a ``MixtralForCausalLM`` state dict.

    Raises:
        MissingKeysError: a tensor Mixtral has is missing, or one it has no place for is present.
    """
    return llama.from_llama_state_dict(hf, args, where, mlp=MOE_MLP)
