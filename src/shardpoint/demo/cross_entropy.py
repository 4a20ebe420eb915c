"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel group.

Gathering ``[tokens, vocab]`` logits onto every rank would cost a full copy per rank;
Megatron's ``vocab_parallel_cross_entropy`` instead all-reduces three vectors of
length ``tokens``: the row maximum (for a stable softmax), the target's logit (held by
exactly one rank) and the softmax denominator. The gradient, ``softmax - one_hot``,
is then computed locally on each rank's slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_cross_entropy"]


def _all_reduce(tensor: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        _all_reduce(row_max, group, dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= logits.shape[-1])
        local_target = local_target.masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        _all_reduce(predicted, group)
        exp = shifted.exp()
        denominator = exp.sum(dim=-1)
        _all_reduce(denominator, group)
        ctx.save_for_backward(exp.div_(denominator.unsqueeze(-1)), local_target, outside)
        return denominator.log() - predicted

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(softmax.dtype).unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any
) -> torch.Tensor:
    """Per-token loss ``-log softmax(logits)[target]`` for vocabulary-split ``logits``.

    Args:
        logits: ``[..., vocab / tp]``, this rank's columns starting at ``vocab_start``.
        target: ``[...]`` global token ids.
        group: the tensor-parallel group (None: the logits hold the whole vocabulary).

    Returns:
        ``[...]`` float32 losses, identical on every rank of ``group``.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group)
