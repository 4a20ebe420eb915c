"""Pipeline and expert parallelism through ``shardpoint.integrations.megatron``, in ONE 2-rank job.

Used by ``tests/test_integration_megatron_parallel.py``. Phases (each under its own
directory of ``root``): a GPTModel at pp=2 (one stage per rank) saved and resumed
bit-exact, then loaded at pp=1 dp=2; a mixture-of-experts GPTModel (4 experts, ep=2)
saved and resumed bit-exact, then loaded at ep=1. Each phase returns what the tests
compare with shardpoint's offline reader.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from tests import integration_megatron_worker as worker
from tests.integration_megatron_flags import differ, finish, session


class _ExtraState:
    """``get_extra_state`` / ``set_extra_state`` as Transformer Engine's modules have them (their FP8
    metadata): megatron-core's ``sharded_state_dict`` then gives a ``ShardedObject`` per layer."""

    def get_extra_state(self) -> Any:
        return getattr(self, "sp_extra", {"steps": 0, "tag": "fresh"})

    def set_extra_state(self, state: Any) -> None:
        self.sp_extra = state


def with_extra_state(job: worker.Job) -> worker.Job:
    """Each layer's linear_qkv gets an extra state (a mixin on its class, as without TE none has one)."""
    for module in job.model[0].modules():
        qkv = getattr(getattr(module, "self_attention", None), "linear_qkv", None)
        if qkv is not None:
            qkv.__class__ = type("WithExtraState", (_ExtraState, type(qkv)), {})
    return job


def extra_states(job: worker.Job) -> dict[int, Any]:
    """Each layer's extra state by its global layer number (TransformerLayer.layer_number is 1-based)."""
    return {
        module.layer_number - 1: module.self_attention.linear_qkv.get_extra_state()
        for module in job.model[0].modules()
        if hasattr(module, "layer_number") and hasattr(module, "self_attention")
    }


