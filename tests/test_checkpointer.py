"""Checkpointer semantics in one process: Megatron's load rules, layouts, retention, errors."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

import shardpoint as sp

CONFIG = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2}
FORMATS = ["dist", "torch"]


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, hidden)
        self.fc2 = torch.nn.Linear(hidden, 2)
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_state(seed: int = 0, hidden: int = 8) -> sp.TrainState:
    torch.manual_seed(seed)
    model = Net(hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return sp.TrainState(
        model, opt, sched, grad_scaler=torch.amp.GradScaler("cpu", init_scale=64.0), extra={"consumed_samples": 0}
    )


def train(state: sp.TrainState, steps: int = 2) -> None:
    for _ in range(steps):
        loss = state.model(torch.randn(3, 4)).pow(2).sum()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.model.steps_seen += 1
        state.extra["consumed_samples"] += 3


def assert_same(a: sp.TrainState, b: sp.TrainState, optimizer: bool = True) -> None:
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    if optimizer:
        sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        for pid in sa["state"]:
            for name in sa["state"][pid]:
                assert torch.equal(sa["state"][pid][name], sb["state"][pid][name]), (pid, name)
        if a.scheduler is not None:
            assert a.scheduler.state_dict() == b.scheduler.state_dict()


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_restores_everything(tmp_path, fmt):
    state = make_state()
    train(state)
    ckpt = sp.Checkpointer(tmp_path, format=fmt, config=CONFIG)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    ckpt.save(2, state)
    expected = (random.random(), np.random.rand(), torch.rand(1))

    fresh = make_state(seed=1)
    result = sp.Checkpointer(tmp_path, format=fmt, config=CONFIG).load(fresh)
    assert (result.iteration, result.release, result.finetune) == (2, False, False)
    assert result.extra == {"consumed_samples": 6} and fresh.extra["consumed_samples"] == 6
    assert result.metadata.format == fmt and result.metadata.consumed_samples == 6
    assert_same(state, fresh)
    assert fresh.grad_scaler.get_scale() == 64.0
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert ckpt.last_save_seconds > 0


def test_load_detects_format(tmp_path):
    state = make_state()
    sp.Checkpointer(tmp_path, format="torch").save(1, state)
    result = sp.Checkpointer(tmp_path, format="dist").load(make_state(1))
    assert result.metadata.format == "torch"


def test_fresh_start_returns_none(tmp_path):
    assert sp.Checkpointer(tmp_path / "nothing-here").load(make_state()) is None
    assert sp.Checkpointer(tmp_path).load(make_state()) is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_iteration_argument_loads_that_one(tmp_path, fmt):
    state = make_state()
    ckpt = sp.Checkpointer(tmp_path, format=fmt)
    ckpt.save(1, state)
    snapshot = make_state(5)
    snapshot.model.load_state_dict(state.model.state_dict())
    train(state)
    ckpt.save(2, state)
    fresh = make_state(9)
    assert ckpt.load(fresh, iteration=1).iteration == 1
    assert_same(snapshot, fresh, optimizer=False)
    with pytest.raises(sp.CorruptCheckpointError, match="iter_0000007 does not exist.*iter_0000001, iter_0000002"):
        ckpt.load(fresh, iteration=7)


@pytest.mark.parametrize("fmt", FORMATS)
def test_release_loads_weights_only_in_finetune_mode(tmp_path, fmt):
    state = make_state()
    train(state)
    ckpt = sp.Checkpointer(tmp_path, format=fmt)
    ckpt.save_release(state)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"
    fresh = make_state(3)
    result = ckpt.load(fresh)
    assert (result.iteration, result.release, result.finetune) == (0, True, True)
    assert_same(state, fresh, optimizer=False)
    assert fresh.optimizer.state_dict()["state"] == {}
    assert fresh.scheduler.last_epoch == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_finetune_flag_skips_optimizer_and_rng(tmp_path, fmt):
    state = make_state()
    train(state)
    ckpt = sp.Checkpointer(tmp_path, format=fmt)
    ckpt.save(4, state)
    fresh = make_state(3)
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    result = ckpt.load(fresh, finetune=True)
    assert (result.iteration, result.finetune) == (0, True)
    assert torch.equal(torch.rand(1), expected)  # RNG untouched
    assert fresh.optimizer.state_dict()["state"] == {}
    assert_same(state, fresh, optimizer=False)


def test_load_optimizer_false_and_load_rng_false(tmp_path):
    state = make_state()
    train(state)
    ckpt = sp.Checkpointer(tmp_path)
    ckpt.save(4, state)
    fresh = make_state(3)
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    result = ckpt.load(fresh, load_optimizer=False, load_rng=False)
    assert result.iteration == 4 and not result.finetune
    assert torch.equal(torch.rand(1), expected)
    assert fresh.optimizer.state_dict()["state"] == {}
    assert fresh.scheduler.last_epoch == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_config_mismatch_names_every_key(tmp_path, fmt):
    sp.Checkpointer(tmp_path, format=fmt, config=CONFIG).save(1, make_state())
    current = {**CONFIG, "hidden_size": 16, "num_attention_heads": 4}
    with pytest.raises(sp.ConfigMismatchError) as info:
        sp.Checkpointer(tmp_path, config=current).load(make_state())
    text = str(info.value)
    assert "hidden_size: saved=8 current=16" in text and "num_attention_heads: saved=2 current=4" in text
    assert "num_layers" not in text and "allow_config_mismatch" in text
    allowed = sp.Checkpointer(tmp_path, config=current, allow_config_mismatch=["hidden_size", "num_attention_heads"])
    assert allowed.load(make_state()).iteration == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_strict_names_missing_and_unexpected_keys(tmp_path, fmt):
    sp.Checkpointer(tmp_path, format=fmt).save(1, make_state())

    class Other(Net):
        def __init__(self):
            super().__init__()
            self.extra_head = torch.nn.Linear(2, 2)

    other = sp.TrainState(Other())
    with pytest.raises(sp.MissingKeysError, match="extra_head.weight") as info:
        sp.Checkpointer(tmp_path).load(other)
    assert "strict=False" in str(info.value)
    sp.Checkpointer(tmp_path).load(other, strict=False)
    assert torch.equal(other.model.fc1.weight, make_state().model.fc1.weight)


def test_neox_layout_round_trip(tmp_path):
    state = make_state()
    ckpt = sp.Checkpointer(tmp_path, layout="neox", keep_last=2)
    for it in (10, 20, 30):
        train(state, 1)
        ckpt.save(it, state)
    ckpt.wait()  # retention runs in the background
    assert (tmp_path / "latest").read_text() == "global_step30"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step20", "global_step30"]
    fresh = make_state(4)
    assert sp.Checkpointer(tmp_path, layout="neox").load(fresh).iteration == 30
    assert_same(state, fresh)


def test_retention_keep_last_and_keep_every(tmp_path):
    state = make_state()
    ckpt = sp.Checkpointer(tmp_path, keep_last=2, keep_every=200, save_interval=100)
    for it in range(100, 701, 100):
        assert ckpt.maybe_save(it, state)
        assert not ckpt.maybe_save(it + 50, state)
    ckpt.wait()
    dirs = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("iter_"))
    assert dirs == ["iter_0000200", "iter_0000400", "iter_0000600", "iter_0000700"]


def test_retention_keep_best_and_never_the_release(tmp_path):
    state = make_state()
    ckpt = sp.Checkpointer(tmp_path, keep_last=1, keep_best=(1, "val_loss", "min"))
    ckpt.save_release(state, update_tracker=False)
    for it, loss in [(1, 3.0), (2, 0.5), (3, 2.0), (4, 1.0)]:
        ckpt.save(it, state, metrics={"val_loss": loss})
    ckpt.wait()
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["iter_0000002", "iter_0000004", "release"]


def test_time_based_save(tmp_path):
    import time

    state = make_state()  # before the clock starts: building it is not part of the interval
    ckpt = sp.Checkpointer(tmp_path, save_interval_minutes=1 / 120)  # 0.5 s, well above the calls' own time
    assert not ckpt.maybe_save(1, state)
    time.sleep(0.6)
    assert ckpt.maybe_save(2, state)
    assert not ckpt.maybe_save(3, state)


def test_leftover_partial_directory_is_removed_and_never_loaded(tmp_path):
    state = make_state()
    sp.Checkpointer(tmp_path).save(1, state)
    partial = tmp_path / ".shardpoint-tmp-iter_0000002-dead"
    partial.mkdir()
    (partial / "junk.distcp").write_bytes(b"x" * 10)
    unmarked = tmp_path / "iter_0000003"
    unmarked.mkdir()
    ckpt = sp.Checkpointer(tmp_path)
    assert not partial.exists()
    assert ckpt.load(make_state()).iteration == 1
    with pytest.raises(sp.CorruptCheckpointError, match="no shardpoint.json"):
        ckpt.load(make_state(), iteration=3)


@pytest.mark.parametrize("content,match", [("iter_abc", "neither an iteration"), ("\xff", "not text")])
def test_malformed_tracker_is_a_clear_error(tmp_path, content, match):
    sp.Checkpointer(tmp_path).save(1, make_state())
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(content.encode("latin-1"))
    with pytest.raises(sp.CorruptCheckpointError, match=match):
        sp.Checkpointer(tmp_path).load(make_state())


def test_tracker_naming_missing_directory(tmp_path):
    sp.Checkpointer(tmp_path).save(1, make_state())
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(sp.CorruptCheckpointError, match="iter_0000005 does not exist"):
        sp.Checkpointer(tmp_path).load(make_state())


def test_path_that_is_a_file(tmp_path):
    target = tmp_path / "afile"
    target.write_text("hello")
    with pytest.raises(sp.CheckpointError, match="is a file"):
        sp.Checkpointer(target).load(make_state())


def test_marker_is_json_with_files_and_checksums(tmp_path):
    state = make_state()
    state.extra["flops"] = 1.5e12
    path = sp.Checkpointer(tmp_path, config=CONFIG).save(3, state, metrics={"loss": 1.25})
    marker = json.loads((tmp_path / "iter_0000003" / "shardpoint.json").read_text())
    assert marker["iteration"] == 3 and marker["format"] == "dist" and marker["config"] == CONFIG
    assert marker["topology"] == {"tp": 1, "pp": 1, "dp": 1} and marker["flops"] == 1.5e12
    assert marker["metrics"] == {"loss": 1.25} and marker["format_version"] == 1
    on_disk = {os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs}
    assert on_disk - {"shardpoint.json"} == set(marker["files"])
    for name, record in marker["files"].items():
        assert os.path.getsize(os.path.join(path, name)) == record["size"]
        assert len(record["xxh3_64"]) == 16


@pytest.mark.parametrize("async_save", [False, True])
def test_validation_logits_are_stored_checksummed_and_returned(tmp_path, async_save):
    state = make_state()
    batch = torch.ones(2, 4)
    calls = []

    def logits():
        calls.append(1)
        return {"tokens": batch, "logits": state.model(batch).detach()}

    ckpt = sp.Checkpointer(tmp_path, save_interval=2, async_save=async_save)
    assert not ckpt.maybe_save(1, state, validation_logits=logits)
    assert calls == []  # computed only when a save happens
    assert ckpt.maybe_save(2, state, validation_logits=logits)
    expected = logits()["logits"]
    train(state)  # changes the weights right after the save
    ckpt.close()
    marker = json.loads((tmp_path / "iter_0000002" / "shardpoint.json").read_text())
    assert marker["validation_logits"] == "validation_logits.pt" and "validation_logits.pt" in marker["files"]
    result = sp.Checkpointer(tmp_path).load(make_state(3))
    assert torch.equal(result.read_validation_logits()["logits"], expected)
    no_logits = sp.Checkpointer(tmp_path / "plain")
    no_logits.save(1, state)
    assert sp.Checkpointer(tmp_path / "plain").load(make_state(3)).read_validation_logits() is None


def test_retention_never_deletes_the_checkpoint_the_tracker_names(tmp_path):
    from shardpoint.catalog.layout import get_layout
    from shardpoint.lifecycle import commit
    from shardpoint.lifecycle.policy import LatestN
    from shardpoint.lifecycle.retention import apply_retention
    from shardpoint.storage.base import open_storage

    state = make_state()
    ckpt = sp.Checkpointer(tmp_path)
    for it in (1, 2, 3):
        ckpt.save(it, state)
    ckpt.close()
    storage, layout = open_storage(tmp_path), get_layout("megatron")
    commit.write_tracker(storage, str(tmp_path), layout, 1)  # a rollback: the tracker names the oldest
    removed = apply_retention(storage, str(tmp_path), layout, [LatestN(1)])
    assert removed == ["iter_0000002"]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000001", "iter_0000003"]
    assert sp.Checkpointer(tmp_path).load(make_state(2)).iteration == 1
