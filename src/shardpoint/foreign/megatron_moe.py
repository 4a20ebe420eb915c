"""Megatron-LM mixture-of-experts layers in ``torch_dist`` checkpoints: names, order and limits.

What megatron-core 0.16.1 writes for a MoE ``GPTModel`` (``--num-experts``, ``SequentialMLP``
experts; checked against ``tests/fixtures/megatron-moe``, written by Megatron-LM's own
``save_checkpoint``):

* experts are stacked over layers *and global experts*:
  ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is ``[layers, experts, ...]``;
  after the layer unstacking, :func:`split_experts` gives each global expert ``g`` its
  GPTModel name ``decoder.layers.<l>.mlp.experts.local_experts.<g>.linear_fc1.weight``
  (on ep rank ``r`` that was local expert ``g - r * E / ep``; at ep=1 local = global);
* the router (``mlp.router.weight``) and the shared experts (``mlp.shared_experts.*``) are
  dense parameters; ``mlp.router.expert_bias`` (``--moe-router-enable-expert-bias``) is a
  persistent *buffer*: no optimizer state, in no optimizer group (:func:`is_buffer`);
* GPTModel registers, inside a MoE layer, after ``pre_mlp_layernorm``: the router, the
  experts by local index (``linear_fc1`` before ``linear_fc2``), the shared experts
  (:func:`moe_rank`), which fixes where each lies in the distributed optimizer's buckets;
* with expert parallelism (ep > 1) the experts have their own grad buffer and their own
  distributed optimizer: the optimizer is a ``ChainedOptimizer`` whose keys carry
  ``chained_0.`` (dense) and ``chained_1.`` (experts, ``dp_group_idx_<ep rank>``).
  With ep=1 the experts are ordinary parameters of the one optimizer (no prefix).

Legacy ``torch`` checkpoints (``megatron/training/checkpointing.py``, ``get_checkpoint_name``)
with ep > 1 have one folder per expert-parallel rank, ``mp_rank_TT[_PPP]_EEE`` (``_PPP`` only
with pp > 1): each holds the dense weights (the same in every ep folder) and its ``E / ep``
experts under *local* ids (:func:`to_local_expert`), written by expert-data-parallel rank 0.
The optimizer is the ``ChainedOptimizer`` of a dense and an expert optimizer
(:func:`regroup_for_ep`): ``model_optim_rng.pt``'s ``optimizer`` is the list of their two
state dicts and ``distrib_optim.pt`` the list of their two gathered buffers, the dense one
``None`` outside ep rank 0 (only dense data-parallel rank 0, which is ep rank 0, saves it).

Grouped-GEMM experts (``--moe-grouped-gemm``, :func:`expert_module`): the legacy
``GroupedMLP`` (``--transformer-impl local``, or ``--moe-use-legacy-grouped-gemm``) holds
per layer one ``weight1`` ``[hidden, E_local * 2F]`` and one ``weight2`` ``[E_local * F,
hidden]``; its forward views them as ``[E_local, hidden, 2F]`` / ``[E_local, F, hidden]``,
so local expert ``i``'s ``linear_fc1`` is ``weight1.view(E_local, hidden, 2F)[i].T``.
Its ``sharded_state_dict`` writes exactly those transposes under SequentialMLP's
``torch_dist`` keys (same names, shapes and values; only the DCP chunks differ), so the
weights read as above. Its distributed-optimizer buckets are not SequentialMLP's: each
layer's experts are the two params ``weight1``, ``weight2`` (in that registration order,
where SequentialMLP's experts are), each flattened in its own memory order;
:func:`group_experts` builds that view from the per-expert tensors and
:func:`ungroup_experts` takes the moments back (checked bit-exact against Megatron's own
``--moe-grouped-gemm`` checkpoint at ep=2, ``moe-torchdist-ep2-grouped-distopt``).

Refused, each named (:func:`refuse_moe`): Transformer Engine's ``TEGroupedMLP`` (no
checkpoint of it to derive its layout from), the legacy ``GroupedMLP`` in the legacy
``torch`` format (``weight1``/``weight2`` under their own names), MoE
layers mixed with dense ones (``--moe-layer-freq``), latent MoE; and for the optimizer's
buckets, expert tensor parallelism other than tp at etp > 1 (whose split of the experts over
the tensor-parallel ranks is not derived here). Derived, each checked against a checkpoint of
Megatron-LM's own: etp = tp = 2 at ep=1 (the experts split like a dense MLP in the one
optimizer) and at ep=2, etp=1 at tp=2 (the experts whole on each tp rank), and ep=2 with pp=2
(the expert optimizer's ``dp_group_idx_<etp_rank + etp * (ep_rank + ep * pp_rank)>``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from shardpoint.errors import CheckpointError, CorruptCheckpointError

__all__ = [
    "expert_id",
    "expert_module",
    "expert_parallel",
    "expert_tensor_parallel",
    "group_experts",
    "is_buffer",
    "is_expert",
    "moe_rank",
    "num_experts",
    "refuse_moe",
    "regroup_for_ep",
    "split_experts",
    "to_local_expert",
    "ungroup_experts",
]

_STACKED = re.compile(r"^(.*\.mlp\.experts\.)experts\.(linear_fc[12]\.(?:weight|bias))$")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_ROUTER = ("mlp.router.weight", "mlp.router.bias", "mlp.router.expert_bias")
_EXPERT_PARTS = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
_SHARED = (*(f"mlp.shared_experts.{p}" for p in _EXPERT_PARTS), "mlp.shared_experts.gate_weight")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_BUFFERS = ("mlp.router.expert_bias",)
_GROUPABLE = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_WEIGHTS = (("linear_fc1", "weight1"), ("linear_fc2", "weight2"))


def num_experts(args: Any) -> int:
    """The number of routed experts per MoE layer in Megatron's args; 0 for a dense model."""
    return int(getattr(args, "num_experts", None) or 0)


