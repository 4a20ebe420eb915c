"""The dist format reshards on load: save at (tp=2, pp=2, dp=2), load at other layouts, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import shardpoint as sp
from tests import toy
from tests.distributed import launch

SAVE_LAYOUT = (2, 2, 2)
LOAD_LAYOUTS = [(4, 1, 2), (1, 2, 4), (1, 1, 1), (2, 2, 2)]
STEPS_BEFORE, STEPS_AFTER = 3, 2


def _train_and_save(rank: int, world: int, root: str, zero: bool):
    topo = sp.Topology(*SAVE_LAYOUT)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=zero)
    for step in range(1, STEPS_BEFORE + 1):
        toy.train_step(state, step)
    sp.Checkpointer(root, topology=topo).save(STEPS_BEFORE, state)
    saved = toy.snapshot(state)
    for step in range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1):
        toy.train_step(state, step, noise=False)
    return {"saved": saved, "final": toy.snapshot(state)}


def _load_and_continue(rank: int, world: int, root: str, zero: bool, layout: tuple[int, int, int]):
    topo = sp.Topology(*layout)
    state = toy.build(topo, zero=zero)
    result = sp.Checkpointer(root, topology=topo).load(state)
    loaded = toy.snapshot(state)
    for step in range(result.iteration + 1, result.iteration + STEPS_AFTER + 1):
        toy.train_step(state, step, noise=False)
    return {"loaded": loaded, "final": toy.snapshot(state), "iteration": result.iteration}


@pytest.fixture(scope="module", params=[False, True], ids=["adamw", "zero1"])
def saved_run(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard") / "run")
    results = launch(_train_and_save, 8, root, request.param)
    return root, request.param, results


@pytest.mark.parametrize("layout", LOAD_LAYOUTS, ids=lambda t: "tp{}-pp{}-dp{}".format(*t))
def test_load_at_other_layout_is_bit_identical(saved_run, layout):
    root, zero, saved = saved_run
    world = layout[0] * layout[1] * layout[2]
    loaded = launch(_load_and_continue, world, root, zero, layout)
    assert {r["iteration"] for r in loaded} == {STEPS_BEFORE}
    expected = toy.assemble([r["saved"] for r in saved])
    got = toy.assemble([r["loaded"] for r in loaded])
    assert expected.keys() == got.keys()
    assert any(".exp_avg_sq" in k for k in got)  # optimizer moments are part of the comparison
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert loaded[0]["loaded"]["lr"] == saved[0]["saved"]["lr"]
    # training continues exactly as the uninterrupted run did
    reference = toy.assemble([r["final"] for r in saved])
    continued = toy.assemble([r["final"] for r in loaded])
    for key in reference:
        torch.testing.assert_close(continued[key], reference[key], rtol=1e-6, atol=1e-7, msg=key)


def _load_indivisible(rank: int, world: int, root: str):
    topo = sp.Topology(3, 1, 1)
    state = toy.build(topo, check=False)
    try:
        sp.Checkpointer(root, topology=topo).load(state)
    except sp.TopologyMismatchError as exc:
        return str(exc)
    return None


def test_layout_that_does_not_divide_names_the_tensor(saved_run):
    root, _, _ = saved_run
    messages = launch(_load_indivisible, 3, root)
    assert messages[0] is not None
    assert "model.embed.weight" in messages[0] and "(16, 8)" in messages[0] and "tp=3" in messages[0]
    with pytest.raises(sp.TopologyMismatchError, match="layers has size 4.*3 parallel parts"):
        sp.divide(4, 3, "layers")


PLAIN_DCP_READER = """
import sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
path, out = sys.argv[1], sys.argv[2]
reader = FileSystemReader(path)
meta = reader.read_metadata()
state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
dcp.load(state, storage_reader=reader)
assert "shardpoint" not in sys.modules
torch.save(state, out)
"""


def test_plain_dcp_reads_full_tensors_without_shardpoint(saved_run, tmp_path):
    root, _, saved = saved_run
    out = tmp_path / "full.pt"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-c", PLAIN_DCP_READER, f"{root}/iter_0000003", str(out)], check=True, env=env)
    full = torch.load(out, weights_only=True)
    expected = toy.assemble([r["saved"] for r in saved])
    assert full.keys() == expected.keys()
    for key in expected:
        assert torch.equal(full[key], expected[key]), key


def _save_replicated(rank: int, world: int, root: str):
    topo = sp.Topology(1, 1, 4)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=True, hidden=64)
    toy.train_step(state, 1)
    sp.Checkpointer(root, topology=topo).save(1, state)
    model_bytes = sum(p.numel() * p.element_size() for p in state.model.parameters())
    return model_bytes


def test_replicated_model_is_written_once_and_balanced(tmp_path):
    root = tmp_path / "run"
    model_bytes = launch(_save_replicated, 4, str(root))[0]
    meta = sp.Checkpointer(root).load(toy.build(sp.Topology(1, 1, 1), zero=True, hidden=64)).metadata
    per_rank = [sum(f.size for n, f in meta.files.items() if n.startswith(f"__{r}_")) for r in range(4)]
    moments = 2 * 4 * model_bytes  # exp_avg + exp_avg_sq (fp32) at most, whole model
    total = sum(per_rank)
    # one copy of the model plus one copy of the (ZeRO-sharded) moments, plus serialisation overhead
    assert total < (model_bytes + moments) * 1.1, (total, model_bytes)
    assert total > model_bytes + moments * 0.2
    for size in per_rank:  # each rank writes ~1/4 of the replicated weights + its own quarter of the moments
        assert size < (model_bytes + moments) / 4 * 1.6, per_rank
