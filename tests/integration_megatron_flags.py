"""Megatron's flags through ``shardpoint.integrations.megatron``, phase by phase, in ONE 2-rank job.

Used by ``tests/test_integration_megatron_flags.py``: starting ranks and importing
megatron-core costs most of a launch, so every phase runs in the same two gloo processes
and returns what the tests assert (booleans, key lists, error texts: small results).
Each phase builds its own megatron-core job (:mod:`tests.integration_megatron_worker`)
under its own directory of ``root``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from tests import integration_megatron_worker as worker


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors are not bit-equal (or that only one side has)."""
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def session(job: worker.Job) -> Any:
    from shardpoint.integrations.megatron.loop import Session

    return Session({}, get_args=lambda: job.args)


def finish(s: Any) -> None:
    s.maybe_finalize_async_save(blocking=True, terminate=True)


def train(job: worker.Job, steps: tuple[int, ...]) -> list[float]:
    losses = []
    for step in steps:
        losses.append(worker.train_step(job, step))
        job.args.consumed_train_samples += 2
    return losses


def resume(root: str, tp: int, **kind: Any) -> dict[str, Any]:
    """Train a step, save, train one more; a fresh job (other seed) loads and redoes it: all equal?"""
    job = worker.build(tp, **kind)
    job.args = worker.args(root)
    s = session(job)
    train(job, (1,))
    saved = worker.full_state(job)
    s.save_checkpoint(1, job.model, job.optimizer, job.scheduler, 7.0)
    first = train(job, (2,))
    end = worker.full_state(job)
    finish(s)
    again = worker.build(tp, seed=99, **kind)
    again.args = worker.args(root)
    s = session(again)
    returned = s.load_checkpoint(again.model, again.optimizer, again.scheduler)
    loaded = worker.full_state(again)
    second = train(again, (2,))
    finish(s)
    return {
        "returned": returned, "keys": sorted(saved), "loaded_differs": differ(saved, loaded),
        "losses": (first, second), "end_differs": differ(end, worker.full_state(again)), "saved": saved,
    }  # fmt: skip


def optimizer_kinds(root: str) -> dict[str, Any]:
    """Without --use-distributed-optimizer: fp32 at tp=2, bf16 (fp32 master copies) at dp=2; a bare torch optimizer."""
    out: dict[str, Any] = {
        "fp32": resume(f"{root}/fp32", 2, distributed=False),
        "bf16": resume(f"{root}/bf16", 1, distributed=False, bf16=True),
    }
    job = worker.build(1)
    job.args = worker.args(f"{root}/refused")
    s = session(job)
    try:
        s.save_checkpoint(1, job.model, torch.optim.SGD(job.model[0].parameters(), lr=0.1), None, 0.0)
        out["refused"] = None
    except Exception as exc:  # noqa: BLE001 - the test asserts its type and text
        out["refused"] = (type(exc).__name__, str(exc), os.path.exists(f"{root}/refused"))
    finish(s)
    return out


