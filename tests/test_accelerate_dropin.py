"""``shardpoint.integrations.accelerate.patch``: an unedited script's ``accelerator.save_state`` / ``load_state``.

The cases of Accelerate's own ``tests/test_state_checkpointing.py`` (huggingface/accelerate
at 16cb6eb), run through a patched real ``Accelerator`` in this process (one CPU process,
as those tests run): the save limit, resuming from a folder and from automatic
names, relative project paths, automatic loading of the latest, scheduler state,
deletion beyond ``total_limit``, and the ``map_location`` check. Their data loaders use
``num_workers=0`` here (4 worker processes per loader cost seconds and change nothing).

Also issue 34, items 6 and 12: every argument of Accelerate's methods is accepted
(``safe_serialization`` used to raise TypeError), ``load_state(input_dir)`` loads
``input_dir`` under automatic naming, and a directory Accelerate wrote itself is neither
loaded nor deleted (item 2, with the ``accelerate`` layout at iteration 0).
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration, set_seed

import shardpoint as sp
from shardpoint.integrations import accelerate as sp_accelerate
from shardpoint.integrations.accelerate import patch, unpatch
from shardpoint.storage.base import ForeignDataError


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; its own test case resets them after each test."""
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def dummy_dataloaders(a=2, b=3, batch_size=16, n_train_batches=10, n_valid_batches=2):
    def get_dataset(n_batches):
        x = torch.randn(batch_size * n_batches, 1)
        return TensorDataset(x, a * x + b + 0.1 * torch.randn(batch_size * n_batches, 1))

    train = DataLoader(get_dataset(n_train_batches), shuffle=True, batch_size=batch_size)
    valid = DataLoader(get_dataset(n_valid_batches), shuffle=False, batch_size=batch_size)
    return train, valid


def train(num_epochs, model, dataloader, optimizer, accelerator, scheduler=None):
    rands = []
    for _ in range(num_epochs):
        model.train()
        for x, y in dataloader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        rands.append(random.random())  # the Python stream must come back too
        if scheduler is not None:
            scheduler.step()
    return rands


class DummyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(1))
        self.b = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return x * self.a + self.b


def setup(project_config=None, project_dir=None, scheduler=False):
    """Accelerate's test set-up, with the accelerator patched (the one line a script adds)."""
    set_seed(42)
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    objects = [model, optimizer, *dummy_dataloaders()]
    if scheduler:
        objects.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99))
    accelerator = patch(Accelerator(cpu=True, project_dir=project_dir, project_config=project_config))
    return (accelerator, *accelerator.prepare(*objects))


def auto(**kwargs) -> ProjectConfiguration:
    return ProjectConfiguration(automatic_checkpoint_naming=True, **kwargs)


@pytest.mark.parametrize("safe", [True, False])
def test_with_save_limit(tmp_path, safe):
    accelerator, *_ = setup(auto(total_limit=1, project_dir=str(tmp_path)))
    accelerator.save_state(safe_serialization=safe)
    accelerator.save_state(safe_serialization=safe)
    assert len(os.listdir(accelerator.project_dir)) == 1
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == ["checkpoint_1"]


def test_can_resume_training_with_folder(tmp_path):
    accelerator, model, optimizer, loader, _ = setup()
    initial = str(tmp_path / "initial")
    accelerator.save_state(initial, safe_serialization=False)
    a, b, opt_state = model.a.item(), model.b.item(), optimizer.state_dict()
    ground_truth_rands = train(3, model, loader, optimizer, accelerator)
    a1, b1, opt_state1 = model.a.item(), model.b.item(), optimizer.state_dict()

    accelerator, model, optimizer, loader, _ = setup()
    accelerator.load_state(initial)
    assert (a, b) == (model.a.item(), model.b.item())
    assert opt_state == optimizer.state_dict()
    test_rands = train(2, model, loader, optimizer, accelerator)
    checkpoint = str(tmp_path / "checkpoint")
    accelerator.save_state(checkpoint, safe_serialization=True)
    accelerator.load_state(checkpoint)
    test_rands += train(1, model, loader, optimizer, accelerator)
    assert (a1, b1) == (model.a.item(), model.b.item())
    assert opt_state1 == optimizer.state_dict()
    assert ground_truth_rands == test_rands


