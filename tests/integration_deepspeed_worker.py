"""Rank functions for tests/test_integration_deepspeed.py: a small model under a real DeepSpeed engine on CPU (gloo)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

ENV = {"DS_ACCELERATOR": "cpu"}


def _deepspeed() -> Any:
    os.environ.update(ENV)
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))  # one node: what torchrun would set
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's CPU accelerator compiles a shared-memory allreduce with ninja at its first
    # initialize (minutes); gloo carries every collective without it, so it is not built here.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # initialize() imports the Muon optimizer to list it as ZeRO-supported; its import wraps
    # functions in torch.compile (about 10 s of inductor imports per rank). These tests use
    # Adam, so Muon's module is imported once here with its functions left uncompiled.
    from deepspeed.runtime import compiler

    compile_, compiler.compile = compiler.compile, lambda: compiler.dummy_decorator
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer
    finally:
        compiler.compile = compile_
    return deepspeed


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def engine(stage: int, seed: int = 0, lr: float = 1e-2) -> Any:
    deepspeed = _deepspeed()
    net = model(seed)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    built, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    return built


def train(eng: Any, steps: int, start: int = 0) -> list[float]:
    """``steps`` steps on batches that depend only on the step and this rank's dp index."""
    losses = []
    rank = torch.distributed.get_rank()
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(2, 6, generator=gen)
        loss = eng(x).pow(2).mean()
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def params(eng: Any) -> dict[str, torch.Tensor]:
    """The module's whole weights (gathered under ZeRO-3)."""
    import contextlib

    gathered = contextlib.nullcontext()
    if eng.zero_optimization_stage() == 3:
        gathered = _deepspeed().zero.GatheredParameters(list(eng.module.parameters()))
    with gathered:
        return {k: v.detach().clone() for k, v in eng.module.state_dict().items()}


def tag_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# ------------------------------------------------------------------ engine mode


def save_both_ways(rank: int, world: int, stock_dir: str, ours_dir: str, stage: int) -> dict[str, Any]:
    """Train, save with DeepSpeed's own engine and then (same state) with shardpoint's; return the weights."""
    from shardpoint.integrations.deepspeed import use

    eng = engine(stage)
    train(eng, 3)
    client = neox_client_state(3, rank)
    eng.save_checkpoint(stock_dir, tag="global_step3", client_state=client)
    use(eng)
    eng.save_checkpoint(ours_dir, tag="global_step3", client_state=client)
    return {"params": params(eng), "losses": train(eng, 2, 3)}  # the uninterrupted run goes on


def neox_client_state(iteration: int, rank: int) -> dict[str, Any]:
    """What GPT-NeoX passes as client_state: iteration, the model's defining args, every RNG state."""
    import random

    import numpy as np

    return {
        "iteration": iteration,
        "args": {"num_layers": 2, "hidden_size": 10, "num_attention_heads": 1, "padded_vocab_size": 16},
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rank": rank,
    }


def load_stock(rank: int, world: int, directory: str, stage: int) -> dict[str, Any]:
    """DeepSpeed's own engine (no shardpoint) loads the directory; weights and client state back."""
    eng = engine(stage, seed=1)
    path, client = eng.load_checkpoint(directory)
    return {"path": path, "iteration": client["iteration"], "params": params(eng), "losses": train(eng, 2, 3)}


def load_ours(rank: int, world: int, directory: str, stage: int, options: dict | None = None) -> dict[str, Any]:
    """The engine with shardpoint's checkpoint engine loads the directory (checked); a failure is returned."""
    from shardpoint.errors import CheckpointError
    from shardpoint.integrations.deepspeed import use

    eng = engine(stage, seed=1)
    use(eng, **(options or {}))
    try:
        path, client = eng.load_checkpoint(directory)
    except CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"path": path, "iteration": client["iteration"], "params": params(eng), "losses": train(eng, 2, 3)}


def load_ours_each(rank: int, world: int, runs: list[tuple[str, dict]], stage: int) -> list[dict[str, Any]]:
    """:func:`load_ours` for each ``(directory, use() options)``, a fresh engine each, in one launch."""
    return [load_ours(rank, world, directory, stage, options) for directory, options in runs]


def save_then_killed(rank: int, world: int, directory: str, fault: str) -> dict[str, Any]:
    """Commit global_step2, then start global_step4 with a fault that SIGKILLs a rank midway."""
    from shardpoint.integrations.deepspeed import use

    eng = engine(2)
    use(eng)
    train(eng, 2)
    eng.save_checkpoint(directory, tag="global_step2", client_state={"iteration": 2})
    saved = params(eng)
    torch.save(saved, f"{directory}/expected_{rank}.pt")
    train(eng, 2, 2)
    os.environ["SHARDPOINT_FAULT"] = fault
    eng.save_checkpoint(directory, tag="global_step4", client_state={"iteration": 4})
    return {}


# ------------------------------------------------------------------ reshardable mode


def full_state(eng: Any) -> dict[str, torch.Tensor]:
    """Every parameter's whole fp32 master and Adam moments (collective: each rank holds a fragment)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if eng.zero_optimization_stage() < 3:
        eng.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, param in eng.module.named_parameters():
        out[f"{name}.fp32"] = safe_get_full_fp32_param(param).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).clone()
    return out


def reshard_save(rank: int, world: int, directory: str, stage: int) -> dict[str, Any]:
    """Train 3 steps at ``world`` ranks, save in the reshardable mode with a GPT-NeoX-shaped client_state."""
    from shardpoint.integrations.deepspeed import save_checkpoint

    eng = engine(stage)
    train(eng, 3)
    client = neox_client_state(3, rank)
    assert save_checkpoint(eng, directory, tag="global_step3", client_state=client) is True
    return {
        "state": full_state(eng),
        "params": params(eng),
        "step": int(next(iter(eng.optimizer.optimizer.state.values()))["step"]),
    }


def reshard_load(rank: int, world: int, directory: str, stage: int) -> dict[str, Any]:
    """A fresh engine (other seed) at ``world`` ranks loads the reshardable checkpoint."""
    from shardpoint.integrations.deepspeed import load_checkpoint

    eng = engine(stage, seed=1)
    path, client = load_checkpoint(eng, directory)
    return {
        "path": path,
        "client": client,
        "state": full_state(eng),
        "params": params(eng),
        "step": int(next(iter(eng.optimizer.optimizer.state.values()))["step"]),
        "global_steps": eng.global_steps,
    }
