"""Keys are the model's own names whatever wraps it: torch.compile, DDP, activation checkpointing."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.nn.parallel import DistributedDataParallel

import shardpoint as sp
from shardpoint.state.train_state import MODEL_PREFIX, collect
from tests.distributed import launch

WRAPPERS = ["plain", "compiled", "ddp", "checkpointed"]
FIXTURES = Path(__file__).parent / "fixtures" / "prefixed_keys"


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def _wrap(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    if kind == "compiled":
        return torch.compile(model)
    if kind == "ddp":
        return DistributedDataParallel(model)
    if kind == "ddp-compiled":
        return DistributedDataParallel(torch.compile(model))
    if kind == "checkpointed":
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, torch.nn.Linear)
        )
    return model


def _trained(kind: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    base = _model(seed=0)
    wrapped = _wrap(kind, base)
    opt = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    base(torch.randn(2, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    return base, wrapped, opt


def _state_of(base: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in base.state_dict().items()}
    for i, p in enumerate(base.parameters()):
        for name, value in opt.state[p].items():
            out[f"param{i}.{name}"] = value.clone()
    return out


def _load_into(kind: str, root: str, **load_args) -> dict[str, torch.Tensor]:
    base = _model(seed=99)
    wrapped = _wrap(kind, base)
    opt = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    sp.Checkpointer(root).load(sp.TrainState(wrapped, opt), **load_args)
    return _state_of(base, opt)


def _every_pair(rank, world, root):
    failures = []
    pairs = [*itertools.product(WRAPPERS, WRAPPERS), ("ddp-compiled", "plain"), ("plain", "ddp-compiled")]
    for fmt in ("dist", "torch"):
        for saved_as in {s for s, _ in pairs}:
            base, wrapped, opt = _trained(saved_as)
            expected = _state_of(base, opt)
            keys = sorted(collect(sp.TrainState(wrapped, opt), iteration=1).tensors)
            if keys != sorted(
                [f"{MODEL_PREFIX}{k}" for k in ("0.weight", "0.bias", "2.weight", "2.bias")]
                + [
                    f"optimizer.state.{p}.{n}"
                    for p in ("0.weight", "0.bias", "2.weight", "2.bias")
                    for n in ("step", "exp_avg", "exp_avg_sq")
                ]
            ):
                failures.append(f"{saved_as}: keys {keys}")
            sp.Checkpointer(f"{root}/{fmt}-{saved_as}", format=fmt).save(1, sp.TrainState(wrapped, opt))
            for s, loaded_as in pairs:
                if s != saved_as:
                    continue
                try:
                    got = _load_into(loaded_as, f"{root}/{fmt}-{saved_as}")
                except sp.CheckpointError as exc:
                    failures.append(f"{fmt} {saved_as} -> {loaded_as}: {type(exc).__name__}: {exc}")
                    continue
                bad = [k for k in expected if not torch.equal(expected[k], got[k])]
                if bad:
                    failures.append(f"{fmt} {saved_as} -> {loaded_as}: differ {bad}")
    return failures


def test_every_wrapper_pair_loads_in_both_formats(tmp_path):
    (failures,) = launch(_every_pair, 1, str(tmp_path))
    assert failures == []


def _load_prefixed_fixture(rank, world, root):
    return {name: _load_into("plain", f"{root}/{name}") for name in ("ddp-compiled-dist", "ddp-torch")}


def test_checkpoint_with_wrapper_prefixes_loads_into_a_plain_model(tmp_path):
    shutil.copytree(FIXTURES, tmp_path / "fx")
    (loaded,) = launch(_load_prefixed_fixture, 1, str(tmp_path / "fx"))
    truth = torch.load(FIXTURES / "truth.pt", weights_only=True)
    for name, got in loaded.items():
        for key, value in truth["model"].items():
            assert torch.equal(got[f"model.{key}"], value), (name, key)
        for i, state in truth["optimizer"]["state"].items():
            for state_name, value in state.items():
                assert torch.equal(got[f"param{i}.{state_name}"], value), (name, i, state_name)


class _Refactored(torch.nn.Module):
    """The same network after a refactor renamed its layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.encoder = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)


def _rename_into_refactor(rank, world, root):
    base, wrapped, opt = _trained("plain")
    expected = _state_of(base, opt)
    sp.Checkpointer(root).save(1, sp.TrainState(wrapped, opt))
    results = {}
    for label, rename in {
        "partial": {"0.weight": "encoder.weight", "0.bias": "encoder.bias"},
        "callable": lambda name: name.replace("0.", "encoder.").replace("2.", "head."),
    }.items():
        model = _Refactored()
        new_opt = torch.optim.Adam(model.parameters(), lr=0.01)
        try:
            sp.Checkpointer(root).load(sp.TrainState(model, new_opt), rename=rename)
        except sp.MissingKeysError as exc:
            results[label] = str(exc)
            continue
        results[label] = _state_of(model, new_opt)
    return expected, results


def test_rename_maps_saved_keys_onto_a_refactored_model(tmp_path):
    ((expected, results),) = launch(_rename_into_refactor, 1, str(tmp_path / "run"))
    assert isinstance(results["partial"], str)
    assert "model.head.weight" in results["partial"] and "model.encoder.weight" not in results["partial"]
    got = results["callable"]
    renamed = {
        (k.replace("0.", "encoder.").replace("2.", "head.") if k.startswith("model.") else k): v
        for k, v in expected.items()
    }
    assert got.keys() == renamed.keys()
    assert all(torch.equal(got[k], renamed[k]) for k in renamed)


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_inspect_shows_canonical_names_of_a_prefixed_checkpoint(tmp_path, fmt):
    from shardpoint.offline import read_full

    name = "ddp-compiled-dist" if fmt == "dist" else "ddp-torch"
    shutil.copytree(FIXTURES / name, tmp_path / name)
    tensors = read_full(str(tmp_path / name)).tensors
    assert "model.0.weight" in tensors and "optimizer.state.2.bias.exp_avg" in tensors
    assert not any("module" in k or "_orig_mod" in k for k in tensors)


class _HoldsModule(torch.nn.Module):
    """An ordinary model whose only child is named ``module`` (EMA and LoRA wrappers look like this)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.module = torch.nn.Linear(4, 2)


def test_a_child_named_module_is_not_mistaken_for_ddp(tmp_path):
    from shardpoint import offline

    saved = _HoldsModule(seed=0)
    sp.Checkpointer(tmp_path / "run").save(1, sp.TrainState(saved))
    assert "model.module.weight" in offline.read_full(str(tmp_path / "run")).tensors
    offline.convert(str(tmp_path / "run"), str(tmp_path / "torch"), format="torch")
    for root in ("run", "torch"):
        fresh = _HoldsModule(seed=1)
        sp.Checkpointer(tmp_path / root).load(sp.TrainState(fresh))
        assert torch.equal(fresh.module.weight, saved.module.weight), root
