"""Megatron's tensor-parallel layers: the weight matrices of one layer split over a tp group.

The four communication primitives are autograd functions, each the transpose of
another, so that forward and backward together keep every rank's replicated
activations (the residual stream) identical:

==================  ==========================  ============================
function            forward                     backward
==================  ==========================  ============================
copy_to_tp          identity                    all-reduce the gradient
reduce_from_tp      all-reduce                  identity
gather_from_tp      all-gather the last dim     keep this rank's slice
==================  ==========================  ============================

A column-parallel linear (QKV, MLP in) splits its output features: input copied to
the tp region, no communication forward. A row-parallel linear (attention out, MLP
out) splits its input features: each rank computes a partial sum, all-reduced, then
the replicated bias is added once. The vocabulary-parallel embedding splits the
vocabulary: each rank looks up the tokens it owns and the rows are summed.

Weights are initialised Megatron's CPU way (``--use-cpu-initialization``): the full
("master") tensor is drawn from a generator seeded by its global key, and each rank
keeps its slice, so every layout starts from the very same model.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardpoint as sp
from shardpoint.demo.parallel import ParallelState

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "gather_from_tp",
    "master_init",
    "reduce_from_tp",
]


def _size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _all_reduce(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    if _size(group) == 1:
        return tensor
    out = tensor.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        size = _size(group)
        if size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size = _size(ctx.group)
        if size == 1:
            return grad, None
        return grad.chunk(size, dim=-1)[dist.get_rank(ctx.group)].contiguous(), None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a row-parallel region: sum the partial results of the tp ranks."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate the tp ranks' slices of the last dimension (e.g. vocab-parallel logits)."""
    return _GatherFromTP.apply(x, group)


def master_init(key: str, shape: tuple[int, ...], std: float | None, seed: int) -> torch.Tensor:
    """The full tensor ``key`` at initialisation: normal(0, std), or ones/zeros for std 1.0/None.

    Seeded by the key, so it does not depend on the layout or on the order of creation.
    """
    if std is None:
        return torch.zeros(shape)
    if std == 1.0:
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randn(shape, generator=generator) * std


def _local_slice(full: torch.Tensor, dim: int, ps: ParallelState, what: str) -> torch.Tensor:
    size = sp.divide(full.shape[dim], ps.tp_size, what)
    return full.narrow(dim, ps.tp_rank * size, size).clone()


class ColumnParallelLinear(torch.nn.Module):
    """``y = x Wᵀ + b`` with W's output rows (and b) split over tp; the output stays split.

    Args:
        key: the global key prefix of this layer (e.g. ``decoder.layers.3.mlp.linear_fc1``).
        full_weight: the full ``[out, in]`` initial weight; this rank keeps its rows.
    """

    def __init__(self, key: str, full_weight: torch.Tensor, ps: ParallelState):
        super().__init__()
        self.key, self.ps = key, ps
        self.weight = torch.nn.Parameter(_local_slice(full_weight, 0, ps, f"{key}.weight").to(ps.device))
        self.bias = torch.nn.Parameter(torch.zeros(self.weight.shape[0], device=ps.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.ps.tp_group), self.weight, self.bias)

    def sharded_state_dict(self) -> dict[str, Any]:
        topo = self.ps.topology
        return {
            f"{self.key}.weight": sp.column_parallel(self.weight, topo),
            f"{self.key}.bias": sp.column_parallel(self.bias, topo),
        }


class RowParallelLinear(torch.nn.Module):
    """``y = x Wᵀ + b`` with W's input columns split over tp; the input arrives split.

    The bias is replicated and added after the all-reduce, so it is counted once.
    """

    def __init__(self, key: str, full_weight: torch.Tensor, ps: ParallelState):
        super().__init__()
        self.key, self.ps = key, ps
        self.weight = torch.nn.Parameter(_local_slice(full_weight, 1, ps, f"{key}.weight").to(ps.device))
        self.bias = torch.nn.Parameter(torch.zeros(self.weight.shape[0], device=ps.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.ps.tp_group) + self.bias

    def sharded_state_dict(self) -> dict[str, Any]:
        return {f"{self.key}.weight": sp.row_parallel(self.weight, self.ps.topology), f"{self.key}.bias": self.bias}


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose vocabulary rows are split over tp.

    Each rank looks up the ids in its range ``[start, end)`` and outputs zeros for the
    others; the all-reduce then gives every rank the full embedding.
    """

    def __init__(self, key: str, full_weight: torch.Tensor, ps: ParallelState):
        super().__init__()
        self.key, self.ps = key, ps
        self.weight = torch.nn.Parameter(_local_slice(full_weight, 0, ps, f"{key}.weight (vocabulary)").to(ps.device))
        self.vocab_start = ps.tp_rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(rows, self.ps.tp_group)

    def sharded_state_dict(self) -> dict[str, Any]:
        return {f"{self.key}.weight": sp.vocab_parallel(self.weight, self.ps.topology)}
