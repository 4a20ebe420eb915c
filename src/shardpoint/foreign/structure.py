"""How Megatron-LM splits and lays out each tensor, so a re-split is exact or an error.

A tensor-parallel parameter's *global* tensor is, as in megatron-core's
``torch_dist``, the concatenation of its TP pieces along the partition dim. For most
tensors that global tensor does not depend on the TP size, so splitting it again
into N contiguous pieces is exact. The exceptions, handled here:

* **QKV** (``linear_qkv``): rows are interleaved per query group,
  ``[q heads of group g, k_g, v_g] * head_dim``. Each TP rank holds whole groups, so
  contiguous splitting is exact *when the number of query groups divides by TP*; any
  other TP size is refused naming the tensor. :func:`qkv_to_separate` /
  :func:`separate_to_qkv` convert to and from ``[Q; K; V]`` (Hugging Face, DeepSpeed models).
* **Gated MLP** (``--swiglu``): each rank's ``linear_fc1`` is ``[gate_r; up_r]``, so the
  TP concatenation interleaves per rank. Import stores ``[gate; up]``
  (:func:`glu_from_tp`), export re-interleaves (:func:`glu_to_tp`).
* **Vocab padding**: embedding and output rows are padded to a multiple of
  ``make_vocab_size_divisible_by * tp``; :func:`repad_vocab` strips or adds rows
  when the TP size changes that size (new parameter rows copy the last row, as
  Megatron's own converter does; new optimizer-state rows are zero).
"""

from __future__ import annotations

import math
import re

import torch

from shardpoint.errors import CheckpointError, TopologyMismatchError

__all__ = [
    "VOCAB_KEYS",
    "glu_from_tp",
    "glu_to_tp",
    "padded_vocab_size",
    "qkv_to_separate",
    "repad_vocab",
    "separate_to_qkv",
    "split_dim",
    "split_for_tp",
]

# Megatron (megatron-core GPTModel, local and Transformer Engine specs; legacy
# ``language_model`` names too): partition dim of tensor-parallel parameters.
_DIM0 = re.compile(
    r"(linear_qkv|linear_fc1|query_key_value|dense_h_to_4h|word_embeddings|output_layer|linear_q_proj|"
    r"linear_kv_up_proj|linear_q_up_proj)\.(weight|bias)$"
)
_DIM1 = re.compile(r"(linear_proj|linear_fc2|attention\.dense|dense_4h_to_h)\.weight$")
VOCAB_KEYS = re.compile(r"(word_embeddings|output_layer)\.weight$")


def split_dim(name: str) -> int | None:
    """The tensor-parallel partition dim of a Megatron parameter, or None when replicated."""
    if _DIM0.search(name):
        return 0
    if _DIM1.search(name):
        return 1
    return None


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary size (``_vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def repad_vocab(name: str, tensor: torch.Tensor, vocab_size: int, new_rows: int, is_param: bool) -> torch.Tensor:
    """``tensor`` (embedding/output rows, padded) with ``new_rows`` rows; only padding rows change."""
    rows = tensor.shape[0]
    if new_rows == rows:
        return tensor
    if new_rows < vocab_size:
        raise TopologyMismatchError(
            f"{name}: cannot shrink {rows} rows to {new_rows}, below the vocabulary size {vocab_size}"
        )
    if new_rows < rows:
        return tensor[:new_rows].clone()
    fill = (
        tensor[-1:].expand(new_rows - rows, *tensor.shape[1:])
        if is_param
        else tensor.new_zeros(new_rows - rows, *tensor.shape[1:])
    )
    return torch.cat([tensor, fill])


def split_for_tp(
    name: str, tensor: torch.Tensor, dim: int | None, tp: int, query_groups: int | None = None
) -> list[torch.Tensor]:
    """``tensor`` cut into ``tp`` pieces along ``dim`` (one piece when replicated), or an error naming it."""
    if dim is None or tp == 1:
        return [tensor] * tp
    if tensor.shape[dim] % tp:
        raise TopologyMismatchError(f"{name}: dim {dim} of size {tensor.shape[dim]} does not divide by tp={tp}")
    if query_groups is not None and "linear_qkv" in name and query_groups % tp:
        raise TopologyMismatchError(
            f"{name}: its rows hold {query_groups} query groups, which do not divide by tp={tp}; each "
            "tensor-parallel rank must hold whole groups (choose a tp that divides the number of groups)"
        )
    return [piece.clone() for piece in torch.chunk(tensor, tp, dim=dim)]


def glu_from_tp(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Gated ``linear_fc1`` pieces ``[gate_r; up_r]`` -> ``[gate; up]`` (independent of TP)."""
    halves = [torch.chunk(p, 2, dim=0) for p in pieces]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def glu_to_tp(name: str, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """``[gate; up]`` -> per TP rank ``[gate_r; up_r]``."""
    gate, up = torch.chunk(tensor, 2, dim=0)
    if gate.shape[0] % tp:
        raise TopologyMismatchError(f"{name}: {gate.shape[0]} gated rows do not divide by tp={tp}")
    return [torch.cat([g, u]) for g, u in zip(torch.chunk(gate, tp), torch.chunk(up, tp))]


def _qkv_shape(name: str, rows: int, heads: int, groups: int) -> tuple[int, int]:
    if heads % groups:
        raise CheckpointError(f"{name}: {heads} attention heads do not divide into {groups} query groups")
    per_group = heads // groups + 2
    if rows % (groups * per_group):
        raise CheckpointError(f"{name}: {rows} rows are not {groups} groups of {per_group} heads")
    return per_group, rows // (groups * per_group)


def qkv_to_separate(name: str, tensor: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, ...]:
    """Megatron's per-group interleaved ``linear_qkv`` rows -> ``(Q, K, V)``, heads in order."""
    per_group, head_dim = _qkv_shape(name, tensor.shape[0], heads, groups)
    grouped = tensor.reshape(groups, per_group, head_dim, *tensor.shape[1:])
    q_heads = heads // groups
    q = grouped[:, :q_heads].reshape(heads * head_dim, *tensor.shape[1:])
    k = grouped[:, q_heads].reshape(groups * head_dim, *tensor.shape[1:])
    v = grouped[:, q_heads + 1].reshape(groups * head_dim, *tensor.shape[1:])
    return q, k, v


def separate_to_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """``(Q, K, V)`` -> Megatron's per-group interleaved rows (inverse of :func:`qkv_to_separate`)."""
    head_dim = q.shape[0] // heads
    rest = q.shape[1:]
    qg = q.reshape(groups, heads // groups, head_dim, *rest)
    kg = k.reshape(groups, 1, head_dim, *rest)
    vg = v.reshape(groups, 1, head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)
