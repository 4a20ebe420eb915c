"""Checkpoints written by earlier versions keep loading (PyTorch DCP once broke this; we must not)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from tests.fixtures.make_fixtures import CONFIG, FixtureNet, fixture_state

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
