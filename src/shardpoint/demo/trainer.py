"""The training loop, with Megatron's checkpoint semantics around it.

Sequence on every rank (call :meth:`Trainer.run` after the process group exists)::

    build groups, model, ZeRO-1 optimizer, LR schedule  ->  ckpt.load (resumes
    iteration, consumed samples, RNG; reshards on a new layout)  ->  forward-pass
    validation of what was loaded  ->  for each step: train, maybe_save (every
    save_interval), agree on exit (signal, duration, exit interval)  ->  save once
    more unless this iteration was just saved

Time spent saving (and validating) is kept out of the throughput, as Megatron keeps
it out of its interval timing. Run it under torchrun with NCCL unchanged::

    torchrun --nproc-per-node 8 -m shardpoint.demo.trainer --tp 2 --pp 2 --dp 2 --save runs/gpt
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.demo.data import SampleStream, micro_batches
from shardpoint.demo.model import GPTConfig, GPTModel
from shardpoint.demo.optim import DistributedAdamW
from shardpoint.demo.parallel import ParallelState, build_parallel_state, pick_device
from shardpoint.demo.pipeline import forward_backward
from shardpoint.demo.preemption import ExitSignalHandler, agree_to_exit
from shardpoint.demo.rng_tracker import RNGTracker
from shardpoint.demo.validation import check_validation_logits, validation_logits, validation_tokens
from shardpoint.lifecycle.node_local import committed_metadata

__all__ = ["SaveRecord", "StepInfo", "TrainConfig", "TrainResult", "Trainer", "cosine_with_warmup"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainConfig:
    """One training run.

    Args:
        save: checkpoint directory (also loaded from, as Megatron's ``--load == --save``).
        tp, pp, dp: the parallel layout; their product is the world size.
        model: the GPT's shape.
        train_iters: train up to this iteration.
        global_batch_size: samples per step over all data-parallel ranks (fixed when dp changes).
        micro_batch_size: samples per pipeline micro-batch.
        lr, min_lr, warmup_iters: linear warm-up to ``lr``, cosine decay to ``min_lr`` at ``train_iters``.
        weight_decay: AdamW decay of matrices (biases and LayerNorms are not decayed).
        seed: seeds weights, data stream and dropout.
        save_interval: save every N iterations (None: only on exit and at the end).
        exit_interval: save and stop when the iteration is a multiple of N.
        exit_duration_minutes: save and stop once training ran this long.
        exit_signal_handler: on SIGTERM, save and stop at the next step boundary.
        validate_forward: store logits of a fixed batch at each save, compare them after load.
        validation_tolerance: largest accepted absolute logit difference.
        format: checkpoint format, ``"dist"`` (reshardable) or ``"torch"``.
        log_interval: log loss and throughput every N iterations (rank 0).
        upload_to: local-first mode, ``s3://`` prefix the checkpoints are uploaded to
            (``save`` may then be a node-local directory, see :mod:`shardpoint.lifecycle.node_local`).
        local_dir, local_interval: the non-persistent local tier (:mod:`shardpoint.tier`): a
            node-local directory and the steps between its checkpoints (None: no local tier).
    """

    save: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    model: GPTConfig = field(default_factory=GPTConfig)
    train_iters: int = 100
    global_batch_size: int = 16
    micro_batch_size: int = 4
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 10
    weight_decay: float = 0.1
    seed: int = 1234
    save_interval: int | None = None
    exit_interval: int | None = None
    exit_duration_minutes: float | None = None
    exit_signal_handler: bool = True
    validate_forward: bool = False
    validation_tolerance: float = 1e-4
    format: str = "dist"
    log_interval: int = 10
    upload_to: str | None = None
    local_dir: str | None = None
    local_interval: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "train_iters", "global_batch_size", "micro_batch_size", "log_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {value!r}")
        for name in ("save_interval", "exit_interval", "local_interval"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"TrainConfig.{name} must be a positive integer or None, got {value!r}")
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"TrainConfig needs 0 < min_lr <= lr, got min_lr={self.min_lr} lr={self.lr}")


@dataclass
class StepInfo:
    """What one finished step reports to the ``on_step`` callback."""

    iteration: int
    loss: float
    lr: float
    saved: bool


@dataclass
class SaveRecord:
    """One checkpoint this run wrote (bytes as recorded in its ``shardpoint.json``; rank 0 only)."""

    iteration: int
    seconds: float
    bytes: int


@dataclass
class TrainResult:
    """What a run did; identical on every rank except ``saves[].bytes`` (rank 0 reads them)."""

    start_iteration: int
    iteration: int
    losses: dict[int, float]
    exit_reason: str
    saves: list[SaveRecord]
    train_seconds: float
    tokens_per_second: float
    loaded_from: str | None = None
    validation_diff: float | None = None
    loaded_tiers: dict[int, tuple[str, str]] = field(default_factory=dict)  # LoadResult.tiers: rank -> tier, source


def cosine_with_warmup(warmup: int, decay_iters: int, min_ratio: float) -> Callable[[int], float]:
    """LR factor of scheduler step ``step`` (0-based): Megatron's linear warm-up then cosine decay."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, decay_iters - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _optimizer(model: GPTModel, ps: ParallelState, cfg: TrainConfig) -> DistributedAdamW:
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return DistributedAdamW(groups, dp_group=ps.dp_group, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


class Trainer:
    """Builds one rank's part of the job and trains it (every rank constructs one).

    Args:
        config: the run.
        on_step: called on every rank after each step (progress reporting, tests).

    Attributes:
        ps, model, state, ckpt: the parallel state, this stage's model, what is
            checkpointed, and the Checkpointer, for callers that inspect them.
    """

    def __init__(self, config: TrainConfig, on_step: Callable[[StepInfo], Any] | None = None):
        started = time.perf_counter()
        self.cfg = config
        self.on_step = on_step
        self.ps = build_parallel_state(config.tp, config.pp, config.dp)
        _seed_globals(config.seed + 100 * self.ps.pp_rank)
        self.rng = RNGTracker(config.seed, self.ps)
        self.model = GPTModel(config.model, self.ps, self.rng, seed=config.seed)
        optimizer = _optimizer(self.model, self.ps, config)
        factor = cosine_with_warmup(config.warmup_iters, config.train_iters, config.min_lr / config.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        self.state = sp.TrainState(
            model=self.model, optimizer=optimizer, scheduler=scheduler, generators=self.rng.generators, extra={}
        )
        self.ckpt = sp.Checkpointer(
            config.save,
            topology=self.ps.topology,
            format=config.format,
            save_interval=config.save_interval,
            config=config.model.checkpoint_config(),
            upload_to=config.upload_to,
            local_dir=config.local_dir,
            local_interval=config.local_interval,
        )
        self.stream = SampleStream(config.model.seq_length, seed=config.seed)
        self.validation_tokens = validation_tokens(config.model.seq_length, config.seed)
        self.saves: list[SaveRecord] = []
        self.loaded: sp.LoadResult | None = None
        log.info(
            "built stage %d/%d, tp rank %d/%d, dp rank %d/%d in %.2f s",
            self.ps.pp_rank,
            self.ps.pp_size,
            self.ps.tp_rank,
            self.ps.tp_size,
            self.ps.dp_rank,
            self.ps.dp_size,
            time.perf_counter() - started,
        )

    def load(self) -> tuple[int, str | None, float | None]:
        """Resume from the save directory: ``(iteration, checkpoint path, validation diff)``."""
        result = self.loaded = self.ckpt.load(self.state)
        start = result.iteration if result else 0
        # Megatron's fallback for checkpoints that predate consumed_samples.
        self.state.extra.setdefault("consumed_samples", start * self.cfg.global_batch_size)
        if result is None:
            return 0, None, None
        diff = None
        if self.cfg.validate_forward:
            diff = check_validation_logits(
                self.model, self.ps, result, self.validation_tokens, self.cfg.validation_tolerance
            )
        return start, result.path, diff

    def train_step(self) -> float:
        """One optimizer step on the next global batch; returns the global batch's mean loss."""
        cfg, ps = self.cfg, self.ps
        batches = micro_batches(
            self.stream,
            int(self.state.extra["consumed_samples"]),
            cfg.global_batch_size,
            cfg.micro_batch_size,
            ps.dp_size,
            ps.dp_rank,
            ps.device,
        )
        self.state.optimizer.zero_grad(set_to_none=False)
        loss = forward_backward(self.model, ps, batches)
        self._all_reduce_embedding_grad()
        self.state.optimizer.step()
        self.state.scheduler.step()
        self.state.extra["consumed_samples"] += cfg.global_batch_size
        return self._global_loss(loss)

    def _all_reduce_embedding_grad(self) -> None:
        """Sum the tied embedding's gradients of the first and last stage (Megatron's embedding group)."""
        weight = self.model.word_embeddings_weight()
        if self.ps.pp_size > 1 and weight is not None:
            dist.all_reduce(weight.grad, group=self.ps.embedding_group)

    def _global_loss(self, stage_loss: float) -> float:
        """The loss on every rank: last stage's value, averaged over data-parallel replicas."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return stage_loss
        mine = stage_loss if self.ps.is_last_stage and self.ps.tp_rank == 0 else 0.0
        total = torch.tensor([mine], dtype=torch.float64, device=self.ps.device)
        dist.all_reduce(total)
        return float(total[0]) / self.ps.dp_size

    def save(self, iteration: int, *, policy: bool) -> bool:
        """Save at ``iteration`` (``policy``: only if the save interval says so); returns whether it saved."""
        logits = None
        if self.cfg.validate_forward:
            logits = partial(validation_logits, self.model, self.ps, self.validation_tokens)
        if policy:
            if not self.ckpt.maybe_save(iteration, self.state, validation_logits=logits):
                return False
            if self.ckpt.last_saved_iteration != iteration:  # a local-tier save: nothing persistent to record
                return True
        elif self.ckpt.last_saved_iteration == iteration:
            return False
        else:
            self.ckpt.save(iteration, self.state, validation_logits=logits)
        path = self.ckpt.storage.join(self.ckpt.root, self.ckpt.layout.dir_name(iteration))
        size = committed_metadata(self.ckpt.storage, path).total_bytes if self.ps.topology.rank == 0 else 0
        self.saves.append(SaveRecord(iteration, self.ckpt.last_save_seconds, size))
        return True

    def run(self) -> TrainResult:
        """Load, train to ``train_iters`` or an exit condition, save; see the module docstring."""
        try:
            start, loaded_from, diff = self.load()
            losses, reason, iteration, train_seconds = self._train(start)
        finally:
            self.ckpt.close()
        tokens = len(losses) * self.cfg.global_batch_size * self.cfg.model.seq_length
        return TrainResult(
            start,
            iteration,
            losses,
            reason,
            self.saves,
            train_seconds,
            tokens / train_seconds if train_seconds else 0.0,
            loaded_from,
            diff,
            self.loaded.tiers if self.loaded else {},
        )

    def _train(self, start: int) -> tuple[dict[int, float], str, int, float]:
        """The loop: ``(losses, exit reason, last iteration, seconds spent in steps)``."""
        cfg = self.cfg
        losses: dict[int, float] = {}
        started, train_seconds, reason, iteration = time.time(), 0.0, "finished", start
        with ExitSignalHandler(enabled=cfg.exit_signal_handler) as handler:
            for iteration in range(start + 1, cfg.train_iters + 1):
                step_start = time.perf_counter()
                losses[iteration] = self.train_step()
                train_seconds += time.perf_counter() - step_start  # saving and validation stay out
                saved = self.save(iteration, policy=True)
                self._report(iteration, losses[iteration], saved, train_seconds, len(losses))
                exit_reason = agree_to_exit(handler.received, started, cfg.exit_duration_minutes, self.ps.device)
                if exit_reason is None and cfg.exit_interval and iteration % cfg.exit_interval == 0:
                    exit_reason = "exit-interval"
                if exit_reason is not None:
                    reason = exit_reason
                    break
            if losses:
                self.save(iteration, policy=False)  # on exit, and after the last step, unless just saved
        return losses, reason, iteration, train_seconds

    def _report(self, iteration: int, loss: float, saved: bool, train_seconds: float, steps: int) -> None:
        lr = self.state.optimizer.param_groups[0]["lr"]
        if self.on_step is not None:
            self.on_step(StepInfo(iteration, loss, lr, saved))
        if self.ps.topology.rank == 0 and iteration % self.cfg.log_interval == 0:
            tokens = steps * self.cfg.global_batch_size * self.cfg.model.seq_length
            log.info(
                "iteration %d/%d | loss %.4f | lr %.3g | %.0f tokens/s (saving excluded, %.2f s spent saving)",
                iteration,
                self.cfg.train_iters,
                loss,
                lr,
                tokens / max(train_seconds, 1e-9),
                self.ckpt.total_save_seconds,
            )


def _seed_globals(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(argv: list[str] | None = None) -> int:
    """Entry point for torchrun: ``python -m shardpoint.demo.trainer --tp 2 --pp 2 --dp 2 --save DIR``."""
    parser = argparse.ArgumentParser(description="Train the demo GPT on the ranks torchrun started.")
    parser.add_argument("--save", required=True)
    for name, default in (
        ("tp", 1),
        ("pp", 1),
        ("dp", 1),
        ("train-iters", 100),
        ("save-interval", 0),
        ("exit-interval", 0),
        ("global-batch-size", 16),
        ("micro-batch-size", 4),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--exit-duration-minutes", type=float, default=None)
    parser.add_argument("--validate-forward", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    pick_device(backend)  # make cuda:LOCAL_RANK current before NCCL creates its communicators
    dist.init_process_group(backend)
    try:
        config = TrainConfig(
            save=args.save,
            tp=args.tp,
            pp=args.pp,
            dp=args.dp,
            train_iters=args.train_iters,
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            save_interval=args.save_interval or None,
            exit_interval=args.exit_interval or None,
            exit_duration_minutes=args.exit_duration_minutes,
            validate_forward=args.validate_forward,
        )
        Trainer(config).run()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