def finetune(root: str, expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    """--finetune from the fp32 phase's checkpoint: weights loaded; optimizer, RNG, iteration and samples not."""
    from megatron.core import tensor_parallel

    job = worker.build(2, seed=99, distributed=False)
    job.args = worker.args(f"{root}/fp32", finetune=True)
    fresh = worker.full_state(job)
    rng = {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    s = session(job)
    returned = s.load_checkpoint(job.model, job.optimizer, job.scheduler)
    after = worker.full_state(job)
    rng_after = tensor_parallel.get_cuda_rng_tracker().get_states()
    finish(s)
    model = [k for k in after if k.startswith("model.")]
    optim = [k for k in after if k.startswith("optimizer.")]
    return {
        "returned": returned, "samples": job.args.consumed_train_samples,
        "model_differs": differ({k: expected[k] for k in model}, {k: after[k] for k in model}),
        "optimizer_differs_from_fresh": differ({k: fresh[k] for k in optim}, {k: after[k] for k in optim}),
        "rng_kept": all(torch.equal(v, rng_after[k]) for k, v in rng.items()),
    }  # fmt: skip


def retain(root: str) -> dict[str, Any]:
    """--save-retain-interval 2, saves at 1..4: the newest and every 2nd stay."""
    job = worker.build(1)
    job.args = worker.args(root, save_retain_interval=2)
    s = session(job)
    for it in (1, 2, 3, 4):
        s.save_checkpoint(it, job.model, job.optimizer, job.scheduler, 0.0)
    finish(s)
    return {"kept": sorted(n for n in os.listdir(root) if n.startswith("iter_"))}


def rerun_machine(pending_at: int | None) -> dict[str, Any] | None:
    """A fresh rerun state machine (``--rerun-mode validate_results``), with a rerun pending at ``pending_at``
    (as Megatron has it when a result failed validation twice: its checkpoint is then saved); None: disabled.
    Returns what the machine holds now."""
    from megatron.core import rerun_state_machine as rsm

    rsm.destroy_rerun_state_machine()
    mode = rsm.RerunMode.DISABLED if pending_at is None else rsm.RerunMode.VALIDATE_RESULTS
    rsm.initialize_rerun_state_machine(mode=mode)
    machine = rsm.get_rerun_state_machine()
    if pending_at:
        machine.state = rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT
        machine.current_iteration = pending_at
        machine.failed_validation_call = rsm.Call(rsm.Caller("loss is NaN", dist.get_rank()), pending_at)
        machine.initial_result = torch.tensor(pending_at + 0.5)
        machine.suspicious_node, machine.max_values = f"node{dist.get_rank()}", {"grad norm": float(pending_at)}
    return _machine_state(machine)


def _machine_state(machine: Any) -> dict[str, Any]:
    result = machine.initial_result
    return {
        "state": machine.state.name, "iteration": machine.current_iteration,
        "call": machine.failed_validation_call, "result": None if result is None else float(result),
        "node": machine.suspicious_node, "max_values": machine.max_values,
    }  # fmt: skip


def _listed(job: worker.Job) -> dict[int, Any]:
    """Each layer's extra state, its tensors as lists (compared with ==)."""
    from tests.integration_megatron_parallel import extra_states

    def plain(v: Any) -> Any:
        return v.tolist() if isinstance(v, torch.Tensor) else v

    return {layer: {k: plain(v) for k, v in state.items()} for layer, state in extra_states(job).items()}


def local_tier(root: str) -> dict[str, Any]:
    """--non-persistent-ckpt-type local with --replication: lose node 0's copy (replica), then both (persistent).

    Each save carries its own extra state (Transformer Engine's ``_extra_state``) and a pending rerun
    of the rerun state machine; each resume must bring back those of the checkpoint it loaded."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    from tests.integration_megatron_parallel import _set_extra, extra_states, with_extra_state

    rank = dist.get_rank()
    flags = dict(
        non_persistent_save_interval=2, non_persistent_ckpt_type="local", replication=True, replication_factor=2,
        non_persistent_local_ckpt_dir=f"{root}/node{rank}",
    )  # fmt: skip
    job = with_extra_state(worker.build(1))
    job.args = worker.args(f"{root}/persistent", **flags)
    s = session(job)
    states: dict[int, Any] = {}
    objects: dict[int, Any] = {}
    rerun: dict[int, Any] = {}
    for it, kwargs in ((2, {}), (4, {"non_persistent_ckpt": True})):
        train(job, (it - 1, it))
        for layer in extra_states(job):
            _set_extra(job, layer, {"saved_at": it, "layer": layer, "amax": torch.full((2,), it + layer + 0.25)})
        states[it], objects[it], rerun[it] = worker.full_state(job), _listed(job), rerun_machine(pending_at=it)
        s.save_checkpoint(it, job.model, job.optimizer, job.scheduler, 0.0, **kwargs)
        rerun_machine(None)  # training goes on without the pending rerun
    finish(s)
    out = {"node_dirs": sorted(os.listdir(f"{root}/node{rank}"))}
    for lost, it, name in (((0,), 4, "node0_lost"), ((0, 1), 2, "both_lost")):
        if rank in lost:
            shutil.rmtree(f"{root}/node{rank}")
        dist.barrier()
        again = with_extra_state(worker.build(1, seed=99))
        again.args = worker.args(f"{root}/persistent", **flags)
        rerun_machine(pending_at=0)  # --rerun-mode validate_results, nothing pending
        s = session(again)
        returned = s.load_checkpoint(again.model, again.optimizer, again.scheduler)
        out[name] = {
            "returned": returned,
            "tier": s.last_load.tier,
            "differs": differ(states[it], worker.full_state(again)),
            "objects": (objects[it], _listed(again)),
            "rerun": (rerun[it], _machine_state(get_rerun_state_machine())),
        }
        rerun_machine(None)
        finish(s)
    return out


def strictness(root: str, standard: str) -> dict[str, Any]:
    """--dist-ckpt-strictness: a checkpoint with keys the job lacks, and a job with keys the checkpoint lacks."""
    qk = worker.build(1, qk_layernorm=True)
    qk.args = worker.args(f"{root}/qk")
    s = session(qk)
    s.save_checkpoint(1, qk.model, qk.optimizer, qk.scheduler, 0.0)
    finish(s)
    emb = "model.embedding.word_embeddings.weight"
    out: dict[str, Any] = {}
    plain = worker.build(1, seed=99)  # no q/k layer norms: the checkpoint holds keys it does not ask for
    for strict in ("assume_ok_unexpected", "raise_all"):
        out[f"extra_in_checkpoint/{strict}"] = _load(plain, f"{root}/qk", strict, worker.full_state(qk)[emb], emb)
    qk2 = worker.build(1, seed=99, qk_layernorm=True)  # asks for q/k layer norms the checkpoint lacks
    for strict in ("assume_ok_unexpected", "log_unexpected"):
        out[f"missing_in_checkpoint/{strict}"] = _load(qk2, standard, strict, None, emb)
    return out


def _load(job: worker.Job, root: str, strict: str, expected: torch.Tensor | None, key: str) -> dict[str, Any]:
    job.args = worker.args(root, dist_ckpt_strictness=strict)
    s = session(job)
    try:
        returned = s.load_checkpoint(job.model, job.optimizer, job.scheduler)
        error = None
    except Exception as exc:  # noqa: BLE001 - the test asserts its type and text
        returned, error = None, (type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc))
    finish(s)
    same = None if expected is None or error else torch.equal(worker.full_state(job)[key], expected)
    return {"returned": returned, "error": error, "same_weights": same}


def native(root: str) -> dict[str, Any]:
    """A checkpoint written by megatron-core's own ``dist_checkpointing.save`` (Megatron-LM's state dict, torch_dist).

    Without Megatron-LM's training code the job cannot load it itself: refused, naming
    ``shardpoint convert``. Converted once by that command, it resumes through shardpoint
    and the run saves on; the native checkpoint is never changed.
    """
    from shardpoint.integrations.megatron.loop import NativeCheckpointError

    job = worker.build(2, distributed=False)
    job.args = worker.args(f"{root}/native")
    train(job, (1, 2))
    saved = worker.full_state(job)
    _save_native(job, f"{root}/native", 2)
    before = _listing(f"{root}/native")
    again = worker.build(2, seed=99, distributed=False)
    out: dict[str, Any] = {}
    for name, save in (("same_save", f"{root}/native"), ("refused", f"{root}/other")):
        again.args = worker.args(f"{root}/native", save=save)
        try:
            session(again).load_checkpoint(again.model, again.optimizer, again.scheduler)
            out[name] = None
        except NativeCheckpointError as exc:
            out[name] = str(exc)
    if dist.get_rank() == 0:  # what the refusal says to run (outside the job: offline writes are one process)
        command = [sys.executable, "-m", "shardpoint.cli", "convert", "--from", "megatron", "-q"]
        subprocess.run([*command, f"{root}/native", f"{root}/imported"], check=True, timeout=240)
    dist.barrier()
    again.args = worker.args(f"{root}/imported")
    s = session(again)
    out["returned"] = s.load_checkpoint(again.model, again.optimizer, again.scheduler)
    out["differs"] = differ(saved, worker.full_state(again))
    train(again, (3,))
    s.save_checkpoint(3, again.model, again.optimizer, again.scheduler, 0.0)
    finish(s)
    with open(f"{root}/imported/latest_checkpointed_iteration.txt") as f:
        out["tracker"] = f.read().strip()
    out["native_untouched"] = before == _listing(f"{root}/native")
    return out


def _save_native(job: worker.Job, root: str, iteration: int) -> None:
    """What Megatron-LM's ``save_checkpoint`` writes with ``--ckpt-format torch_dist``, by megatron-core itself."""
    import argparse

    from megatron.core import dist_checkpointing

    from shardpoint.integrations.megatron.state import unwrap

    model = unwrap(job.model[0]).sharded_state_dict()  # Megatron-LM unwraps DDP and Float16Module first
    args = argparse.Namespace(**vars(job.args))
    args.__dict__.update(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, data_parallel_size=1, transformer_impl="local",
        untie_embeddings_and_output_weights=True, use_distributed_optimizer=False, iteration=iteration,
    )  # fmt: skip
    state = {
        "args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": model,
        "optimizer": job.optimizer.sharded_state_dict(model), "opt_param_scheduler": job.scheduler.state_dict(),
        "num_floating_point_operations_so_far": 7.0,
    }  # fmt: skip
    directory = f"{root}/iter_{iteration:07d}"
    if dist.get_rank() == 0:
        os.makedirs(directory)
    dist.barrier()
    dist_checkpointing.save(state, directory)
    if dist.get_rank() == 0:
        with open(f"{root}/latest_checkpointed_iteration.txt", "w") as f:
            f.write(str(iteration))
    dist.barrier()


def _listing(root: str) -> list[tuple[str, int, int]]:
    return sorted(
        (
            os.path.relpath(os.path.join(d, n), root),
            os.path.getsize(os.path.join(d, n)),
            int(os.path.getmtime(os.path.join(d, n)) * 1e6),
        )
        for d, _, names in os.walk(root)
        for n in names
    )


def checkpoint_args(root: str) -> dict[str, Any]:
    """--use-checkpoint-args reads ``megatron_args.json`` as the marker lists it: as saved, or refused.

    (Megatron-LM's ``load_args_from_checkpoint`` around it is run by ``scripts/megatron-check``.)
    """
    from shardpoint.integrations.megatron.loop import ARGS_FILE, committed_dir, saved_args

    found = committed_dir(root)
    args, iteration = saved_args(found)
    out: dict[str, Any] = {"iteration": iteration, "hidden_size": args.hidden_size, "num_layers": args.num_layers}
    dist.barrier()
    if dist.get_rank() == 0:  # one changed digit: still valid JSON, so only the checksum can tell
        path = os.path.join(found, ARGS_FILE)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data.replace(b'"hidden_size": 32', b'"hidden_size": 33'))
        try:
            out["changed"] = saved_args(found)[0].hidden_size
        except Exception as exc:  # noqa: BLE001 - the test asserts its type and text
            out["changed"] = (type(exc).__name__, str(exc))
    return out


def run(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every phase, in order (finetune reads the fp32 phase's checkpoint, strictness the retain phase's)."""
    clock = [(time.perf_counter(), time.process_time())]

    def timed(name: str, result: dict[str, Any]) -> None:  # wall and this rank's CPU seconds
        out[name] = result
        clock.append((time.perf_counter(), time.process_time()))
        out["seconds"][name] = tuple(round(b - a, 1) for a, b in zip(clock[-2], clock[-1]))

    out: dict[str, Any] = {"seconds": {}}
    timed("optimizers", optimizer_kinds(f"{root}/opt"))
    saved = {kind: out["optimizers"][kind].pop("saved") for kind in ("fp32", "bf16")}
    timed("finetune", finetune(f"{root}/opt", saved["fp32"]))
    timed("retain", retain(f"{root}/retain"))
    timed("local", local_tier(f"{root}/local"))
    timed("strictness", strictness(f"{root}/strict", f"{root}/retain"))
    timed("native", native(f"{root}/native"))
    timed("checkpoint_args", checkpoint_args(f"{root}/retain"))  # last: it damages that checkpoint
    return out