def resume_from_automatic_names(project_dir: str, load_first) -> None:
    """Accelerate's ``test_can_resume_training`` and its relative-path twin; ``load_first`` loads checkpoint_0."""
    accelerator, model, optimizer, loader, _ = setup(auto(), project_dir)
    accelerator.save_state(safe_serialization=True)
    a, b, opt_state = model.a.item(), model.b.item(), optimizer.state_dict()
    ground_truth_rands = train(3, model, loader, optimizer, accelerator)
    a1, b1, opt_state1 = model.a.item(), model.b.item(), optimizer.state_dict()

    accelerator, model, optimizer, loader, _ = setup(auto(iteration=1), project_dir)
    load_first(accelerator)
    assert (a, b) == (model.a.item(), model.b.item())
    assert opt_state == optimizer.state_dict()
    test_rands = train(2, model, loader, optimizer, accelerator)
    accelerator.save_state(safe_serialization=True)
    accelerator.load_state(os.path.join(project_dir, "checkpoints", "checkpoint_1"))
    test_rands += train(1, model, loader, optimizer, accelerator)
    assert (a1, b1) == (model.a.item(), model.b.item())
    assert opt_state1 == optimizer.state_dict()
    assert ground_truth_rands == test_rands


def test_can_resume_training(tmp_path):
    resume_from_automatic_names(
        str(tmp_path), lambda acc: acc.load_state(str(tmp_path / "checkpoints" / "checkpoint_0"))
    )


def test_can_resume_training_checkpoints_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir("relative")
    resume_from_automatic_names("relative", lambda acc: acc.load_state())  # the directory is inferred
    assert (tmp_path / "relative" / "checkpoints" / "checkpoint_1" / "shardpoint.json").is_file()


def test_with_scheduler(tmp_path):
    accelerator, model, optimizer, loader, _, scheduler = setup(auto(), str(tmp_path), scheduler=True)
    accelerator.save_state(safe_serialization=True)
    scheduler_state = scheduler.state_dict()
    train(3, model, loader, optimizer, accelerator, scheduler)
    assert scheduler_state != scheduler.state_dict()
    accelerator.load_state(str(tmp_path / "checkpoints" / "checkpoint_0"))
    assert scheduler_state == scheduler.state_dict()


def test_automatic_loading(tmp_path):
    accelerator, model, optimizer, loader, _, scheduler = setup(auto(), str(tmp_path), scheduler=True)
    accelerator.save_state(safe_serialization=True)
    train(2, model, loader, optimizer, accelerator, scheduler)
    a2, b2 = model.a.item(), model.b.item()
    accelerator.save_state(safe_serialization=True)
    train(1, model, loader, optimizer, accelerator, scheduler)
    a3, b3 = model.a.item(), model.b.item()
    accelerator.load_state()  # the last saved checkpoint: a2, b2
    assert (a3, b3) != (model.a.item(), model.b.item())
    assert (a2, b2) == (model.a.item(), model.b.item())


def test_checkpoint_deletion(tmp_path):
    set_seed(42)
    accelerator = patch(Accelerator(cpu=True, project_dir=str(tmp_path), project_config=auto(total_limit=2)))
    accelerator.prepare(DummyModel())
    for _ in range(11):
        accelerator.save_state(safe_serialization=False)
    checkpoints = tmp_path / "checkpoints"
    assert not (checkpoints / "checkpoint_0").exists()
    assert (checkpoints / "checkpoint_9").exists() and (checkpoints / "checkpoint_10").exists()


def test_map_location(tmp_path):
    """Accelerate's check on CPU: the accepted values load, anything else is its TypeError."""
    accelerator, model, optimizer, loader, _ = setup(auto(), str(tmp_path))
    train(1, model, loader, optimizer, accelerator)
    accelerator.save_state(safe_serialization=True)
    checkpoint = str(tmp_path / "checkpoints" / "checkpoint_0")
    for location in ("cpu", "on_device", None):
        accelerator.load_state(checkpoint, map_location=location)
        assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())
    with pytest.raises(TypeError, match="Unsupported optimizer map location passed"):
        accelerator.load_state(checkpoint, map_location="invalid")


