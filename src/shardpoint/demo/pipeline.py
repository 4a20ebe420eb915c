"""Pipeline parallelism with the GPipe schedule: all forwards, then all backwards.

Each stage runs every micro-batch forward, sending its output activation to the next
stage (``torch.distributed.send``) and receiving its input from the previous one;
then every micro-batch backward, in the same order, receiving the gradient of its
output from the next stage and sending the gradient of its input to the previous
one. Because every stage handles the micro-batches in the same order and messages
only flow one way per phase, blocking send / recv cannot deadlock. Megatron's 1F1B
schedule interleaves the two phases to hold fewer activations; the result is the same.

Only the last stage computes a loss; it returns the micro-batches' mean, other stages 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardpoint.demo.model import GPTModel
from shardpoint.demo.parallel import ParallelState
from shardpoint.demo.tensor_parallel import gather_from_tp

__all__ = ["MicroBatch", "forward_backward", "forward_logits"]

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (tokens, labels), each [micro_batch, seq]


def _activation(ps: ParallelState, model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    return torch.empty((*tokens.shape, model.cfg.hidden_size), device=ps.device)


def _stage_forward(model: GPTModel, ps: ParallelState, tokens: torch.Tensor, grad: bool) -> tuple:
    """Receive (unless first), run this stage, send (unless last); returns (input, output)."""
    hidden = None
    if not ps.is_first_stage:
        hidden = _activation(ps, model, tokens)
        dist.recv(hidden, src=ps.prev_rank)
        hidden.requires_grad_(grad)
    output = model(hidden, tokens)
    if not ps.is_last_stage:
        dist.send(output.detach().contiguous(), dst=ps.next_rank)
    return hidden, output


def forward_backward(model: GPTModel, ps: ParallelState, micro_batches: Sequence[MicroBatch]) -> float:
    """One step's forward and backward over ``micro_batches``; gradients accumulate in ``.grad``.

    Every rank of the pipeline calls this with its own micro-batches (the same
    samples on every stage and tp rank of one data-parallel replica).

    Returns:
        The mean loss of the micro-batches on the last stage, 0.0 elsewhere.
    """
    count = len(micro_batches)
    inputs, outputs = [], []
    for tokens, labels in micro_batches:
        hidden, output = _stage_forward(model, ps, tokens, grad=True)
        if ps.is_last_stage:
            output = model.loss(output, labels) / count
        inputs.append(hidden)
        outputs.append(output)
    for hidden, output in zip(inputs, outputs):
        if ps.is_last_stage:
            output.backward()
        else:
            grad = torch.empty_like(output)
            dist.recv(grad, src=ps.next_rank)
            output.backward(grad)
        if hidden is not None:
            dist.send(hidden.grad.contiguous(), dst=ps.prev_rank)
    if not ps.is_last_stage:
        return 0.0
    return float(sum(o.detach() for o in outputs))


@torch.no_grad()
def forward_logits(model: GPTModel, ps: ParallelState, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits of ``tokens`` in eval mode (no dropout, no RNG drawn).

    Every rank of the pipeline calls this; the last stage's ranks return
    ``[batch, seq, vocab]`` logits (gathered over tp), the others None.
    """
    was_training = model.training
    model.eval()
    try:
        _, output = _stage_forward(model, ps, tokens, grad=False)
        if not ps.is_last_stage:
            return None
        return gather_from_tp(model.logits(output), ps.tp_group)
    finally:
        model.train(was_training)