def expert_parallel(args: Any) -> int:
    """The expert-parallel size the checkpoint was saved at (1 without experts)."""
    return int(getattr(args, "expert_model_parallel_size", 1) or 1) if num_experts(args) else 1


def expert_tensor_parallel(args: Any) -> int:
    """The expert tensor-parallel size the checkpoint was saved at (Megatron's default: tp)."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    return int(getattr(args, "expert_tensor_parallel_size", None) or tp)


def expert_module(args: Any) -> str:
    """The experts megatron-core 0.16.1 builds from these args: ``SequentialMLP``, ``GroupedMLP`` or ``TEGroupedMLP``.

    ``--moe-grouped-gemm`` gives the legacy ``GroupedMLP`` with the local spec
    (``LocalSpecProvider.grouped_mlp_modules``) or with ``--moe-use-legacy-grouped-gemm``, and
    ``TEGroupedMLP`` with the Transformer Engine spec (Megatron's default ``transformer_impl``).
    """
    if not num_experts(args) or not getattr(args, "moe_grouped_gemm", False):
        return "SequentialMLP"
    local = getattr(args, "transformer_impl", "transformer_engine") == "local"
    return "GroupedMLP" if local or getattr(args, "moe_use_legacy_grouped_gemm", False) else "TEGroupedMLP"


def group_experts(
    names: list[str], local: dict[str, torch.Tensor]
) -> tuple[list[str], dict[str, torch.Tensor], dict[str, list[str]]]:
    """One rank's buffer params as ``GroupedMLP`` holds them, from the per-expert (SequentialMLP) tensors.

    Each layer's routed experts ``...mlp.experts.local_experts.<g>.linear_fc{1,2}.weight`` (this
    rank's pieces, in buffer order) become ``...mlp.experts.weight1`` and ``...weight2`` at the place of
    the first of them: ``torch.stack([piece.T for each expert by id])``, i.e. ``[E_local, hidden, 2F_t]``
    and ``[E_local, F_t, hidden]``, the memory of GroupedMLP's ``weight1`` ``[hidden, E_local*2F_t]``
    and ``weight2`` ``[E_local*F_t, hidden]`` (its forward's ``view``s).

    Returns:
        The names in buffer order, their tensors, and per grouped name the expert names it holds.
    """
    out_names: list[str] = []
    out_local = dict(local)
    members: dict[str, list[str]] = {}
    for name in names:
        match = _GROUPABLE.match(name)
        if match is None:
            out_names.append(name)
            continue
        head = match.group(1)
        if head + "weight1" in members:
            continue
        for part, grouped in _GROUPED_WEIGHTS:
            held = sorted(
                (n for n in names if (m := _GROUPABLE.match(n)) and m.group(1) == head and m.group(3) == part),
                key=expert_id,
            )
            members[head + grouped] = held
            out_local[head + grouped] = torch.stack([local[n].t() for n in held])
            out_names.append(head + grouped)
    for held in members.values():
        for name in held:
            out_local.pop(name)
    return out_names, out_local, members


def ungroup_experts(
    moments: dict[str, dict[str, torch.Tensor]], members: Mapping[str, list[str]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Inverse of :func:`group_experts` on the decoded slices: each expert's own ``[out, in]`` tensors."""
    for grouped, held in members.items():
        entry = moments.pop(grouped)
        for i, name in enumerate(held):
            moments[name] = {k: v[i].t().contiguous() for k, v in entry.items()}
    return moments


def is_expert(name: str) -> bool:
    """Whether ``name`` is a routed expert's parameter (``...mlp.experts.local_experts.<g>...``)."""
    return _EXPERT.search(name) is not None


def expert_id(name: str) -> int:
    """The global expert id in an expert parameter's name."""
    match = _EXPERT.search(name)
    if match is None:
        raise ValueError(f"{name} is not a routed expert's parameter")
    return int(match.group(1))


def to_local_expert(name: str, first: int) -> str:
    """``name`` with its expert id lowered by ``first`` (global to local on an ep rank; negative: back)."""
    if not first:
        return name
    return _EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) - first}.", name, count=1)


