"""The ranks' side of the seam matrix (tests/test_seams.py): a job with one feature on one store, and a fault.

Every job is two gloo ranks, each its own "node" (its own ``node<rank>`` folder), on the
toy model with a frozen base (so stored-once references are made whatever the feature).
Training is deterministic: the state at iteration ``i`` of a data ``variant`` is what
:func:`replay` computes from scratch, so a load is checked bit for bit against the
iteration it says it loaded, not against what the test hoped for.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

import shardpoint as sp
from shardpoint.errors import CheckpointError, ConcurrentSaveError
from tests import toy

FROZEN = ("embed.", "layers.0.", "layers.1.")


def frozen_state(topo: sp.Topology) -> sp.TrainState:
    toy.seed_rng(topo, seed=11)
    state = toy.build(topo)
    for key in state.model.specs:
        state.model.param(key).requires_grad_(not key.startswith(FROZEN))
    return state


def _step(state: sp.TrainState, step: int, variant: int) -> None:
    toy.train_step(state, step + variant, noise=False)


def replay(topo: sp.Topology, steps: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """The tensors a run holds after ``steps`` ((step, variant) pairs) from scratch."""
    state = frozen_state(topo)
    for step, variant in steps:
        _step(state, step, variant)
    return {k: t for k, (_, _, t) in toy.snapshot(state)["tensors"].items()}


def checkpointer(rank: int, base: str, store: str, feature: str, **extra: Any) -> sp.Checkpointer:
    topo = sp.Topology(1, 1, 2)
    options: dict[str, Any] = dict(topology=topo, config={"toy": 1}, round_timeout=60, **extra)
    if feature == "local-tier":
        options.update(local_dir=f"{base}/node{rank}/tier", local_interval=1, local_replicas=1, save_interval=100)
    if feature == "async":
        options.update(async_save=True)
    if feature == "upload_to":
        return sp.Checkpointer(f"{base}/node{rank}/parts", upload_to=store, **options)
    return sp.Checkpointer(store, **options)


def _save(ckpt: sp.Checkpointer, feature: str, iteration: int, state: sp.TrainState, persistent: bool) -> None:
    if feature == "local-tier" and not persistent:
        ckpt.maybe_save(iteration, state)  # the local tier's every step
    else:
        ckpt.save(iteration, state)


def train(rank: int, world: int, base: str, store: str, feature: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Load what is there, then train and save ``plan["steps"]`` ((step, variant) pairs).

    ``plan["fault_at"]``: the step whose save runs under ``plan["fault"]`` (a SHARDPOINT_FAULT
    spec); ``plan["persistent"]``: steps saved to the persistent store even with the local tier;
    ``plan["load_iteration"]``: load that iteration instead of the newest; ``plan["gate"]``: a file
    both writers of a race create and wait for, so their saves start at the same instant.
    """
    topo = sp.Topology(1, 1, 2)
    state = frozen_state(topo)
    ckpt = checkpointer(rank, base, store, feature)
    result = ckpt.load(state, iteration=plan.get("load_iteration"))
    out: dict[str, Any] = {"loaded": None if result is None else result.iteration, "saved": [], "error": None}
    for step, variant in plan["steps"]:
        _step(state, step, variant)
        if step == plan.get("fault_at"):
            os.environ["SHARDPOINT_FAULT"] = plan["fault"]
        if step == plan.get("race_at"):
            _meet(Path(plan["gate"]), plan["who"])
        try:
            _save(ckpt, feature, step, state, step in plan.get("persistent", ()))
            ckpt.wait()
            out["saved"].append(step)
        except ConcurrentSaveError as exc:
            out["error"] = f"ConcurrentSaveError: {exc}"
        except CheckpointError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        os.environ.pop("SHARDPOINT_FAULT", None)
    try:
        ckpt.close()
    except CheckpointError as exc:
        out["error"] = out["error"] or f"{type(exc).__name__}: {exc}"
    return out


def _meet(gate: Path, who: str) -> None:
    """Both jobs of a race arrive before either saves (rank 0 of each writes its mark)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        (gate / who).touch()
        deadline = time.monotonic() + 60
        while len(list(gate.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
    dist.barrier()


def check(
    rank: int, world: int, base: str, store: str, feature: str, candidates: dict[int, dict[str, list]]
) -> dict[str, Any]:
    """What a restart finds, without and with ``fallback``: the iteration (or error) and which history it equals.

    ``candidates[i]`` names the histories iteration ``i`` may hold (label -> (step, variant)
    pairs); the loaded tensors must equal one of them bit for bit.
    """
    topo = sp.Topology(1, 1, 2)
    out: dict[str, Any] = {}
    for fallback in (False, True):
        state = frozen_state(topo)
        for p in state.model.parameters():
            p.data.add_(1000.0)  # nothing of these values may survive a load
        ckpt = checkpointer(rank, base, store, feature)
        try:
            result = ckpt.load(state, fallback=fallback)
        except CheckpointError as exc:
            out[fallback] = {"iteration": None, "error": f"{type(exc).__name__}: {exc}"}
            continue
        finally:
            ckpt.close()
        if result is None:
            out[fallback] = {"iteration": None, "error": None}
            continue
        got = {k: t for k, (_, _, t) in toy.snapshot(state)["tensors"].items()}
        matches = [
            label
            for label, steps in candidates.get(result.iteration, {}).items()
            if _equal(got, replay(topo, [tuple(s) for s in steps]))
        ]
        out[fallback] = {"iteration": result.iteration, "error": None, "matches": matches}
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
