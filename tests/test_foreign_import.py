"""Megatron-LM and DeepSpeed checkpoints written by the real tools: read and import exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint import offline
from shardpoint.foreign import import_checkpoint, read_foreign

FIXTURES = Path(__file__).parent / "fixtures" / "foreign"
ALL = [
    "megatron-legacy-tp1",
    "megatron-legacy-tp2",
    "megatron-legacy-tp2-dp2-distopt",
    "megatron-torchdist-tp2",
    "deepspeed-zero1-dp2",
    "deepspeed-pipe2",
]
MOMENTS = ("exp_avg", "exp_avg_sq")


def truth(name: str) -> dict[str, torch.Tensor]:
    path = FIXTURES / ("megatron-truth.pt" if name.startswith("megatron") else f"{name}/truth.pt")
    return torch.load(path, weights_only=True)


def params_of(t: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in t if k not in ("step", "iteration") and not k.endswith(tuple("." + m for m in MOMENTS))]


def assert_equal(name: str, got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None, f"{name} missing"
    assert got.dtype == want.dtype and got.shape == want.shape, f"{name}: {got.dtype}{tuple(got.shape)}"
    assert torch.equal(got, want), f"{name} differs"


@pytest.mark.parametrize("fixture", ALL)
def test_reader_gives_every_tensor_and_moment_exactly(fixture):
    ckpt = read_foreign(FIXTURES / fixture / "ckpt")
    t = truth(fixture)
    assert sorted(ckpt.params) == sorted(params_of(t))
    for name in params_of(t):
        assert_equal(name, ckpt.params[name], t[name])
        for moment in MOMENTS:
            assert_equal(f"{name}.{moment}", ckpt.optimizer[name].get(moment), t[f"{name}.{moment}"])
        assert int(ckpt.optimizer[name]["step"]) == int(t["step"])
    assert ckpt.iteration == int(t["iteration"])
    assert sum(len(g["param_names"]) for g in ckpt.param_groups) == len(ckpt.params)


@pytest.mark.parametrize("fixture", ALL)
def test_import_writes_a_dist_checkpoint_equal_to_the_truth(fixture, tmp_path):
    path = import_checkpoint(FIXTURES / fixture / "ckpt", tmp_path / "imported")
    full = offline.read_full(tmp_path / "imported")  # checksums verified first
    assert full.metadata.format == "dist" and full.path == path
    t = truth(fixture)
    for name in params_of(t):
        assert_equal(name, full.tensors[f"model.{name}"], t[name])
        for moment in MOMENTS:
            assert_equal(f"{name}.{moment}", full.tensors[f"optimizer.state.{name}.{moment}"], t[f"{name}.{moment}"])
        assert int(full.tensors[f"optimizer.state.{name}.step"]) == int(t["step"])
    meta = full.metadata
    assert meta.iteration == int(t["iteration"])
    assert full.common["foreign"]["tool"] == fixture.split("-")[0]
    assert full.common["scheduler"] and full.common["optimizer_param_groups"]
    if fixture.startswith("megatron"):
        assert meta.config["num_layers"] == 4 and meta.config["hidden_size"] == 64  # the source's args
        assert meta.consumed_samples == 0 and meta.layout == "megatron"
    else:
        assert meta.config["ds_config"]["zero_optimization"]["stage"] == 1
        assert meta.consumed_samples == {"deepspeed-zero1-dp2": 8, "deepspeed-pipe2": 4}[fixture]
        assert meta.layout == "neox" and path.endswith("global_step2")


def build_model(shapes: dict[str, torch.Size]) -> torch.nn.Module:
    """A module whose parameter names are exactly ``shapes``' keys (dotted paths become submodules)."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        module = root
        *path, leaf = name.split(".")
        for part in path:
            if part not in module._modules:
                module.add_module(part, torch.nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    return root


@pytest.mark.parametrize("fixture", ["megatron-legacy-tp2-dp2-distopt", "deepspeed-pipe2"])
def test_imported_checkpoint_loads_through_the_checkpointer(fixture, tmp_path):
    import_checkpoint(FIXTURES / fixture / "ckpt", tmp_path / "run")
    t = truth(fixture)
    model = build_model({name: t[name].shape for name in params_of(t)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    state = sp.TrainState(model=model, optimizer=optimizer, extra={})
    result = sp.Checkpointer(tmp_path / "run", topology=sp.Topology(1, 1, 1, rank=0)).load(state)
    assert result.iteration == 2 and "consumed_samples" in result.extra
    params = dict(model.named_parameters())
    for name in params_of(t):
        assert torch.equal(params[name], t[name]), name
        for moment in MOMENTS:
            assert torch.equal(optimizer.state[params[name]][moment], t[f"{name}.{moment}"]), (name, moment)
        assert int(optimizer.state[params[name]]["step"]) == 2


def test_a_save_directory_follows_its_tracker_and_tools_are_checked(tmp_path):
    ckpt = read_foreign(FIXTURES / "megatron-legacy-tp1" / "ckpt", source="megatron")
    assert ckpt.path.endswith("iter_0000002") and ckpt.format == "torch"
    with pytest.raises(sp.CheckpointError, match="not deepspeed"):
        read_foreign(FIXTURES / "megatron-legacy-tp1" / "ckpt", source="deepspeed")
    with pytest.raises(sp.CheckpointError, match="neither"):
        read_foreign(tmp_path)