def regroup_for_ep(groups: list[dict[str, Any]], ep: int) -> list[dict[str, Any]]:
    """Optimizer groups as megatron-core 0.16.1 builds them at expert-parallel size ``ep``.

    At ep > 1 the experts are ``is_expert_parallel`` parameters (``allreduce=False``) of the
    expert optimizer: each group's experts move to an expert group of the same
    hyperparameters; at ep = 1 they are ordinary parameters, back in the dense group of the
    same hyperparameters. The result lists the dense groups, then the expert groups, each
    with ``is_expert_parallel`` set (its ``param_names`` are not sorted: the writer orders
    them as the model).
    """
    merged: dict[tuple[bool, str], dict[str, Any]] = {}
    for group in groups:
        hyper = {k: v for k, v in group.items() if k not in ("param_names", "is_expert_parallel")}
        members = list(group.get("param_names", []))
        parts = {False: [n for n in members if ep == 1 or not is_expert(n)]}
        parts[True] = [n for n in members if ep > 1 and is_expert(n)]
        for flag, names in parts.items():
            if not names and (flag or group.get("is_expert_parallel")):
                continue
            slot = merged.setdefault((flag, repr(sorted(hyper.items()))), hyper | {"is_expert_parallel": flag})
            slot["param_names"] = slot.get("param_names", []) + names
    return [g for (flag, _), g in merged.items() if not flag] + [g for (flag, _), g in merged.items() if flag]


def is_buffer(name: str) -> bool:
    """Whether ``name`` is a persistent buffer of a MoE layer (the router's ``expert_bias``): no optimizer state."""
    return name.endswith(_BUFFERS)


