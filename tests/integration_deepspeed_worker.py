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


def engine(stage: int, seed: int = 0, lr: float = 1e-2, frozen: tuple[str, ...] = (), universal: bool = False) -> Any:
    """A DeepSpeed engine of :func:`model`; the parameters named in ``frozen`` are not trained (nor optimized).

    ``universal``: configured to load universal checkpoints (``ds_to_universal``'s output).
    """
    deepspeed = _deepspeed()
    net = model(seed)
    for name, param in net.named_parameters():
        param.requires_grad_(name not in frozen)
    # two groups, as GPT-NeoX's (weight decay on the weights, none on the biases): two flat ZeRO groups
    weights = [p for n, p in net.named_parameters() if n.endswith("weight") and n not in frozen]
    biases = [p for n, p in net.named_parameters() if not n.endswith("weight") and n not in frozen]
    groups = [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}]
    optimizer = torch.optim.Adam(groups, lr=lr)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if universal:
        config["checkpoint"] = {"load_universal": True}
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
    eng.save_16bit_model(stock_dir, "model.pt")  # one file beside the tags, through the checkpoint engine
    use(eng)
    eng.save_checkpoint(ours_dir, tag="global_step3", client_state=client)
    eng.save_16bit_model(ours_dir, "model.pt")
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


def load_stock_and_converted(
    rank: int, world: int, directory: str, converted: str, stage: int, converted3: str, frozen3: str
) -> dict[str, Any]:
    """:func:`load_stock` of ``directory``, then DeepSpeed's own engine loads ``convert --to deepspeed``'s files
    (``converted`` at ``stage``, ``converted3`` at ZeRO-3, ``frozen3`` at ZeRO-3 with ``0.bias`` frozen)."""
    stock = load_stock(rank, world, directory, stage)
    eng = engine(stage, seed=1)
    result = {"stock": stock, "converted": _loaded(eng, *eng.load_checkpoint(converted))}
    eng3 = engine(3, seed=1)
    result["converted3"] = _loaded(eng3, *eng3.load_checkpoint(converted3))
    frozen = engine(3, seed=1, frozen=("0.bias",))
    return result | {"frozen3": _loaded(frozen, *frozen.load_checkpoint(frozen3))}


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


def load_universal(rank: int, world: int, directory: str, tag: str, stage: int) -> dict[str, Any]:
    """An engine configured for universal checkpoints, with shardpoint's engine, loads ``tag`` (ds_to_universal's)."""
    from shardpoint.integrations.deepspeed import use

    eng = engine(stage, seed=1, universal=True)
    use(eng)
    path, _ = eng.load_checkpoint(directory, tag=tag)
    return {"path": path, "params": params(eng), "losses": train(eng, 2, 3)}


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
        if not param.requires_grad:
            continue  # frozen: no optimizer state
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


def reshard_load(
    rank: int, world: int, directory: str, stage: int, stock: str | None = None, save_to: str | None = None
) -> dict[str, Any]:
    """A fresh engine (other seed) at ``world`` ranks loads the reshardable checkpoint.

    With ``stock``, another fresh engine then loads that directory of DeepSpeed's own files
    with DeepSpeed's own engine (``result["stock"]``), in the same launch. With ``save_to``
    the loaded engine saves again there in the reshardable mode, unchanged.
    """
    from shardpoint.integrations.deepspeed import load_checkpoint, save_checkpoint

    eng = engine(stage, seed=1)
    path, client = load_checkpoint(eng, directory)
    result = _loaded(eng, path, client)
    if save_to is not None:
        save_checkpoint(eng, save_to, client_state=client)
    if stock is not None:
        other = engine(stage, seed=1)
        result["stock"] = _loaded(other, *other.load_checkpoint(stock))
    return result


def _loaded(eng: Any, path: str, client: dict[str, Any]) -> dict[str, Any]:
    return {
        "path": path,
        "client": client,
        "state": full_state(eng),
        "params": params(eng),
        "step": int(next(iter(eng.optimizer.optimizer.state.values()))["step"]),
        "global_steps": eng.global_steps,
    }


