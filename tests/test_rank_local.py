"""Nothing merged: per-rank optimizer state stays per rank, declared replicas are checked equal.

Adafactor's factored statistics of a tensor-parallel piece (``row_var``/``col_var``)
describe that piece only; before per-rank storage every rank read one rank's copy
back from a ``dist`` checkpoint, silently.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import shardpoint as sp
from shardpoint.catalog.layout import get_layout
from shardpoint.lifecycle.commit import read_tracker
from shardpoint.storage.base import open_storage
from tests import toy
from tests.distributed import launch

OPTIMIZERS = {
    "sgd-momentum": functools.partial(torch.optim.SGD, momentum=0.9),
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": functools.partial(torch.optim.RMSprop, momentum=0.5),
    "adafactor": torch.optim.Adafactor,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
}
STEPS = 2


def _trained(topo: sp.Topology, optimizer) -> sp.TrainState:
    toy.seed_rng(topo)
    state = toy.build(topo, optimizer=optimizer)
    for step in range(1, STEPS + 1):
        toy.train_step(state, step)
    return state


def _same_layout_round_trip(rank, world, root, layout, optimizer, formats):
    topo = sp.Topology(*layout)
    state = _trained(topo, optimizer)
    saved = toy.optimizer_state(state)
    loaded = {}
    for fmt in formats:
        sp.Checkpointer(f"{root}/{fmt}", topology=topo, format=fmt).save(STEPS, state)
        fresh = toy.build(topo, optimizer=optimizer)
        sp.Checkpointer(f"{root}/{fmt}", topology=topo).load(fresh)
        loaded[fmt] = toy.optimizer_state(fresh)
    return saved, loaded


def _assert_every_state_identical(results, formats):
    for rank, (saved, loaded) in enumerate(results):
        assert any(saved.values()), "the optimizer has state to compare"
        for fmt in formats:
            assert loaded[fmt].keys() == saved.keys()
            for param, names in saved.items():
                assert loaded[fmt][param].keys() == names.keys(), (fmt, rank, param)
                for name, value in names.items():
                    got = loaded[fmt][param][name]
                    assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), (fmt, rank, param, name)


@pytest.mark.parametrize("layout", [(2, 1, 1), (2, 1, 2)], ids=["tp2", "tp2-dp2"])
def test_adafactor_same_layout_restores_every_rank_exactly(tmp_path, layout):
    world = layout[0] * layout[2]
    results = launch(_same_layout_round_trip, world, str(tmp_path), layout, torch.optim.Adafactor, ["dist", "torch"])
    _assert_every_state_identical(results, ["dist", "torch"])
    # the statistics really differ between tensor-parallel ranks: merging them would have shown
    row_var = [saved["layers.0.fc1.weight"]["row_var"] for saved, _ in results[:2]]
    assert not torch.equal(row_var[0], row_var[1])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_torch_optimizer_round_trips_at_tp2_dp2(tmp_path, name):
    results = launch(_same_layout_round_trip, 4, str(tmp_path), (2, 1, 2), OPTIMIZERS[name], ["dist"])
    _assert_every_state_identical(results, ["dist"])


def _save_adafactor(rank, world, root, fmt):
    topo = sp.Topology(2, 1, 1)
    state = _trained(topo, torch.optim.Adafactor)
    sp.Checkpointer(root, topology=topo, format=fmt).save(STEPS, state)
    return toy.snapshot(state)


def _load_at_one_rank(rank, world, root, policy):
    topo = sp.Topology(1, 1, 1)
    fresh = toy.build(topo, optimizer=torch.optim.Adafactor)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("shardpoint").addHandler(handler)
    try:
        sp.Checkpointer(root, topology=topo).load(fresh, optimizer_reshard=policy)
    except sp.CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"snapshot": toy.snapshot(fresh), "state": toy.optimizer_state(fresh), "log": records}


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_adafactor_at_another_layout_errors_or_reinitialises(tmp_path, fmt):
    root = str(tmp_path / "run")
    saved = launch(_save_adafactor, 2, root, fmt)
    if fmt == "torch":  # the torch format loads at its own tp only; convert re-splits it offline
        return
    (failed,) = launch(_load_at_one_rank, 1, root, "error")
    assert "TopologyMismatchError" in failed["error"]
    assert "optimizer.state.layers.0.fc1.weight.row_var" in failed["error"]
    assert "optimizer_reshard='reinit'" in failed["error"]

    (loaded,) = launch(_load_at_one_rank, 1, root, "reinit")
    expected, got = toy.assemble(saved), toy.assemble([loaded["snapshot"]])
    # at tp=1 the weights are whole, so their factored statistics now have a global place too
    assert {k.rsplit(".", 1)[1] for k in set(got) - set(expected)} == {"row_var", "col_var"}
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert any(k.endswith(".weight") and k.startswith("model.") for k in got)
    factored = loaded["state"]["layers.0.fc1.weight"]
    assert torch.count_nonzero(factored["row_var"]) == 0 and torch.count_nonzero(factored["col_var"]) == 0
    warning = next(m for m in loaded["log"] if "re-initialised" in m)
    assert "optimizer.state.layers.0.fc1.weight.row_var" in warning and "col_var" in warning


def _torch_format_at_other_dp(rank, world, root):
    topo = sp.Topology(2, 1, world // 2)
    if world == 4:
        state = _trained(topo, torch.optim.Adafactor)
        sp.Checkpointer(root, topology=topo, format="torch").save(STEPS, state)
        return None
    fresh = toy.build(topo, optimizer=torch.optim.Adafactor)
    try:
        sp.Checkpointer(root, topology=topo).load(fresh)
    except sp.TopologyMismatchError as exc:
        return str(exc)
    return None


def test_torch_format_per_rank_state_at_another_dp_is_an_error(tmp_path):
    launch(_torch_format_at_other_dp, 4, str(tmp_path))
    errors = launch(_torch_format_at_other_dp, 2, str(tmp_path))
    assert all(e is not None and "row_var" in e for e in errors)


class _Buffered(torch.nn.Module):
    """A replicated weight, and a buffer that is meant to differ by rank."""

    def __init__(self, rank: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
        self.register_buffer("seen", torch.full((4,), float(rank)))

    def sharded_state_dict(self):
        return {"weight": self.weight, "seen": sp.RankLocal(self.seen)}


def _replica_mismatch(rank, world, root, async_save):
    topo = sp.Topology(1, 1, world)
    model = _Buffered(rank)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    opt.state[model.weight]["step"] = torch.tensor(float(10 + rank))  # a scalar that differs by rank
    state = sp.TrainState(model, opt)
    ckpt = sp.Checkpointer(root, topology=topo, async_save=async_save)
    ckpt.save(1, state)
    ckpt.wait()
    saved_weight = model.weight.detach().clone()
    with torch.no_grad():
        if rank == 1:
            model.weight[0, 0] += 1.0  # a replica drifts on one rank
    error = None
    try:
        ckpt.save(2, state)
        ckpt.wait()
    except sp.ReplicaMismatchError as exc:
        error = str(exc)
    ckpt.close()
    fresh = _Buffered(rank=99)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    result = sp.Checkpointer(root, topology=topo).load(sp.TrainState(fresh, fresh_opt))
    return {
        "error": error,
        "iteration": result.iteration,
        "seen": fresh.seen.clone(),
        "step": fresh_opt.state[fresh.weight]["step"].clone(),
        "weight": fresh.weight.detach().clone(),
        "saved_weight": saved_weight,
    }


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_replicas_that_differ_stop_the_save_and_rank_local_values_survive(tmp_path, async_save):
    root = str(tmp_path / "run")
    results = launch(_replica_mismatch, 2, root, async_save)
    for rank, r in enumerate(results):
        assert r["error"] is not None, "a drifted replica must stop the save"
        assert "'model.weight'" in r["error"] and "ranks [0]" in r["error"] and "ranks [1]" in r["error"]
        assert r["iteration"] == 1
        assert torch.equal(r["seen"], torch.full((4,), float(rank)))  # sp.RankLocal: each rank its own
        assert r["step"].item() == 10 + rank  # a differing scalar is stored per rank, not merged
        assert torch.equal(r["weight"], r["saved_weight"])
    storage = open_storage(root)
    assert read_tracker(storage, root, get_layout("megatron")) == (True, 1)
    assert not storage.exists(storage.join(root, "iter_0000002"))


def _torch_format_local_state_dicts(rank, world, root):
    """Megatron's legacy convention: each tp rank's own local state_dict() under the same keys."""
    topo = sp.Topology(tp_size=world)
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sp.Checkpointer(root, topology=topo, format="torch").save(1, sp.TrainState(model, opt))
    fresh = torch.nn.Linear(4, 3)
    sp.Checkpointer(root, topology=topo).load(sp.TrainState(fresh, torch.optim.Adam(fresh.parameters())))
    return torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_torch_format_keeps_per_mp_rank_files_apart(tmp_path):
    """One file per model-parallel rank: tp ranks' plain tensors are not replicas of each other."""
    assert launch(_torch_format_local_state_dicts, 2, str(tmp_path / "run")) == [True, True]
