"""Frozen tensors stored once: later saves refer to the bytes an earlier checkpoint wrote, and nothing breaks.

Real gloo ranks (tp=2 × dp=2) save a model whose base is frozen; every kept checkpoint
must load exactly through shardpoint and through plain ``dcp.load``, retention must keep
the referred files (and only those), a damaged shared file is named by every checkpoint
that uses it, and a rank killed while a referred checkpoint is retired loses nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import shardpoint as sp
from shardpoint.catalog.layout import get_layout
from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.commands.verify import check_checkpoint
from shardpoint.lifecycle import commit
from shardpoint.lifecycle.references import HELD_NOTE
from shardpoint.storage.base import LocalStorage
from tests import toy
from tests.distributed import launch

FROZEN = ("embed.", "layers.0.", "layers.1.", "layers.2.")  # the base: most of the toy model


def frozen_state(topo: sp.Topology) -> sp.TrainState:
    model = toy.ToyModel(topo)
    for key in model.specs:
        model.param(key).requires_grad_(not key.startswith(FROZEN))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1 + 0.1 * n))
    return sp.TrainState(model, opt, sched, extra={"consumed_samples": 0})


def step(state: sp.TrainState, n: int) -> None:
    """The toy's elementwise step on the trained part only (replicas stay equal: no noise)."""
    loss = torch.zeros(())
    for key in state.model.specs:
        p = state.model.param(key)
        if p.requires_grad:
            loss = loss + ((p - 0.1 * n) ** 2).sum()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()


def _train_and_save(rank: int, world: int, root: str, its: list[int], keep_last: int, fault: str = ""):
    topo = sp.Topology(2, 1, 2)
    state = frozen_state(topo)
    ckpt = sp.Checkpointer(root, topology=topo, keep_last=keep_last)
    if its[0] > 1:
        ckpt.load(state)
    snapshots = {}
    for it in its:
        step(state, it)
        if fault and it == its[-1]:
            os.environ["SHARDPOINT_FAULT"] = fault
        ckpt.save(it, state)
        snapshots[it] = toy.snapshot(state)
    ckpt.close()
    return snapshots


def _load(rank: int, world: int, root: str, iteration: int):
    topo = sp.Topology(2, 1, 2)
    state = frozen_state(topo)
    for p in state.model.parameters():
        p.data.zero_()
    result = sp.Checkpointer(root, topology=topo).load(state, iteration=iteration)
    return {"iteration": result.iteration, "snapshot": toy.snapshot(state)}


def assert_loads_exactly(root: Path, iteration: int, saved: list[dict]) -> None:
    loaded = launch(_load, 4, str(root), iteration)
    for rank, result in enumerate(loaded):
        assert result["iteration"] == iteration
        for key, (_, _, tensor) in saved[rank][iteration]["tensors"].items():
            assert torch.equal(result["snapshot"]["tensors"][key][2], tensor), (iteration, key)


def storage_paths(directory: Path) -> dict[str, set[str]]:
    """Per model key: the files its items are stored in, as ``.metadata`` records them."""
    md = FileSystemReader(str(directory)).read_metadata()
    paths: dict[str, set[str]] = {}
    for index, info in md.storage_data.items():
        paths.setdefault(index.fqn, set()).add(info.relative_path)
    return paths