# ------------------------------------------------------------------ async, upload, retention, preemption


def _latest(directory: str) -> str | None:
    path = Path(directory) / "latest"
    return path.read_text() if path.exists() else None


def engine_in_background(rank: int, world: int, directory: str, stock_dir: str, remote: str) -> dict[str, Any]:
    """Engine mode with async_save, keep_last=2 and upload_to: saves at steps 2, 4 and 6 (ZeRO-2).

    The write of global_step4 starts 1 s late on every rank, so ``latest`` is seen on
    global_step2 after ``save_checkpoint`` returned and after step 5 trained, and on
    global_step4 only after the commit; step 5 changed the weights meanwhile, so the files
    hold step 4 only if the save wrote a copy. DeepSpeed's own engine saves the same step-4
    state into ``stock_dir`` first.
    """
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from shardpoint.errors import CheckpointError
    from shardpoint.integrations.deepspeed import use

    eng = engine(2)
    ours = use(eng, async_save=True, keep_last=2, upload_to=remote)
    seen: dict[str, Any] = {"refused": []}
    if rank == 0:  # a tag another tool wrote (no shardpoint.json): never written over
        os.makedirs(f"{directory}/global_step1")
        Path(f"{directory}/global_step1/theirs.pt").write_bytes(b"theirs")
    torch.distributed.barrier()
    # keep_last and upload_to read DeepSpeed's default tag names: another is refused too. Each refusal
    # reaches every rank and leaves nothing pending (the steps after it commit nothing)
    for tag in ("final", "global_step1"):
        try:
            eng.save_checkpoint(directory, tag=tag)
        except CheckpointError as exc:
            seen["refused"].append(str(exc))
    train(eng, 2)
    eng.save_checkpoint(directory, tag="global_step2", client_state={"iteration": 2})
    train(eng, 2, 2)
    eng.checkpoint_engine = TorchCheckpointEngine(eng._config)  # DeepSpeed's own engine, the same state
    eng.save_checkpoint(stock_dir, tag="global_step4", client_state={"iteration": 4})
    eng.checkpoint_engine = ours
    os.environ["SHARDPOINT_FAULT"] = "point=before-data,action=stall,seconds=1"
    eng.save_checkpoint(directory, tag="global_step4", client_state={"iteration": 4})
    seen["stall"] = ours.last_stall_seconds
    seen["latest_after_return"] = _latest(directory)
    train(eng, 1, 4)  # DeepSpeed asks for the commit at this step: not every rank has written yet
    seen["latest_after_step"] = _latest(directory)
    ours.wait()  # every rank: the write is done, then committed
    seen["latest_after_commit"] = _latest(directory)
    del os.environ["SHARDPOINT_FAULT"]
    train(eng, 1, 5)
    eng.save_checkpoint(directory, tag="global_step6", client_state={"iteration": 6})
    ours.cleanup()  # what engine.destroy() calls: the last save committed and uploaded
    seen["latest_at_end"] = _latest(directory)
    return seen


def train_noisy(eng: Any, steps: int, start: int = 0) -> list[float]:
    """:func:`train` with noise from the global torch RNG, seeded per rank: a resume must restore each rank's RNG."""
    losses = []
    rank = torch.distributed.get_rank()
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(2, 6, generator=gen) + 0.1 * torch.randn(2, 6)
        loss = eng(x).pow(2).mean()
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def preempted(rank: int, world: int, directory: str) -> dict[str, Any]:
    """An uninterrupted run of 6 steps, then the same run where rank 1 gets SIGTERM during step 3 (reshardable mode)."""
    import signal

    from shardpoint.integrations.deepspeed import SaveOnPreemption

    first = engine(2)
    torch.manual_seed(100 + rank)  # after the engine: model() seeds every rank alike
    uninterrupted = train_noisy(first, 6)
    eng = engine(2)
    torch.manual_seed(100 + rank)
    stopped = None
    with SaveOnPreemption(eng, directory, client_state=lambda: {"iteration": eng.global_steps}, reshardable=True) as p:
        for step in range(6):
            train_noisy(eng, 1, step)
            if step == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would; rank 0 is not signalled
            if p.check():
                stopped = step + 1
                break
    return {"uninterrupted": uninterrupted, "stopped": stopped, "latest": _latest(directory)}