# ------------------------------------------------- arguments, the patch, and item 6


def test_every_argument_of_accelerates_methods_is_taken_and_strict_is_honoured(tmp_path, caplog):
    accelerator, model, *_ = setup()
    out = str(tmp_path / "out")
    path = accelerator.save_state(out, safe_serialization=False, tag="deepspeed-only")
    assert path == os.path.join(out, "checkpoint_0")
    assert "['tag'] ignored" in caplog.text
    with torch.no_grad():
        model.a.zero_()
    accelerator.load_state(out, load_kwargs={"weights_only": True}, map_location="cpu", load_module_strict=True)
    assert model.a.item() != 0 and "load_module_strict" in caplog.text and "weights_only" in caplog.text

    model.register_buffer("extra", torch.ones(1))  # a key the checkpoint lacks
    with pytest.raises(sp.MissingKeysError, match="extra"):
        accelerator.load_state(out)
    accelerator.load_state(out, strict=False)  # model.load_state_dict's strict, as Accelerate passes it


def test_patch_binds_this_instance_only_and_unpatch_restores_accelerates_methods(tmp_path):
    accelerator = Accelerator(cpu=True)
    other = Accelerator(cpu=True)
    assert patch(accelerator, checkpointer_options={"verify": True}) is accelerator
    assert accelerator.save_state.__wrapped__ is sp_accelerate.save_state
    assert accelerator.load_state.__wrapped__ is sp_accelerate.load_state
    assert other.save_state.__func__ is Accelerator.save_state
    assert unpatch(accelerator) is accelerator
    assert accelerator.save_state.__func__ is Accelerator.save_state
    assert accelerator.load_state.__func__ is Accelerator.load_state


def test_load_state_loads_the_directory_it_is_given_under_automatic_naming(tmp_path):
    """Item 6: an ``input_dir`` elsewhere is loaded, not ``{project_dir}/checkpoints``."""
    accelerator, model, *_ = setup(auto(), str(tmp_path / "project"))
    accelerator.save_state()  # project/checkpoints/checkpoint_0
    in_project = model.a.item()
    other, other_model, *_ = setup()  # another run, no automatic naming, saving elsewhere
    with torch.no_grad():
        other_model.a.fill_(7.0)
    elsewhere = tmp_path / "elsewhere"
    other.save_state(str(elsewhere))  # elsewhere/checkpoint_0, a=7
    with torch.no_grad():
        model.a.zero_()
    for given in (elsewhere, elsewhere / "checkpoint_0"):  # a save directory, or one checkpoint in it
        result = accelerator.load_state(str(given))
        assert model.a.item() == 7.0 and result.path == str(elsewhere / "checkpoint_0"), given
    accelerator.load_state()
    assert model.a.item() == in_project


def tree(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()
    }


def test_accelerates_own_checkpoint_is_neither_loaded_nor_replaced(tmp_path):
    """Items 2 and 6: a fresh process at iteration 0 beside Accelerate's own ``checkpoint_0``."""
    accelerator, *_ = setup(auto(), str(tmp_path))
    unpatch(accelerator).save_state(safe_serialization=False)  # Accelerate itself: pytorch_model.bin, pickles
    stock = tmp_path / "checkpoints" / "checkpoint_0"
    before = tree(stock)
    assert "pytorch_model.bin" in before and "random_states_0.pkl" in before

    accelerator, *_ = setup(auto(), str(tmp_path))  # a new run: save_iteration is 0 again
    with pytest.raises(ForeignDataError) as info:
        accelerator.save_state()
    message = str(info.value)
    assert str(stock) in message and "pytorch_model.bin" in message, message
    assert tree(stock) == before
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [".shardpoint.lock", "checkpoint_0"]  # nothing written

    for given in (stock, stock.parent):
        with pytest.raises(ForeignDataError, match="random_states_0.pkl|checkpoint_0") as info:
            accelerator.load_state(str(given))
        assert "not a shardpoint checkpoint" in str(info.value) and "unpatch" in str(info.value)
    assert tree(stock) == before
