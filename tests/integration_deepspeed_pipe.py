"""Rank functions for tests/test_integration_deepspeed_pipe.py: a 2-stage ``PipelineModule`` on 2 CPU ranks (gloo)."""

from __future__ import annotations

from typing import Any

import torch

from tests.integration_deepspeed_worker import _deepspeed, tag_files

TAG = "global_step2"


def pipeline_engine(seed: int) -> Any:
    """Two stages of a 5-layer MLP, ZeRO-1, Adam, fp32: each rank holds one stage (pp=2, dp=1)."""
    deepspeed = _deepspeed()
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule asks DeepSpeed's comm for the rank
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3)]
    net = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    built, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return built


def train(eng: Any, steps: int, start: int) -> list[float]:
    """``steps`` pipeline steps on batches that depend only on the step."""
    losses = []
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        batches = [(torch.randn(2, 6, generator=gen), torch.randn(2, 3, generator=gen)) for _ in range(2)]
        losses.append(float(eng.train_batch(data_iter=iter(batches))))
    return losses


def stage_params(eng: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng.module.state_dict().items()}


def pipeline_both_modes(rank: int, world: int, stock_dir: str, ours_dir: str, refused_dir: str) -> dict[str, Any]:
    """One state saved by DeepSpeed's engine and by shardpoint's; resume from shardpoint's; try the reshardable mode."""
    from shardpoint.errors import CheckpointError
    from shardpoint.integrations.deepspeed import load_checkpoint, save_checkpoint, use

    eng = pipeline_engine(seed=0)
    train(eng, 2, 0)
    eng.save_checkpoint(stock_dir, tag=TAG, client_state={"iteration": 2})
    use(eng)
    eng.save_checkpoint(ours_dir, tag=TAG, client_state={"iteration": 2})
    saved = stage_params(eng)
    expected = train(eng, 2, 2)  # the uninterrupted run

    resumed = pipeline_engine(seed=1)  # other weights, until the load
    use(resumed)
    _, client = resumed.load_checkpoint(ours_dir)
    loaded = stage_params(resumed)
    after = train(resumed, 2, 2)

    refusals = []
    for call in (lambda: save_checkpoint(resumed, refused_dir), lambda: load_checkpoint(resumed, ours_dir)):
        try:
            call()
        except CheckpointError as exc:
            refusals.append(str(exc))
    result = {"saved": saved, "loaded": loaded, "expected": expected, "after": after, "client": client}
    result["refusals"] = refusals
    result["files"] = (tag_files_of(stock_dir), tag_files_of(ours_dir)) if rank == 0 else None
    return result


def tag_files_of(directory: str) -> dict[str, bytes]:
    from pathlib import Path

    return tag_files(Path(directory) / TAG)