def train_step(job: worker.Job, step: int, vocab: int = worker.VOCAB) -> float:
    """One step through megatron-core's own schedule (1F1B across the stages at pp>1)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp = job.model[0]
    ddp.zero_grad_buffer()
    job.optimizer.zero_grad()
    tokens, labels = worker.batch(step, vocab)
    position_ids = torch.arange(worker.SEQ).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator: Any, model: Any) -> Any:
        output = model(tokens, position_ids, None, labels=labels)

        def loss_func(out: torch.Tensor) -> Any:
            loss = out.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=None, model=job.model, num_microbatches=1,
        seq_length=worker.SEQ, micro_batch_size=2, forward_only=False,
    )  # fmt: skip
    ddp.finish_grad_sync()
    job.optimizer.step()
    job.scheduler.step(increment=1)
    job.args.consumed_train_samples += 2
    return float(losses[0]["loss"]) if losses else 0.0


def full_state(job: worker.Job) -> dict[str, torch.Tensor]:
    """Every model tensor and optimizer state at full size, gathered on every rank (stages hold other keys)."""
    from shardpoint.integrations.megatron.state import MegatronModel, optimizer_state

    model = MegatronModel(job.model).sharded_state_dict()
    optim = optimizer_state(job.optimizer).sharded_state_dict({"model." + k: v for k, v in model.items()})
    mine = {p + k: s for p, shards in (("model.", model), ("optimizer.state.", optim)) for k, s in shards.items()}
    shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, {k: (tuple(s.global_shape), s.tensor.dtype) for k, s in mine.items()})
    everything = {k: v for d in shapes for k, v in d.items()}
    out = {}
    for key in sorted(everything):
        shape, dtype = everything[key]
        full = torch.zeros(shape, dtype=torch.float64)  # every dtype's values, summed exactly
        shard = mine.get(key)
        if shard is not None and shard.replica_id == 0:
            box = tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.tensor.shape))
            full[box] = shard.tensor.to(torch.float64)
        dist.all_reduce(full)
        out[key] = full.to(dtype)
    return out


def resume(root: str, **shape: Any) -> dict[str, Any]:
    """Train 2 steps, save, train 1; a fresh job (other seed) loads and redoes it: all bit-equal?"""
    job = with_extra_state(worker.build(**shape))
    job.args = worker.args(root)
    s = session(job)
    for step in (1, 2):
        train_step(job, step)
    for layer in extra_states(job):  # what TE would have after 2 steps
        module_state = {"steps": 2, "layer": layer, "amax": torch.full((3,), float(layer) + 0.5), "tag": "trained"}
        _set_extra(job, layer, module_state)
    objects = extra_states(job)
    saved = full_state(job)
    s.save_checkpoint(2, job.model, job.optimizer, job.scheduler, 9.0)
    first = train_step(job, 3)
    end = full_state(job)
    finish(s)
    again = with_extra_state(worker.build(seed=99, **shape))
    again.args = worker.args(root)
    s = session(again)
    returned = s.load_checkpoint(again.model, again.optimizer, again.scheduler)
    loaded = full_state(again)
    objects_loaded = extra_states(again)
    second = train_step(again, 3)
    finish(s)
    return {
        "returned": returned, "keys": sorted(saved), "loaded_differs": differ(saved, loaded),
        "losses": (first, second), "end_differs": differ(end, full_state(again)), "saved": saved,
        "objects": objects, "objects_loaded": objects_loaded,
    }  # fmt: skip


def _set_extra(job: worker.Job, layer: int, state: Any) -> None:
    for module in job.model[0].modules():
        if getattr(module, "layer_number", None) == layer + 1 and hasattr(module, "self_attention"):
            module.self_attention.linear_qkv.set_extra_state(state)


def reshard(root: str, **shape: Any) -> dict[str, Any]:
    """Load what another layout saved; every tensor at full size, and a step trained on."""
    job = with_extra_state(worker.build(**shape))
    job.args = worker.args(root)
    s = session(job)
    returned = s.load_checkpoint(job.model, job.optimizer, job.scheduler)
    state = full_state(job)
    train_step(job, 3)
    finish(s)
    return {"returned": returned, "state": state, "objects": extra_states(job)}


# 50 tokens padded to multiples of 8 x tp: 64 rows at tp=2, 56 at tp=1 (the true vocabulary is not recorded)
TOKENS = 50


def vocab_args(root: str, tp: int, rows: int) -> Any:
    return worker.args(root, padded_vocab_size=rows, make_vocab_size_divisible_by=8, tensor_model_parallel_size=tp)


def vocab_resize(root: str) -> dict[str, Any]:
    """tp=2 (64 rows) saved; tp=1 (56 rows) loads it, trains, saves; tp=2 loads that; tp=1 at 40 rows is refused."""
    job = worker.build(2, vocab=64)
    job.args = vocab_args(f"{root}/tp2", 2, 64)
    s = session(job)
    train_step(job, 1, TOKENS)
    s.save_checkpoint(1, job.model, job.optimizer, job.scheduler, 9.0)
    finish(s)
    out: dict[str, Any] = {}
    for name, tp, rows, load, save in (("trim", 1, 56, "tp2", "tp1"), ("pad", 2, 64, "tp1", None)):
        job = worker.build(tp, vocab=rows, seed=99)
        job.args = vocab_args(f"{root}/{load}", tp, rows)
        s = session(job)
        s.load_checkpoint(job.model, job.optimizer, job.scheduler)
        out[name] = full_state(job)
        if save:
            job.args.save = f"{root}/{save}"
            train_step(job, 2, TOKENS)  # the resized job trains on
            out[f"{name}_saved"] = full_state(job)
            s.save_checkpoint(2, job.model, job.optimizer, job.scheduler, 9.0)
        finish(s)
    job = worker.build(1, vocab=40)  # another tokenizer: 40 rows would drop real tokens of the 64
    job.args = vocab_args(f"{root}/tp2", 1, 40)
    s = session(job)
    try:
        s.load_checkpoint(job.model, job.optimizer, job.scheduler)
        out["refused"] = None
    except Exception as exc:  # noqa: BLE001 - the test names the class and message
        out["refused"] = (type(exc).__name__, str(exc))
    finish(s)
    return out


def run(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"seconds": {}}
    phases = {
        "pp2": lambda: resume(f"{root}/pp", tp=1, pp=2),
        "pp1_dp2": lambda: reshard(f"{root}/pp", tp=1, pp=1),
        "ep2": lambda: resume(f"{root}/moe", tp=1, experts=4, ep=2),
        "ep1": lambda: reshard(f"{root}/moe", tp=1, experts=4, ep=1),
        "vocab": lambda: vocab_resize(f"{root}/vocab"),
    }
    for name, phase in phases.items():
        start = time.perf_counter()
        out[name] = phase()
        out["seconds"][name] = round(time.perf_counter() - start, 2)
    return out


def run_full(rank: int, world: int, root: str) -> dict[str, Any]:
    """4 ranks (``SHARDPOINT_MEGATRON_FULL=1``): tp=2 pp=2, and MoE at pp=2 ep=2 dp=2, each resumed and resharded
    (MoE with tp > 1 needs sequence parallelism, which megatron-core's torch LayerNorm refuses on CPU)."""
    out: dict[str, Any] = {"seconds": {}}
    phases = {
        "tp2pp2": lambda: resume(f"{root}/tp2pp2", tp=2, pp=2),
        "tp1pp2dp2": lambda: reshard(f"{root}/tp2pp2", tp=1, pp=2),
        "pp2ep2": lambda: resume(f"{root}/moe", tp=1, pp=2, experts=4, ep=2),
        "pp1ep4": lambda: reshard(f"{root}/moe", tp=1, experts=4, ep=4),
    }
    for name, phase in phases.items():
        start = time.perf_counter()
        out[name] = phase()
        out["seconds"][name] = round(time.perf_counter() - start, 2)
    return out
