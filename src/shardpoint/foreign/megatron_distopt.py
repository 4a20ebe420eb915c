"""The distributed optimizer's state in megatron-core ``torch_dist`` checkpoints, per parameter.

With ``--use-distributed-optimizer`` each data-parallel rank owns a slice of its
model-parallel rank's *grad buffers*, and ``DistributedOptimizer.sharded_state_dict``
(``megatron/core/optimizer/distrib_optimizer.py``) stores that state in one of two
layouts, named by ``common.pt``'s ``optimizer.param_state_sharding_type``:

* ``dp_reshardable`` (Megatron's default): *bucket space*. One 1-D tensor per
  model-parallel rank ``j = tp_rank + tp * pp_rank``, grad buffer, dtype and bucket:
  ``optimizer.distributed.dp_group_idx_<j>.gbuf_idx_<g>.dtype_(<param>, <grad>).bucket_idx_<b>.<key>``
  with keys ``param`` (the fp32 main weight), ``exp_avg``, ``exp_avg_sq``. Its length
  is the bucket's unpadded size; the hyperparameters (with the step) are a pickled
  object ``optimizer.distributed.dp_group_idx_<j>.optimizer``.
* ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): *model space*.
  ``optimizer.state.<param|exp_avg|exp_avg_sq>.<model key>``, shaped and sharded like
  the weight, which the ``torch_dist`` reader unstacks like the weights; the
  hyperparameters sit in ``common.pt`` (``optimizer.optimizer.param_groups``).

Decoding bucket space means knowing where each parameter lies in a bucket. That is
derived, not guessed, from what the checkpoint records (``_ParamAndGradBuffer``'s
rule in ``megatron/core/distributed/param_and_grad_buffer.py``):

* which parameters each model-parallel rank holds: the args' tp, pp and layer count,
  and each weight's TP-local shape (``linear_fc1`` of a gated MLP is ``[gate_r; up_r]``);
* their order: megatron-core ``GPTModel``'s parameter order, *reversed* in the buffer;
  parameters are grouped into buffers by dtype (the ``dtype_(...)`` in the key);
* each parameter starts at a multiple of 64 elements from its bucket's start;
* where buckets end: each bucket tensor's length is its unpadded size, so a new
  bucket starts exactly when a parameter ends at that length (whatever the DDP bucket
  size was); ``per_bucket_numel_unpadded`` is checked against it.

Each derived slice of ``param`` is then compared with the model weight itself, so a
wrong derivation is an error naming the parameter, never silently shuffled moments.
The 64-element gaps are ``torch.empty`` memory in Megatron's files and are skipped.

Mixture of experts (:mod:`.megatron_moe`): with ep=1 the experts are parameters of the
one optimizer, in GPTModel order (split over tp like a dense MLP when etp = tp > 1, whole
when etp = 1). With ep > 1 megatron-core chains two distributed optimizers, keys prefixed
``chained_0.`` (the dense parameters, groups by model-parallel rank as above) and
``chained_1.`` (the experts: ``dp_group_idx_<j>``, ``j = etp_rank + etp * (ep_rank + ep *
pp_rank)``, the rank in megatron-core's ``expt_tp_pp_group``, holds ep rank ``r``'s experts
of stage ``p``'s layers, global ids ``r * E / ep ...``, their etp piece, in the same
reversed, 64-aligned order).

Refused, each named: virtual pipeline stages, uneven pipeline splits, the MoE layouts
:func:`~shardpoint.foreign.megatron_moe.refuse_moe` names, multi-token
prediction, fp8 parameters, Megatron FSDP, chained optimizers other than MoE's, and the
deprecated layouts (``fully_sharded_model_space``, ``dp_zero_gather_scatter``).
``--no-optimizer`` imports the weights of any of them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch

from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.foreign.megatron_moe import (
    expert_id,
    expert_module,
    expert_parallel,
    expert_tensor_parallel,
    group_experts,
    is_expert,
    moe_rank,
    num_experts,
    refuse_moe,
    ungroup_experts,
)
from shardpoint.foreign.structure import glu_from_tp, glu_to_tp, split_dim

__all__ = [
    "LAYOUTS",
    "MODEL_SPACE",
    "buffer_order",
    "decode_buckets",
    "is_optimizer_key",
    "settle_master",
    "sharding_type",
    "split_buckets",
]

log = logging.getLogger(__name__)

LAYOUTS = ("dp_reshardable", "fully_reshardable")
MODEL_SPACE = re.compile(r"optimizer\.state\.(exp_avg|exp_avg_sq|param)\.(.+)$")
# an optional ``chained_<i>.`` prefix: the i-th optimizer of a ChainedOptimizer (MoE with ep > 1)
_BUCKET = re.compile(
    r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((.+)\)"
    r"\.bucket_idx_(\d+)\.(\w+)$"
)
_OBJECT = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.(\w+)/")
_ALIGN = 64  # _pad_start_of_param_if_needed: 128-byte aligned starts
_NO_HINT = "; import with --no-optimizer to take the model weights only"

# GPTModel's parameter order inside one transformer layer (local and Transformer Engine specs):
# TransformerLayer builds input_layernorm, then self_attention (Attention builds linear_proj,
# SelfAttention then linear_qkv and the q/k norms), pre_mlp_layernorm, then the MLP.
_LAYER_ORDER = (
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias",
    "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
)
_MOE_SLOT = 2 * _LAYER_ORDER.index("pre_mlp_layernorm.bias") + 1
_FIRST_STAGE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_LAST_STAGE = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# args whose layouts the derivation does not cover, each with what it is
_UNSUPPORTED_ARGS = (
    ("virtual_pipeline_model_parallel_size", "virtual pipeline stages (one grad buffer per model chunk)"),
    ("num_layers_per_virtual_pipeline_stage", "virtual pipeline stages (one grad buffer per model chunk)"),
    ("decoder_first_pipeline_num_layers", "an uneven pipeline split (--decoder-first-pipeline-num-layers)"),
    ("decoder_last_pipeline_num_layers", "an uneven pipeline split (--decoder-last-pipeline-num-layers)"),
    ("pipeline_model_parallel_layout", "a custom pipeline layout (--pipeline-model-parallel-layout)"),
    ("account_for_embedding_in_pipeline_split", "an uneven pipeline split (embedding counted as a layer)"),
    ("account_for_loss_in_pipeline_split", "an uneven pipeline split (loss counted as a layer)"),
    ("mtp_num_layers", "multi-token prediction layers"),
    ("fp8_param_gather", "fp8 parameters (--fp8-param-gather)"),
    ("use_megatron_fsdp", "Megatron FSDP (its fsdp_dtensor layout)"),
    ("use_torch_fsdp2", "torch FSDP2"),
)


def is_optimizer_key(key: str) -> bool:
    """Whether a ``torch_dist`` key holds optimizer state (any layout)."""
    return key.startswith(("optimizer.", "chained_"))


def sharding_type(where: str, common: Mapping[str, Any], args: Any, keys: list[str]) -> str | None:
    """How the optimizer state is stored: None (a plain optimizer, or none saved) or one of :data:`LAYOUTS`.

    Raises:
        CheckpointError: a layout or key this reader does not decode, named.
    """
    found = [k for k in keys if is_optimizer_key(k)]
    chained = [k for k in found if k.startswith("chained_")]
    if chained and expert_parallel(args) == 1:
        raise CheckpointError(f"{where}: optimizer keys such as {chained[0]!r} belong to a chained optimizer{_NO_HINT}")
    if chained and len(chained) != len(found):
        stray = next(k for k in found if not k.startswith("chained_"))
        raise CorruptCheckpointError(f"{where}: {stray!r} has no chained_<i>. prefix beside {chained[0]!r}")
    if not getattr(args, "use_distributed_optimizer", False) or not found:
        return None
    declared = (common.get("optimizer") or {}).get("param_state_sharding_type")
    declared = declared or (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if chained and declared != "dp_reshardable":
        raise CheckpointError(
            f"{where}: mixture of experts with expert parallelism stores its chained optimizers as {declared!r}; "
            f"only dp_reshardable is decoded for them{_NO_HINT}"
        )
    if declared not in LAYOUTS:
        raise CheckpointError(
            f"{where}: the distributed optimizer's state is stored as {declared!r}; only {' and '.join(LAYOUTS)} "
            f"are decoded (resave with one of them){_NO_HINT}"
        )
    if declared == "fully_reshardable" and expert_module(args) == "GroupedMLP":
        raise CheckpointError(
            f"{where}: the legacy GroupedMLP experts (--moe-grouped-gemm) with the optimizer in model space "
            f"(fully_reshardable) are not decoded: no checkpoint of it to check its layout against{_NO_HINT}"
        )
    expected = _BUCKET if declared == "dp_reshardable" else MODEL_SPACE
    strays = [k for k in found if not expected.match(k) and not _OBJECT.match(k)]
    if strays:
        raise CheckpointError(f"{where}: optimizer key {strays[0]!r} is not part of the {declared} layout{_NO_HINT}")
    return declared


Buckets = dict[tuple[int, int, str, int], dict[str, torch.Tensor]]  # (group, gbuf, dtype, bucket) -> tensors


def split_buckets(state: dict[str, Any]) -> dict[int, Buckets]:
    """Remove the bucket-space tensors from ``state``, per chained optimizer (0 without a prefix).

    Returns ``{chain: {(group, gbuf, dtype, bucket): {key: tensor}}}``; empty without buckets.
    """
    buckets: dict[int, Buckets] = {}
    for key, match in [(k, m) for k in state if (m := _BUCKET.match(k))]:
        chain, group, gbuf, dtype, bucket, name = match.groups()
        place = (int(group), int(gbuf), dtype, int(bucket))
        buckets.setdefault(int(chain or 0), {}).setdefault(place, {})[name] = state.pop(key)
    return buckets


def _unwrap(value: Any) -> Any:
    """A ShardedObject's payload: torch_dist wraps it in a one-element list."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def group_objects(objects: Mapping[str, Any]) -> dict[int, dict[int, dict[str, Any]]]:
    """``{chain: {group: {"optimizer": ..., "per_bucket_numel_unpadded": ...}}}`` from the pickled objects."""
    result: dict[int, dict[int, dict[str, Any]]] = {}
    for key, value in objects.items():
        match = _OBJECT.match(key)
        if match:
            chain, group, name = match.groups()
            result.setdefault(int(chain or 0), {}).setdefault(int(group), {})[name] = _unwrap(value)
    return result