def moe_rank(rest: str) -> tuple[int, int, int] | None:
    """Registration order of a MoE layer's tensor (name inside its layer), or None when it is not one.

    ``(0, 0, i)`` router, ``(1, expert, i)`` routed experts, ``(2, 0, i)`` shared experts.
    """
    if rest in _ROUTER:
        return (0, 0, _ROUTER.index(rest))
    match = _LOCAL_EXPERT.match(rest)
    if match and match.group(2) in _EXPERT_PARTS:
        return (1, int(match.group(1)), _EXPERT_PARTS.index(match.group(2)))
    if rest in _SHARED:
        return (2, 0, _SHARED.index(rest))
    return None


def split_experts(pairs: list[tuple[str, torch.Tensor]], experts: int, where: str) -> list[tuple[str, torch.Tensor]]:
    """``...mlp.experts.experts.<p>`` ``[E, ...]`` (one layer's stacked experts) as ``...local_experts.<g>.<p>``.

    Other names pass unchanged.

    Raises:
        CorruptCheckpointError: the stacked tensor's first dim is not the args' ``num_experts``.
    """
    result = []
    for name, tensor in pairs:
        match = _STACKED.match(name)
        if match is None:
            result.append((name, tensor))
            continue
        if tensor.dim() == 0 or tensor.shape[0] != experts:
            raise CorruptCheckpointError(
                f"{where}: {name} should stack num_experts={experts} experts in its first dim, "
                f"has shape {tuple(tensor.shape)}; the args and the weights disagree"
            )
        head, tail = match.groups()
        result += [(f"{head}local_experts.{g}.{tail}", tensor[g].clone()) for g in range(experts)]
    return result


def refuse_moe(where: str, args: Any, *, buckets: bool, hint: str = "", grouped: bool = False) -> None:
    """Raise naming the MoE features this reader does not decode; nothing for a dense model.

    Args:
        buckets: also refuse what the distributed optimizer's bucket layout is not derived for.
        hint: appended to the message (how to import less).
        grouped: the caller reads the legacy ``GroupedMLP`` (``torch_dist``, where its weights are
            SequentialMLP's, and its buckets; or the export, which writes SequentialMLP).
    """
    if not num_experts(args):
        return
    problems = []
    module = expert_module(args)
    if module == "TEGroupedMLP":
        problems.append(
            "Transformer Engine grouped-GEMM experts (--moe-grouped-gemm with transformer_impl "
            f"{getattr(args, 'transformer_impl', 'transformer_engine')!r}: TEGroupedMLP, whose layout is not derived; "
            "the legacy GroupedMLP of --transformer-impl local or --moe-use-legacy-grouped-gemm is read "
            "from torch_dist)"
        )
    elif module == "GroupedMLP" and not grouped:
        problems.append(
            "grouped-GEMM experts in this format (--moe-grouped-gemm: GroupedMLP's weight1/weight2; "
            "its torch_dist checkpoints are read)"
        )
    freq = getattr(args, "moe_layer_freq", 1)
    if not (freq == 1 or (isinstance(freq, (list, tuple)) and all(f == 1 for f in freq))):
        problems.append(f"MoE layers mixed with dense layers (--moe-layer-freq {freq!r})")
    if getattr(args, "moe_latent_size", None):
        problems.append("latent MoE (--moe-latent-size)")
    if problems:
        raise CheckpointError(f"{where}: mixture-of-experts checkpoints with {'; '.join(problems)} are not supported")
    if not buckets:
        return
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    etp = expert_tensor_parallel(args)
    if etp > 1 and etp != tp:
        problems.append(f"expert tensor parallelism other than tp (--expert-tensor-parallel-size {etp}, tp={tp})")
    if problems:
        raise CheckpointError(
            f"{where}: the distributed optimizer's bucket layout is not derived for mixture of experts with "
            f"{'; '.join(problems)}{hint}"
        )
