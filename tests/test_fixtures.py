"""Checkpoints written by earlier versions keep loading (PyTorch DCP once broke this; we must not)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from tests.distributed import launch
from tests.fixtures.make_fixtures import CONFIG, FixtureNet, _moments, fixture_state, zero_state

FIXTURES = Path(__file__).parent / "fixtures"
ALL = sorted(p.relative_to(FIXTURES) for p in FIXTURES.glob("v*/*") if p.is_dir())


def test_every_format_has_a_fixture():
    assert {p.name for p in ALL} >= {"dist", "torch"}


@pytest.mark.parametrize("fixture", ALL, ids=str)
def test_fixture_loads_with_exact_values(tmp_path, fixture):
    root = tmp_path / "copy"
    shutil.copytree(FIXTURES / fixture, root)  # loading never writes into the committed fixture
    expected = fixture_state()
    model = FixtureNet()
    state = sp.TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.5))
    result = sp.Checkpointer(root, config=CONFIG).load(state)
    assert (result.iteration, result.extra) == (7, {"consumed_samples": 48})
    assert result.metadata.format == fixture.name
    for (name, want), got in zip(expected.model.named_parameters(), model.parameters()):
        assert torch.equal(want, got), name
    want_opt, got_opt = expected.optimizer.state_dict(), state.optimizer.state_dict()
    for pid, values in want_opt["state"].items():
        for name, value in values.items():
            assert torch.equal(value, got_opt["state"][pid][name]), (pid, name)


def _load_torch_zero(rank: int, world: int, root: str, dp: int) -> dict:
    topo = sp.Topology(1, 1, dp)
    state = zero_state(topo, rank)
    result = sp.Checkpointer(root, topology=topo, config=CONFIG).load(state, optimizer_reshard="reinit")
    return {"iteration": result.iteration, "moments": _moments(state), "seen": state.model.seen.clone()}


def test_gathered_torch_zero_checkpoint_of_0_1_loads_at_its_layout_and_at_another(tmp_path):
    """0.1.0 gathered every dp rank's ZeRO pieces into one distrib_optim.pt, RankLocal tensors into the main file."""
    root = tmp_path / "copy"
    shutil.copytree(FIXTURES / "torch-zero" / "v1", root)
    truths = [torch.load(root / f"truth_rank{r}.pt", weights_only=True) for r in range(2)]
    same = launch(_load_torch_zero, 2, str(root), 2)
    for rank, (got, want) in enumerate(zip(same, truths)):
        assert got["iteration"] == 3 and torch.equal(got["seen"], want["seen"])  # its own rank-local value
        for key, per in want["moments"].items():
            for name, value in per.items():
                assert torch.equal(got["moments"][key][name], value), (rank, key, name)
    (one,) = launch(_load_torch_zero, 1, str(root), 1)  # dp=1: both ranks' pieces reassembled
    for key in truths[0]["moments"]:
        full = torch.cat([truths[r]["moments"][key]["exp_avg"].reshape(-1) for r in range(2)])
        assert torch.equal(one["moments"][key]["exp_avg"].reshape(-1)[: full.numel()], full), key