def plain_dcp_load(directory: Path) -> dict[str, torch.Tensor]:
    md = FileSystemReader(str(directory)).read_metadata()
    out = {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    out = {k: v for k, v in out.items() if k.startswith("model.")}
    dcp.load(out, checkpoint_id=str(directory), no_dist=True)
    return out


def is_frozen(key: str) -> bool:
    return key.removeprefix("model.").startswith(FROZEN)


def test_frozen_base_is_stored_once_and_every_kept_checkpoint_loads(tmp_path):
    root = tmp_path / "run"
    saved = launch(_train_and_save, 4, str(root), [1, 2, 3, 4, 5], 2)
    names = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
    assert names == ["iter_0000001", "iter_0000004", "iter_0000005"]
    held = root / "iter_0000001"
    assert (held / HELD_NOTE).exists() and not (held / MARKER_NAME).exists()
    # exactly the data files the frozen items are in (which ranks wrote them is the save's balancing);
    # its other data files, .metadata, common.pt and rng/ went
    referred = {
        f.removeprefix("../iter_0000001/")
        for k, fs in storage_paths(root / "iter_0000004").items()
        if is_frozen(k)
        for f in fs
    }
    assert referred and sorted(os.listdir(held)) == sorted([HELD_NOTE, *referred])
    entries = commit.list_checkpoints(LocalStorage(str(root)), str(root), get_layout("megatron"))
    assert [e.name for e in entries] == ["iter_0000004", "iter_0000005"]  # a held directory is no checkpoint

    for name in ("iter_0000004", "iter_0000005"):
        for key, files in storage_paths(root / name).items():
            if is_frozen(key):
                assert all(f.startswith("../iter_0000001/") for f in files), (name, key, files)
            else:
                assert not any(f.startswith("..") for f in files), (name, key, files)
        report = check_checkpoint(name, str(root / name))
        assert report["ok"], report
        # every rank still writes its share of what changed (the frozen keys, which sort together, are not
        # all given to one holder, which would then write nothing in a later save)
        written = sorted(f for f in os.listdir(root / name) if f.endswith(".distcp"))
        assert written == [f"__{r}_0.distcp" for r in range(4)], (name, written)
    full = toy.assemble([s[5] for s in saved])
    plain = plain_dcp_load(root / "iter_0000005")
    assert plain.keys() == {k for k in full if k.startswith("model.")}
    for key, tensor in plain.items():
        assert torch.equal(tensor, full[key]), key
    assert_loads_exactly(root, 4, saved)
    assert_loads_exactly(root, 5, saved)

    # a restarted job writes its base once more, and the old writer goes once no one refers to it
    launch(_train_and_save, 4, str(root), [6, 7], 2)
    names = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
    assert names == ["iter_0000006", "iter_0000007"]
    assert all(
        f.startswith("../iter_0000006/")
        for key, files in storage_paths(root / "iter_0000007").items()
        if is_frozen(key)
        for f in files
    )


def test_a_damaged_shared_file_is_named_by_every_checkpoint_that_uses_it(tmp_path):
    root = tmp_path / "run"
    launch(_train_and_save, 4, str(root), [1, 2, 3], 3)
    shared = root / "iter_0000001" / "__0_0.distcp"
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shared.write_bytes(bytes(data))
    for name in ("iter_0000001", "iter_0000002", "iter_0000003"):
        report = check_checkpoint(name, str(root / name))
        assert not report["ok"], name
        assert any("__0_0.distcp" in str(p) for p in report["problems"]), report["problems"]


def _save_twice_then_resave_first(rank: int, world: int, root: str):
    topo = sp.Topology(2, 1, 2)
    state = frozen_state(topo)
    ckpt = sp.Checkpointer(root, topology=topo)
    for it in (1, 2):
        step(state, it)
        ckpt.save(it, state)
    try:
        ckpt.save(1, state)
    except sp.CheckpointError as exc:
        return str(exc)
    finally:
        ckpt.close()
    return None


def test_saving_over_a_referred_checkpoint_is_refused_before_any_byte(tmp_path):
    root = tmp_path / "run"
    errors = launch(_save_twice_then_resave_first, 4, str(root))
    assert all(e is not None and "iter_0000002" in e and "iter_0000001" in e for e in errors), errors
    for name in ("iter_0000001", "iter_0000002"):
        assert check_checkpoint(name, str(root / name))["ok"]
    assert not any(n.startswith(".shardpoint-tmp") for n in os.listdir(root))


@pytest.mark.parametrize("point", ["during-retention", "mid-retention"])
def test_kill_while_retiring_a_referred_checkpoint_loses_nothing(tmp_path, point):
    root = tmp_path / "run"
    fault = f"point={point},rank=0,action=kill"
    codes = launch(_train_and_save, 4, str(root), [1, 2], 1, fault, expect_failure=True)
    assert codes[0] == -9, codes
    first = root / "iter_0000001"
    assert (first / "__0_0.distcp").exists()
    if point == "mid-retention":  # it stopped being a checkpoint; the referred files stay
        assert (first / HELD_NOTE).exists() and not (first / MARKER_NAME).exists()
    assert check_checkpoint("iter_0000002", str(root / "iter_0000002"))["ok"]
    resumed = launch(_load, 4, str(root), 2)
    assert {r["iteration"] for r in resumed} == {2}
    # the next run's retention finishes the job: nothing refers to iteration 1 once 2 is retired
    launch(_train_and_save, 4, str(root), [3], 1)
    assert sorted(n for n in os.listdir(root) if n.startswith("iter_")) == ["iter_0000003"]


def test_marker_wins_over_a_held_note(tmp_path):
    """Killed between writing the note and removing the marker: still a committed checkpoint."""
    root = tmp_path / "run"
    model = torch.nn.Linear(4, 4)
    ckpt = sp.Checkpointer(str(root))
    ckpt.save(1, sp.TrainState(model=model))
    ckpt.close()
    (root / "iter_0000001" / HELD_NOTE).write_text("{}")
    entries = commit.list_checkpoints(LocalStorage(str(root)), str(root), get_layout("megatron"))
    assert [(e.name, e.committed) for e in entries] == [("iter_0000001", True)]


def _single(root: Path, dedup: bool, edit=None, freeze: bool = True) -> tuple[torch.nn.Module, sp.Checkpointer]:
    """Two saves of a model whose first layer is not trained (``freeze``: also ``requires_grad=False``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    model[0].requires_grad_(not freeze)
    state = sp.TrainState(model=model, optimizer=torch.optim.SGD(model[1].parameters(), lr=0.1))
    ckpt = sp.Checkpointer(str(root), dedup=dedup)
    for it in (1, 2):
        model[1].weight.data.add_(1.0)
        if edit is not None and it == 2:
            edit(model)
        ckpt.save(it, state)
    ckpt.close()
    return model, ckpt


def test_dedup_false_writes_every_tensor(tmp_path):
    _single(tmp_path / "run", dedup=False)
    paths = storage_paths(tmp_path / "run" / "iter_0000002")
    assert not any(f.startswith("..") for files in paths.values() for f in files)


def test_a_frozen_tensor_changed_in_place_is_written_again(tmp_path):
    root = tmp_path / "run"

    def edit(model):  # through .data: no version counter moves, only the bytes
        model[0].weight.data[0, 0] += 1.0

    model, _ = _single(root, dedup=True, edit=edit)
    paths = storage_paths(root / "iter_0000002")
    assert not any(f.startswith("..") for f in paths["model.0.weight"])  # changed: its own bytes
    assert all(f.startswith("../iter_0000001/") for f in paths["model.0.bias"])  # unchanged: referred
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    sp.Checkpointer(str(root)).load(sp.TrainState(model=fresh), iteration=2)
    for key, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], tensor), key


@pytest.mark.parametrize("edit", [False, True])
def test_a_parameter_no_optimizer_group_holds_is_stored_once_too(tmp_path, edit):
    """An optimizer over the head only, nothing marked frozen: the body is unchanged, so stored once; edited
    in place (torch.no_grad, as a hand-made update would), it is written again."""
    root = tmp_path / "run"

    def change(model):
        with torch.no_grad():
            model[0].weight.add_(1.0)

    model, _ = _single(root, dedup=True, edit=change if edit else None, freeze=False)
    paths = storage_paths(root / "iter_0000002")
    assert all(f.startswith("../iter_0000001/") for f in paths["model.0.bias"])
    assert all(f.startswith("../iter_0000001/") for f in paths["model.0.weight"]) != edit
    assert not any(f.startswith("..") for f in paths["model.1.weight"])  # trained: written
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    sp.Checkpointer(str(root)).load(sp.TrainState(model=fresh), iteration=2)
    for key, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], tensor), key


def test_which_parameters_are_candidates_follows_what_the_optimizer_holds():
    """In no group of an optimizer over the model's own parameters: a candidate. An optimizer over master
    copies (fp32 copies of the weights beside a norm held directly) makes nothing a candidate: the model's
    weights change although the optimizer does not hold them."""
    from shardpoint.state.train_state import collect

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    head_only = torch.optim.SGD(model[1].parameters(), lr=0.1)
    assert collect(sp.TrainState(model, head_only), iteration=1).frozen == {"model.0.weight", "model.0.bias"}
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in model[0].parameters()]
    over_masters = torch.optim.SGD([*masters, *model[1].parameters()], lr=0.1)
    assert collect(sp.TrainState(model, over_masters), iteration=1).frozen == set()
    model[0].requires_grad_(False)  # marked frozen: a candidate whatever the optimizer holds
    assert collect(sp.TrainState(model, over_masters), iteration=1).frozen == {"model.0.weight", "model.0.bias"}