def resume_preempted(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A fresh job (other seed, other RNG) resumes the preempted run and trains to step 6."""
    from shardpoint.integrations.deepspeed import load_checkpoint

    eng = engine(2, seed=1)
    torch.manual_seed(7)
    _, client = load_checkpoint(eng, directory)
    done = client["iteration"]
    return {"iteration": done, "losses": train_noisy(eng, 6 - done, done)}


def async_save_killed(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Engine mode, async: global_step2 committed; rank 1 is SIGKILLed writing global_step4 in the background."""
    from shardpoint.integrations.deepspeed import use

    eng = engine(2)
    ours = use(eng, async_save=True)
    train(eng, 2)
    eng.save_checkpoint(directory, tag="global_step2", client_state={"iteration": 2})
    ours.wait()
    torch.save(params(eng), f"{directory}/expected_{rank}.pt")
    train(eng, 2, 2)
    # rank 1 starts writing 1 s late, then dies: rank 0 asks for the commit meanwhile
    os.environ["SHARDPOINT_FAULT"] = "point=before-data,rank=1,action=stall,seconds=1;point=mid-data,rank=1,action=kill"
    eng.save_checkpoint(directory, tag="global_step4", client_state={"iteration": 4})
    train(eng, 2, 4)  # rank 0: the commit's gather finds rank 1 gone
    ours.wait()
    return {}


def engine_mode_preempted(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Engine mode with async_save: uninterrupted for 6 steps, then SIGTERM to rank 1 during step 3.

    Engine mode keeps DeepSpeed's files, where ``client_state`` comes from data-parallel
    rank 0 only: the batches here depend on the step and rank alone, not on an RNG.
    """
    import signal

    from shardpoint.integrations.deepspeed import SaveOnPreemption, use

    uninterrupted = train(engine(2), 6)
    eng = engine(2)
    use(eng, async_save=True)
    stopped = None
    with SaveOnPreemption(eng, directory, client_state=lambda: {"iteration": eng.global_steps}) as p:
        for step in range(6):
            train(eng, 1, step)
            if step == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if p.check():
                stopped = step + 1
                break
    return {"uninterrupted": uninterrupted, "stopped": stopped, "latest": _latest(directory)}


def resume_engine_mode(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A fresh engine (other seed) resumes the engine-mode run preempted at step 3 and trains to step 6."""
    from shardpoint.integrations.deepspeed import use

    eng = engine(2, seed=1)
    use(eng)
    _, client = eng.load_checkpoint(directory)
    done = client["iteration"]
    return {"iteration": done, "losses": train(eng, 6 - done, done)}


def in_background_then_preempted(
    rank: int, world: int, directory: str, stock_dir: str, remote: str, preempted_dir: str, engine_dir: str | None
) -> dict[str, Any]:
    """:func:`engine_in_background`, then :func:`preempted` (and :func:`engine_mode_preempted`), in one launch."""
    return {
        "background": engine_in_background(rank, world, directory, stock_dir, remote),
        "preempted": preempted(rank, world, preempted_dir),
        "engine_preempted": engine_mode_preempted(rank, world, engine_dir) if engine_dir else None,
    }


def resume_all(rank: int, world: int, preempted_dir: str, killed_dir: str, engine_dir: str | None) -> dict[str, Any]:
    """One launch for the restarts: the preempted runs (reshardable, engine mode) and the one killed mid async save."""
    return {
        "preempted": resume_preempted(rank, world, preempted_dir),
        "killed": load_ours(rank, world, killed_dir, 2),
        "engine_preempted": resume_engine_mode(rank, world, engine_dir) if engine_dir else None,
    }
