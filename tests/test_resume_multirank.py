"""Save and resume at the same layout on real gloo processes (tp=2, pp=2, dp=2)."""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from tests import toy
from tests.distributed import launch

CONFIG = {"num_layers": toy.LAYERS, "hidden_size": toy.HIDDEN}


def _train_save_continue(rank: int, world: int, root: str, fmt: str, zero: bool, layout: str):
    topo = sp.Topology(2, 2, 2)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=zero)
    ckpt = sp.Checkpointer(root, topology=topo, format=fmt, layout=layout, config=CONFIG, save_interval=3)
    for step in range(1, 6):
        toy.train_step(state, step)
        ckpt.maybe_save(step, state)
    at_save = None
    return {"final": toy.snapshot(state), "at_save": at_save}


def _resume_continue(rank: int, world: int, root: str, fmt: str, zero: bool, layout: str):
    topo = sp.Topology(2, 2, 2)
    toy.seed_rng(topo, seed=999)  # wrong seed on purpose: the checkpoint's RNG must win
    state = toy.build(topo, zero=zero)
    ckpt = sp.Checkpointer(root, topology=topo, format=fmt, layout=layout, config=CONFIG, save_interval=3)
    result = ckpt.load(state)
    for step in range(result.iteration + 1, 6):
        toy.train_step(state, step)
    return {"final": toy.snapshot(state), "iteration": result.iteration, "extra": result.extra}


@pytest.mark.parametrize(
    "fmt,zero,layout",
    [("torch", False, "megatron"), ("torch", True, "neox"), ("dist", False, "megatron"), ("dist", True, "megatron")],
)
def test_exact_resume_same_layout(tmp_path, fmt, zero, layout):
    root = str(tmp_path / "run")
    uninterrupted = launch(_train_save_continue, 8, root, fmt, zero, layout)
    resumed = launch(_resume_continue, 8, root, fmt, zero, layout)
    assert {r["iteration"] for r in resumed} == {3}
    assert resumed[0]["extra"] == {"consumed_samples": 24}
    for before, after in zip(uninterrupted, resumed):
        a, b = before["final"], after["final"]
        assert a["tensors"].keys() == b["tensors"].keys()
        for key in a["tensors"]:
            assert torch.equal(a["tensors"][key][2], b["tensors"][key][2]), key
        assert a["lr"] == b["lr"] and a["sched"] == b["sched"] and a["extra"] == b["extra"]
        assert torch.equal(a["rng"], b["rng"])
    tracker = "latest_checkpointed_iteration.txt" if layout == "megatron" else "latest"
    assert (tmp_path / "run" / tracker).read_text() == ("3" if layout == "megatron" else "global_step3")


def _save_load_without_dp(rank: int, world: int, root: str):
    topo = sp.Topology(2, 1, 1)
    toy.seed_rng(topo)
    state = toy.build(topo)
    toy.train_step(state, 1)
    sp.Checkpointer(root, topology=topo, format="torch").save(1, state)
    fresh = toy.build(topo)
    sp.Checkpointer(root, topology=topo).load(fresh)
    return toy.snapshot(state), toy.snapshot(fresh)


def test_torch_format_without_data_parallelism(tmp_path):
    """dp=1 with several ranks: the per-dp gathers must not become world collectives (they hung once)."""
    for saved, loaded in launch(_save_load_without_dp, 2, str(tmp_path / "run"), timeout=60):
        for key, (_, _, tensor) in saved["tensors"].items():
            assert torch.equal(loaded["tensors"][key][2], tensor), key
