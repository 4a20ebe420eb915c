"""GPT-NeoX's forward-pass validation: did the weights that came back make the same model?

Checksums prove the files are the ones written; they cannot prove the weights are
the ones the model had (a bug in a conversion, a changed model definition, or
memory corrupted before the checksum was taken all pass them). So at each save the
logits of a fixed batch are stored beside the checkpoint, and after a load the same
batch is run again and compared.

The logits are handed to ``Checkpointer.save(validation_logits=...)`` by the one rank
that holds them (last pipeline stage, tp rank 0, dp rank 0), so they are written
inside the checkpoint before its commit, checksummed and named in
``shardpoint.json``. A checkpoint saved without validation is loaded with a warning
and not validated. The comparison works at any layout: logits are gathered over tp
first, and rounding differences between layouts stay far below the tolerance.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.demo.data import SampleStream
from shardpoint.demo.model import GPTModel
from shardpoint.demo.parallel import ParallelState
from shardpoint.demo.pipeline import forward_logits

__all__ = ["VALIDATION_FILE", "check_validation_logits", "validation_logits", "validation_tokens"]

log = logging.getLogger(__name__)

VALIDATION_FILE = sp.checkpointer.VALIDATION_FILE
_STREAM_OFFSET = 7_777_777
_MISSING = -1.0


def validation_tokens(seq_length: int, seed: int, batch: int = 2) -> torch.Tensor:
    """The fixed batch: the first samples of a stream no training step draws from."""
    return SampleStream(seq_length, seed=seed + _STREAM_OFFSET).batch(range(batch))[0]


def _holder(ps: ParallelState) -> bool:
    return ps.is_last_stage and ps.tp_rank == 0 and ps.dp_rank == 0


def validation_logits(model: GPTModel, ps: ParallelState, tokens: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """What to pass as ``validation_logits`` to a save: every rank calls this, one rank gets a value."""
    logits = forward_logits(model, ps, tokens.to(ps.device))
    if logits is None or not _holder(ps):
        return None
    return {"tokens": tokens.cpu(), "logits": logits.cpu()}


def check_validation_logits(
    model: GPTModel, ps: ParallelState, result: sp.LoadResult, tokens: torch.Tensor, tolerance: float
) -> float | None:
    """Compare the model's logits with those saved; every rank calls this after loading.

    Returns:
        The largest absolute difference, or None when the checkpoint has no saved logits.

    Raises:
        ValidationError: on every rank, when the difference exceeds ``tolerance``.
    """
    checkpoint_dir = result.path
    logits = forward_logits(model, ps, tokens.to(ps.device))
    diff = torch.tensor([float("-inf")], device=ps.device)
    if logits is not None and _holder(ps):
        diff[0] = _difference(result.read_validation_logits(), tokens, logits.cpu())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    value = float(diff[0])
    if value == _MISSING:
        log.warning("%s has no %s; forward-pass validation skipped", checkpoint_dir, VALIDATION_FILE)
        return None
    if not value <= tolerance:
        raise sp.ValidationError(
            f"forward-pass validation failed for {checkpoint_dir}: the logits of the fixed validation batch differ "
            f"from those saved with it by up to {value:.3g} (tolerance {tolerance:g}), so the loaded weights do not "
            "make the model that was saved. Load an earlier iteration, or check that the model definition and "
            "config match the run that saved it."
        )
    log.info("forward-pass validation of %s passed (max |diff| %.3g)", checkpoint_dir, value)
    return value


def _difference(saved: dict[str, torch.Tensor] | None, tokens: torch.Tensor, logits: torch.Tensor) -> float:
    if saved is None:
        return _MISSING
    if not torch.equal(saved["tokens"], tokens.cpu()) or saved["logits"].shape != logits.shape:
        return float("inf")
    return float((saved["logits"].float() - logits.float()).abs().max())