def _refuse_unsupported(where: str, args: Any) -> None:
    problems = sorted({what for arg, what in _UNSUPPORTED_ARGS if getattr(args, arg, None) not in (None, False)})
    if problems:
        raise CheckpointError(
            f"{where}: the distributed optimizer's bucket layout is not derived for {'; '.join(problems)}{_NO_HINT}"
        )
    refuse_moe(where, args, buckets=True, hint=_NO_HINT, grouped=True)


def buffer_order(names: list[str], where: str) -> list[str]:
    """``names`` in megatron-core GPTModel's parameter order (the grad buffer holds them reversed)."""

    def rank(name: str) -> tuple[int, ...]:
        match = _LAYER.match(name)
        if match and match.group(2) in _LAYER_ORDER:
            return (1, int(match.group(1)), 2 * _LAYER_ORDER.index(match.group(2)))
        in_moe = moe_rank(match.group(2)) if match else None
        if match and in_moe is not None:  # a MoE layer's router, experts, shared experts: after pre_mlp_layernorm
            return (1, int(match.group(1)), _MOE_SLOT, *in_moe)
        if name in _FIRST_STAGE:
            return (0, 0, _FIRST_STAGE.index(name))
        if name in _LAST_STAGE:
            return (2, 0, _LAST_STAGE.index(name))
        raise CheckpointError(
            f"{where}: {name} has no known place in megatron-core GPTModel's parameter order, so its slice of "
            f"the distributed optimizer's buckets cannot be derived{_NO_HINT}"
        )

    return sorted(names, key=rank)


