"""Stacked experts in memory, one tensor per expert on disk: transformers' mixture-of-experts layout, both ways.

transformers 5 keeps a mixture-of-experts layer's experts as two stacked parameters,
``experts.gate_up_proj`` ``[E, 2F, H]`` (each expert's gate rows, then its up rows) and
``experts.down_proj`` ``[E, H, F]``, but ``save_pretrained`` writes, and Hub checkpoints
hold, one tensor per expert and projection, under one of two naming schemes
(transformers' own ``conversion_mapping``, which :func:`expert_scheme` consults):

* Mixtral (and MiniMax): ``block_sparse_moe.experts.<e>.w1`` (gate), ``w3`` (up), ``w2``
  (down) and the router ``block_sparse_moe.gate``;
* Qwen2/3-MoE, DeepSeek, OLMoE and the others: ``mlp.experts.<e>.gate_proj``,
  ``up_proj``, ``down_proj``.

:func:`split_experts` rewrites a rank's :class:`Shard` of a stacked parameter as Shards
of the stored per-expert tensors that its box touches: views into the parameter, each
with the box it covers in its stored tensor. Loading and saving then run unchanged on
those keys, so a rank of an expert-sharded model (experts split over ep along dim 0, or
FSDP2's ``Shard(0)``) reads and writes the bytes of its own experts only, and what is
written is what ``from_pretrained`` reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from shardpoint.state.sharding import Shard

__all__ = ["expert_scheme", "split_experts"]

# (module renames applied to the layer prefix, gate, up, down) per naming scheme
_MIXTRAL = ((".mlp.", ".block_sparse_moe."), "w1", "w3", "w2")
_GATE_UP_DOWN = (None, "gate_proj", "up_proj", "down_proj")
_STACKED = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<which>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<prefix>.*)\.mlp\.gate\.weight$")


def expert_scheme(model: torch.nn.Module) -> tuple | None:
    """The on-disk naming of ``model``'s experts, or None when they are stored as they are held.

    Decided by transformers' own checkpoint conversion table for the model's ``model_type``:
    only the families it converts from per-expert keys are split (gpt-oss, for one, stores
    its stacked experts as they are).
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model_type, str):
        return None
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without conversion tables stores what it holds
        return None
    sources = {p for c in get_checkpoint_conversion_mapping(model_type) or [] for p in _patterns(c)}
    if any(p.endswith(".experts.*.w1.weight") for p in sources):
        return _MIXTRAL
    if any(p.endswith("experts.*.gate_proj.weight") for p in sources):
        return _GATE_UP_DOWN
    return None


def _patterns(converter: object) -> list[str]:
    found = getattr(converter, "source_patterns", None) or []
    return [found] if isinstance(found, str) else [p for p in found if isinstance(p, str)]


def split_experts(shards: Mapping[str, Shard], scheme: tuple | None) -> dict[str, Shard]:
    """``shards`` with every stacked expert parameter replaced by the per-expert tensors its box covers.

    Other keys pass through, except Mixtral's router, which is renamed as it is stored.
    """
    if scheme is None:
        return dict(shards)
    rename, gate, up, down = scheme
    out: dict[str, Shard] = {}
    for key, shard in shards.items():
        match = _STACKED.match(key)
        if match is None or shard.tensor.dim() != 3:
            router = _ROUTER.match(key) if rename else None
            out[_moved(key, rename) if router else key] = shard
            continue
        prefix = _moved(f"{match['prefix']}.", rename).rstrip(".")
        if match["which"] == "down_proj":
            pieces = [(down, 0, shard.global_shape[1])]
        else:
            rows = shard.global_shape[1] // 2
            pieces = [(gate, 0, rows), (up, rows, rows)]
        for name, start, rows in pieces:
            out.update(_expert_pieces(shard, f"{prefix}.experts.{{}}.{name}.weight", start, rows))
    return out


def _moved(key: str, rename: tuple[str, str] | None) -> str:
    return key.replace(rename[0], rename[1], 1) if rename else key


def _expert_pieces(shard: Shard, name: str, start: int, rows: int) -> dict[str, Shard]:
    """The stored tensors ``name.format(e)`` (rows ``start .. start+rows`` of expert ``e``) this box touches."""
    (e0, r0, c0), (le, lr, _) = shard.global_offset, tuple(shard.tensor.shape)
    lo, hi = max(r0, start), min(r0 + lr, start + rows)
    if hi <= lo:
        return {}
    stored_shape = (rows, shard.global_shape[2])
    return {
        name.format(e): Shard(
            shard.tensor[e - e0, lo - r0 : hi - r0, :],
            stored_shape,
            (lo - start, c0),
            shard.replica_id,
        )
        for e in range(e0, e0 + le)
    }
