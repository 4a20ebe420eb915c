"""Rank functions for tests/test_integration_deepspeed_pipe.py: a 2-stage ``PipelineModule`` on 2 CPU ranks (gloo)."""

from __future__ import annotations

from typing import Any

import torch

from tests.integration_deepspeed_worker import _deepspeed, full_state, tag_files

TAG = "global_step2"


def pipeline_engine(seed: int, stages: int = 2, tied: bool = False, tied_bias: bool = False) -> Any:
    """A 5-layer MLP in ``stages`` stages (pp=stages, dp=2/stages), ZeRO-1, Adam, fp32.

    ``tied``: the first and last layers are one ``TiedLayerSpec`` (6 -> 6, as a NeoX
    embedding tied to its output), so at pp=2 both stages hold it. DeepSpeed ties only its
    ``weight``: with ``tied_bias`` the layer has a bias, which each stage trains on its own.
    """
    deepspeed = _deepspeed()
    from deepspeed.pipe import PipelineModule, TiedLayerSpec

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule asks DeepSpeed's comm for the rank
    torch.manual_seed(seed)
    layers: list[Any] = [torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(10, 3))
    if tied:
        tie = TiedLayerSpec("io", torch.nn.Linear, 6, 6, bias=tied_bias)
        layers = [tie, torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 6), tie]
    net = PipelineModule(layers=layers, num_stages=stages, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    built, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return built


def train(eng: Any, steps: int, start: int, out: int = 3) -> list[float]:
    """``steps`` pipeline steps on batches that depend only on the step (``out`` features in the targets)."""
    losses = []
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        batches = [(torch.randn(2, 6, generator=gen), torch.randn(2, out, generator=gen)) for _ in range(2)]
        losses.append(float(eng.train_batch(data_iter=iter(batches))))
    return losses


def stage_params(eng: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng.module.state_dict().items()}


def pipeline_both_modes(rank: int, world: int, stock_dir: str, ours_dir: str, reshard_dir: str) -> dict[str, Any]:
    """One state saved by DeepSpeed's engine and by shardpoint's; resume from shardpoint's; :func:`pipeline_reshard`."""
    from shardpoint.integrations.deepspeed import use

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

    result = {"saved": saved, "loaded": loaded, "expected": expected, "after": after, "client": client}
    result["files"] = (tag_files_of(stock_dir), tag_files_of(ours_dir)) if rank == 0 else None
    result["reshard"] = pipeline_reshard(reshard_dir)
    return result


def snapshot(eng: Any) -> dict[str, Any]:
    """This rank's layers, their whole fp32 masters and Adam moments (DeepSpeed's own getters), the step counts."""
    step = next(iter(eng.optimizer.optimizer.state.values()))["step"]
    return {"weights": stage_params(eng), "state": full_state(eng), "step": int(step), "global": eng.global_steps}


def pipeline_reshard(directory: str) -> dict[str, Any]:
    """Reshardable mode: pp=2 dp=1 saved, loaded at pp=1 dp=2, trained a step, saved, loaded at pp=2 dp=1 again."""
    from shardpoint.integrations.deepspeed import load_checkpoint, save_checkpoint

    two = pipeline_engine(seed=0, tied=True)
    train(two, 2, 0, out=6)
    save_checkpoint(two, f"{directory}/pp2", client_state={"iteration": 2, "rank": torch.distributed.get_rank()})
    result = {"pp2_saved": snapshot(two)}
    result["converted_loaded"] = load_converted(directory)
    one = pipeline_engine(seed=1, stages=1, tied=True)  # other weights until the load
    _, result["pp1_client"] = load_checkpoint(one, f"{directory}/pp2")
    result["pp1_loaded"] = snapshot(one)
    train(one, 1, 2, out=6)
    save_checkpoint(one, f"{directory}/pp1", client_state={"iteration": 3})
    result["pp1_saved"] = snapshot(one)
    back = pipeline_engine(seed=2, tied=True)
    load_checkpoint(back, f"{directory}/pp1")
    result["back_loaded"] = snapshot(back)
    result["back_losses"] = train(back, 1, 3, out=6)  # it trains on
    result["untied_refusal"] = untied_refusal(f"{directory}/untied")
    return result


def load_converted(directory: str) -> dict[str, Any]:
    """``convert --to deepspeed --pp 2 --dp 1 --zero-stage 1`` of the pp=2 save (on rank 0).

    Then DeepSpeed's own engine (no shardpoint) loads it.
    """
    from shardpoint.cli import main

    if torch.distributed.get_rank() == 0:
        args = ["convert", "--to", "deepspeed", f"{directory}/pp2", f"{directory}/ds", "--pp", "2", "--dp", "1"]
        assert main([*args, "--zero-stage", "1"]) == 0
    torch.distributed.barrier()
    stock = pipeline_engine(seed=3, tied=True)  # other weights until the load
    path, client = stock.load_checkpoint(f"{directory}/ds")
    assert path is not None, f"DeepSpeed loaded nothing from {directory}/ds"
    return snapshot(stock) | {"client": client}


def untied_refusal(directory: str) -> str:
    """A tied layer's bias, which DeepSpeed does not tie, differs by stage: the save is refused on every rank."""
    from shardpoint.errors import CheckpointError
    from shardpoint.integrations.deepspeed import save_checkpoint

    eng = pipeline_engine(seed=0, tied=True, tied_bias=True)
    train(eng, 1, 0, out=6)
    try:
        save_checkpoint(eng, directory)
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def tag_files_of(directory: str) -> dict[str, bytes]:
    from pathlib import Path

    return tag_files(Path(directory) / TAG)