def _stage_param(params: Mapping[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    """``name``'s tensor; a tied output layer's is the word embeddings'."""
    tensor = params.get(name, params.get("embedding.word_embeddings.weight"))
    if tensor is None:
        raise CorruptCheckpointError(f"{where}: the checkpoint holds neither {name} nor the word embeddings tied to it")
    return tensor


def _stage_names(params: Mapping[str, torch.Tensor], args: Any, pp: int, where: str) -> list[list[str]]:
    """Parameters held by each pipeline stage, in GPTModel order (a tied output copy on the last stage)."""
    layers = int(getattr(args, "num_layers", 0) or 0)
    if layers <= 0 or layers % pp:
        raise CheckpointError(f"{where}: num_layers={layers} in the args does not divide into pp={pp} stages")
    per_stage = layers // pp
    stages: list[list[str]] = [[] for _ in range(pp)]
    for name in params:
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= layers:
            raise CorruptCheckpointError(
                f"{where}: the checkpoint holds {name}, but its args say num_layers={layers}; the args and the "
                f"weights disagree{_NO_HINT}"
            )
        if match:
            stages[int(match.group(1)) // per_stage].append(name)
        elif name.startswith("embedding."):
            stages[0].append(name)
        else:
            stages[-1].append(name)
    tied = not getattr(args, "untie_embeddings_and_output_weights", True)
    if tied and pp > 1 and "output_layer.weight" not in params:
        stages[-1].append("output_layer.weight")  # the last stage's copy of the embedding, in its own bucket
    return [buffer_order(names, where) for names in stages]


def _tp_dim(name: str, etp: int) -> int | None:
    """The dim a parameter is split along over tp; routed experts are split over etp (whole at etp=1)."""
    if is_expert(name) and etp == 1:
        return None
    return split_dim(name)


def _local_piece(name: str, tensor: torch.Tensor, t: int, tp: int, swiglu: bool, etp: int) -> torch.Tensor:
    """Rank ``t``'s tensor-parallel piece of a global tensor, as that rank holds it (experts: at etp)."""
    dim = _tp_dim(name, etp)
    if dim is None or tp == 1 or tensor.dim() == 0:
        return tensor
    if swiglu and "linear_fc1" in name and dim == 0:
        return glu_to_tp(name, tensor, tp)[t]
    return torch.chunk(tensor, tp, dim=dim)[t]


def _bucket_offsets(where: str, order: list[str], numels: Mapping[str, int], sizes: list[int]) -> dict[str, tuple]:
    """Per parameter ``(bucket, start)``: reversed order, 64-aligned starts, a bucket closes at its recorded size."""
    result, bucket, position = {}, 0, 0
    for name in reversed(order):
        if bucket >= len(sizes):
            raise CorruptCheckpointError(f"{where}: {name} lies past the last of the {len(sizes)} recorded buckets")
        start = -(-position // _ALIGN) * _ALIGN
        end = start + numels[name]
        if end > sizes[bucket]:
            raise CorruptCheckpointError(
                f"{where}: {name} would end at element {end} of bucket {bucket}, which holds {sizes[bucket]}; "
                f"the parameters or their order differ from what this checkpoint was saved with{_NO_HINT}"
            )
        result[name] = (bucket, start)
        bucket, position = (bucket + 1, 0) if end == sizes[bucket] else (bucket, end)
    if bucket != len(sizes):
        raise CorruptCheckpointError(
            f"{where}: the parameters fill {bucket} of the {len(sizes)} recorded buckets; the layout cannot be derived"
        )
    return result


def _rank_moments(
    where: str,
    group: int,
    names: list[str],
    local: dict[str, torch.Tensor],
    buckets: dict[tuple[int, int, str, int], dict[str, torch.Tensor]],
    recorded: Any,
    grouped: bool = False,
) -> dict[str, dict[str, torch.Tensor]]:
    """Per local parameter of model-parallel group ``group``, its slices of ``param``/``exp_avg``/``exp_avg_sq``.

    ``grouped``: the experts are ``GroupedMLP``'s (:func:`~shardpoint.foreign.megatron_moe.group_experts`).
    """
    held: dict[str, list[str]] = {}
    if grouped:
        names, local, held = group_experts(names, local)
    gbufs = sorted({(g, dtype) for (j, g, dtype, _) in buckets if j == group})
    result: dict[str, dict[str, torch.Tensor]] = {}
    for gbuf, dtype in gbufs:
        label = f"{where} (dp_group_idx_{group}.gbuf_idx_{gbuf}, dtype ({dtype}))"
        param_dtype = dtype.split(",")[0].strip()
        members = [n for n in names if str(local[n].dtype) == param_dtype]
        tensors = _gbuf_buckets(label, buckets, (group, gbuf, dtype))
        sizes = [int(t["param"].numel()) for t in tensors]
        _check_recorded(label, recorded, gbuf, sizes)
        offsets = _bucket_offsets(label, members, {n: local[n].numel() for n in members}, sizes)
        for name in members:
            bucket, start = offsets[name]
            shape = local[name].shape
            entry = {k: v[start : start + shape.numel()].view(shape).clone() for k, v in tensors[bucket].items()}
            if not torch.equal(entry["param"].to(local[name].dtype), local[name]):
                raise CorruptCheckpointError(
                    f"{label}: the slice derived for {name} (bucket {bucket}, elements {start}..."
                    f"{start + shape.numel()}) is not that parameter's fp32 copy; the bucket layout of this "
                    f"checkpoint differs from megatron-core's rule as derived here{_NO_HINT}"
                )
            result[name] = entry
    missing = [n for n in names if n not in result]
    if missing:
        raise CorruptCheckpointError(f"{where}: no grad buffer of dp_group_idx_{group} holds {missing[:3]}")
    return ungroup_experts(result, held)


def _gbuf_buckets(label: str, buckets: Mapping[tuple, dict[str, torch.Tensor]], gbuf: tuple) -> list[dict]:
    """One grad buffer's buckets in order: indices 0..n-1 with no gap, each holding ``param``."""
    found = sorted(key[3] for key in buckets if key[:3] == gbuf)
    if found != list(range(len(found))):
        missing = sorted(set(range(found[-1] + 1)) - set(found))
        raise CorruptCheckpointError(
            f"{label}: bucket indices {found} have gaps (no bucket_idx_{missing[0]}); the checkpoint is incomplete"
        )
    keys = [(*gbuf, b) for b in found]
    tensors = [buckets[key] for key in keys]
    for b, entry in enumerate(tensors):
        if "param" not in entry:
            raise CorruptCheckpointError(f"{label}: bucket_idx_{b} has {sorted(entry)} but no param; it is incomplete")
    return tensors


def _check_recorded(label: str, recorded: Any, gbuf: int, sizes: list[int]) -> None:
    """``per_bucket_numel_unpadded`` (when saved) must equal the bucket tensors' lengths."""
    if not isinstance(recorded, list) or gbuf >= len(recorded) or not isinstance(recorded[gbuf], dict):
        return
    values = next(iter(recorded[gbuf].values()), None)
    if values is not None and [int(v) for v in values] != sizes:
        raise CorruptCheckpointError(
            f"{label}: per_bucket_numel_unpadded records {values} but the bucket tensors hold {sizes} elements"
        )


def _merge(name: str, key: str, pieces: list[torch.Tensor], swiglu: bool, etp: int) -> torch.Tensor:
    """Tensor-parallel pieces of one state of ``name`` joined as its global tensor."""
    dim = _tp_dim(name, etp)
    if len(pieces) == 1 or dim is None or pieces[0].dim() == 0:
        for i, piece in enumerate(pieces[1:], 1):
            if not torch.equal(piece, pieces[0]):
                raise CorruptCheckpointError(
                    f"{name} ({key}): replicated on every tensor-parallel rank, but rank {i} differs"
                )
        return pieces[0]
    if swiglu and "linear_fc1" in name:
        return glu_from_tp(pieces)
    return torch.cat(pieces, dim=dim)


def decode_buckets(
    where: str,
    args: Any,
    params: Mapping[str, torch.Tensor],
    buckets: Mapping[int, Buckets],
    objects: Mapping[str, Any],
) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """Per parameter (global name) its ``param``/``exp_avg``/``exp_avg_sq``, and the optimizer's param groups.

    Args:
        where: the iteration directory, for messages.
        args: the checkpoint's Megatron args (``common.pt``).
        params: the model's global parameters under legacy names (layers unstacked, experts
            split per global id); no buffers.
        buckets: from :func:`split_buckets`.
        objects: the pickled objects read from the DCP files (hyperparameters, bucket sizes).

    Returns:
        The moments, and the param groups of each chained optimizer in turn (dense, then experts).

    Raises:
        CheckpointError: a feature whose layout is not derived (named).
        CorruptCheckpointError: the buckets do not match the parameters (the first mismatch named).
    """
    _refuse_unsupported(where, args)
    extras = group_objects(objects)
    ep = expert_parallel(args)
    experts = {n: t for n, t in params.items() if ep > 1 and is_expert(n)}
    chains = [0, 1] if experts else [0]
    if sorted(buckets) != chains:
        found = ", ".join(f"chained_{c}" for c in sorted(buckets)) or "none"
        raise CorruptCheckpointError(
            f"{where}: the distributed optimizer's buckets belong to optimizers [{found}], but "
            + (f"ep={ep} needs chained_0 (dense) and chained_1 (experts)" if experts else "one optimizer was expected")
        )
    dense = {n: t for n, t in params.items() if n not in experts}
    moments = _decode_dense(where, args, dense, buckets[0], extras.get(0, {}))
    hyper = list((extras.get(0, {}).get(0, {}).get("optimizer") or {}).get("param_groups") or [])
    if experts:
        moments |= _decode_experts(where, args, experts, buckets[1], extras.get(1, {}))
        hyper += list((extras.get(1, {}).get(0, {}).get("optimizer") or {}).get("param_groups") or [])
    return moments, hyper


def _decode_dense(
    where: str, args: Any, params: Mapping[str, torch.Tensor], buckets: Buckets, extras: Mapping[int, Any]
) -> dict[str, dict[str, torch.Tensor]]:
    """The moments of the parameters in the model-parallel ranks' buffers (one optimizer group per rank)."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    swiglu = bool(getattr(args, "swiglu", False))
    etp = expert_tensor_parallel(args)  # ep = 1 here, or the experts are not in these buffers
    groups = sorted({key[0] for key in buckets})
    if groups != list(range(tp * pp)):
        raise CorruptCheckpointError(
            f"{where}: distributed-optimizer groups {groups}, but tp={tp} x pp={pp} needs one per model-parallel rank"
        )
    stages = _stage_names(params, args, pp, where)
    per_rank = {}
    grouped = expert_module(args) == "GroupedMLP"
    for group in groups:
        t, p = group % tp, group // tp
        source = {n: _stage_param(params, n, where) for n in stages[p]}
        local = {n: _local_piece(n, tensor, t, tp, swiglu, etp) for n, tensor in source.items()}
        recorded = extras.get(group, {}).get("per_bucket_numel_unpadded")
        per_rank[(t, p)] = _rank_moments(where, group, stages[p], local, buckets, recorded, grouped)
    moments = {}
    for p, names in enumerate(stages):
        for name in (n for n in names if n in params):
            pieces = [per_rank[(t, p)][name] for t in range(tp)]
            moments[name] = {k: _merge(name, k, [pc[k] for pc in pieces], swiglu, etp) for k in pieces[0]}
    log.debug("%s: decoded %d buckets of %d model-parallel ranks", where, len(buckets), len(groups))
    return moments


def _decode_experts(
    where: str, args: Any, experts: Mapping[str, torch.Tensor], buckets: Buckets, extras: Mapping[int, Any]
) -> dict[str, dict[str, torch.Tensor]]:
    """The experts' moments from the expert optimizer (``chained_1``), one group per expert model-parallel rank.

    megatron-core numbers the expert optimizer's groups by the rank in the expert
    tensor/expert/pipeline group (``expt_tp_pp_group``, built from the ``tp-ep-pp`` ranks of
    the expert rank generator: etp fastest, then ep, then pp): ``dp_group_idx_<j>`` with
    ``j = etp_rank + etp * (ep_rank + ep * pp_rank)`` holds the experts ``r * E/ep ...`` of
    ep rank ``r`` in the layers of pipeline stage ``p``, in the same reversed, 64-aligned
    order; at etp > 1 (= tp, else refused by :func:`refuse_moe`) each holds its etp piece of
    those experts (``linear_fc1`` as ``[gate_t; up_t]``, ``linear_fc2`` split along dim 1).
    Checked against Megatron's own checkpoints at ep=2 with pp=2, and with tp=etp=2.
    """
    ep, total = expert_parallel(args), num_experts(args)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    etp = expert_tensor_parallel(args)
    swiglu = bool(getattr(args, "swiglu", False))
    if total % ep:
        raise CorruptCheckpointError(f"{where}: num_experts={total} does not divide by ep={ep} in the args")
    groups = sorted({key[0] for key in buckets})
    if groups != list(range(etp * ep * pp)):
        raise CorruptCheckpointError(
            f"{where}: the expert optimizer (chained_1) has groups {groups}, but etp={etp} x ep={ep} x pp={pp} "
            "needs one per expert model-parallel rank"
        )
    per_rank = total // ep
    stages = _stage_names(experts, args, pp, where)
    pieces: dict[str, list[dict[str, torch.Tensor]]] = {}
    grouped = expert_module(args) == "GroupedMLP"
    for j in groups:
        t, r, p = j % etp, (j // etp) % ep, j // (etp * ep)
        # a stage's list may end with the tied output copy (pp > 1, Megatron's default): not an expert
        names = [n for n in stages[p] if n in experts and expert_id(n) // per_rank == r]
        local = {n: _local_piece(n, experts[n], t, etp, swiglu, etp) for n in names}
        recorded = extras.get(j, {}).get("per_bucket_numel_unpadded")
        label = f"{where} (expert optimizer chained_1, ep rank {r}, pipeline stage {p}, expert tp rank {t})"
        for name, entry in _rank_moments(label, j, names, local, buckets, recorded, grouped).items():
            pieces.setdefault(name, []).append(entry)
    moments = {
        name: {k: _merge(name, k, [pc[k] for pc in parts], swiglu, etp) for k in parts[0]}
        for name, parts in pieces.items()
    }
    log.debug("%s: decoded the experts of %d expert model-parallel ranks", where, len(groups))
    return moments


def settle_master(name: str, entry: dict[str, torch.Tensor], weight: torch.Tensor, where: str) -> None:
    """The optimizer's fp32 ``param``: dropped when it is the weight itself, else kept as ``master_param``."""
    master = entry.pop("param", None)
    if master is None:
        return
    if master.dtype == weight.dtype:
        if not torch.equal(master, weight):
            log.warning("%s: the distributed optimizer's fp32 copy of %s differs from the model weight", where, name)
        return
    entry["master_param"] = master
