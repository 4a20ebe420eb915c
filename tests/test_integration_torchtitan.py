"""torchtitan: ShardpointCheckpointManager built and driven as torchtitan's trainer does, at 2 gloo ranks.

The jobs (``tests/integration_titan_job.py``) use torchtitan's own containers around a
small model sharded with FSDP2; the full ``Trainer`` needs a GPU here. One module
fixture runs an uninterrupted job, jobs stopped at step 4 of 6 (ours and the stock
``CheckpointManager``), and the resumes, crossed between the two managers; the tests
read what they produced.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpointer.dcp import CheckpointManager

from shardpoint.commands.verify import check_checkpoint
from shardpoint.errors import CheckpointError
from shardpoint.integrations.torchtitan import ShardpointCheckpointManager
from tests import distributed
from tests.integration_titan_job import build, full_state, train

# DeviceMesh looks its process groups up by their C++ name, which the strict backend's
# Python-defined group lacks: the FSDP2 jobs run on plain gloo
gloo_launch = functools.partial(distributed.launch, backend="gloo")
ROOT = Path(__file__).parent.parent
SHARDPOINT = Path(sys.executable).with_name("shardpoint")


def ours(**changes):
    return ShardpointCheckpointManager.Config(enable=True, interval=2, **changes)


def stock(**changes):
    return CheckpointManager.Config(enable=True, interval=2, **changes)


def first_runs(rank: int, world: int, root: str) -> dict:
    """An uninterrupted 6-step job, and jobs stopped after step 4: ours and the stock manager."""
    reference = build(ours(), f"{root}/reference", fsdp=True)
    train(reference, 6)
    reference.checkpointer.close()
    for name, config in (("ours", ours()), ("stock", stock())):
        job = build(config, f"{root}/{name}", fsdp=True)
        train(job, 4)
        job.checkpointer.close()
    return full_state(reference)


RESUMES = {  # name: (manager that resumes, folder it resumes from)
    "ours from ours": (ours, "ours_a"),
    "stock from ours": (stock, "ours_b"),
    "ours from stock": (ours, "stock_a"),
}


def resumes(rank: int, world: int, root: str) -> dict:
    """Each resume loads step 4 and trains to step 6 (or gives its error); a damaged copy is loaded too."""
    results: dict = {}
    for name, (config, folder) in RESUMES.items():
        try:
            job = build(config(), f"{root}/{folder}", fsdp=True)
            loaded = job.checkpointer.load()
            start = job.progress.step
            train(job, 6)
            job.checkpointer.close()
            results[name] = (loaded, start, full_state(job))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException; the test reports it
            results[name] = (False, None, f"{type(exc).__name__}: {exc}")
    damaged = build(ours(), f"{root}/damaged", fsdp=True)
    try:
        damaged.checkpointer.load()
        results["damaged"] = "loaded without an error"
    except CheckpointError as exc:
        results["damaged"] = f"{type(exc).__name__}: {exc}"
    return results


def flip_a_byte(step_dir: Path) -> str:
    """Flip one byte in the middle of the largest data file; returns its name."""
    victim = max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return victim.name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan")
    reference = gloo_launch(first_runs, 2, str(root), timeout=240)
    for name, source in (("ours_a", "ours"), ("ours_b", "ours"), ("damaged", "ours"), ("stock_a", "stock")):
        shutil.copytree(root / source, root / name)
    flipped = flip_a_byte(root / "damaged" / "checkpoint" / "step-4")
    results = gloo_launch(resumes, 2, str(root), timeout=240)
    return {"root": root, "reference": reference, "results": results, "flipped": flipped}


def assert_same(state: dict, reference: dict, what: str) -> None:
    assert state.keys() == reference.keys(), what
    for key, expected in reference.items():
        value = state[key]
        same = torch.equal(value, expected) if isinstance(expected, torch.Tensor) else value == expected
        assert same, f"{what}: {key} differs from the uninterrupted run"


def test_resume_is_bit_identical_to_an_uninterrupted_run(runs):
    for rank in range(2):
        loaded, start, state = runs["results"][rank]["ours from ours"]
        assert loaded and start == 4, state
        assert_same(state, runs["reference"][rank], f"rank {rank}")
        assert any(k.endswith(".exp_avg_sq") for k in state) and state["lr_scheduler.last_epoch"] == 6


def test_step_folders_are_committed_and_pass_shardpoint_verify(runs):
    folder = runs["root"] / "ours" / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == [".shardpoint.lock", "latest_step.txt", "step-2", "step-4"]
    assert (folder / "latest_step.txt").read_text().strip() == "step-4"
    marker = json.loads((folder / "step-4" / "shardpoint.json").read_text())
    assert marker["format"] == "torchtitan" and {".metadata", "__0_0.distcp", "__1_0.distcp"} <= marker["files"].keys()
    assert check_checkpoint("step-4", str(folder / "step-4"))["ok"]
    # the command line, on the copy whose step-4 has a flipped byte: step-2 passes, step-4 is named
    damaged = runs["root"] / "damaged" / "checkpoint"
    done = subprocess.run([SHARDPOINT, "verify", damaged, "--all", "--json"], capture_output=True, text=True)
    reports = {r["name"]: r for r in json.loads(done.stdout)["checkpoints"]}
    assert done.returncode == 1 and reports["step-2"]["ok"] and not reports["step-4"]["ok"], done.stdout
    assert [p["file"] for p in reports["step-4"]["problems"]] == [runs["flipped"]]


def test_a_flipped_byte_in_the_newest_checkpoint_is_named_when_resuming(runs):
    for rank in range(2):
        message = runs["results"][rank]["damaged"]
        assert message.startswith(("CorruptCheckpointError", "CheckpointError")), message
        assert runs["flipped"] in message and "checksum" in message, message


def test_the_stock_manager_loads_ours_and_ours_loads_the_stock_managers(runs):
    for rank in range(2):
        for name in ("stock from ours", "ours from stock"):
            loaded, start, state = runs["results"][rank][name]
            assert loaded and start == 4, (name, state)
            assert_same(state, runs["reference"][rank], f"{name}, rank {rank}")
    # the same DCP checkpoint: keys, stored types and shapes, DCP's flattening paths
    mine = FileSystemReader(runs["root"] / "ours" / "checkpoint" / "step-2").read_metadata()
    theirs = FileSystemReader(runs["root"] / "stock" / "checkpoint" / "step-2").read_metadata()
    assert mine.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    for key, md in theirs.state_dict_metadata.items():
        assert type(mine.state_dict_metadata[key]) is type(md), key
        if hasattr(md, "size"):
            assert (mine.state_dict_metadata[key].size, mine.state_dict_metadata[key].properties.dtype) == (
                md.size,
                md.properties.dtype,
            ), key
    assert mine.planner_data == theirs.planner_data
    assert {
        "lr_scheduler.last_epoch",
        "train_state.step",
        "dataloader.dp_rank_1",
        "tok.weight",
    } <= mine.planner_data.keys()


def options_run(rank: int, world: int, root: str) -> dict:
    """The stock Config fields at 2 replicated ranks, async saves, under the strict (NCCL-rules) backend."""
    config = ours(
        keep_latest_k=2,
        async_mode="async",
        enable_first_step_checkpoint=True,
        last_save_model_only=True,
        export_dtype="bfloat16",
    )
    job = build(config, f"{root}/run", total_steps=7)  # saves 1, 2, 4, 6 in the background, 7 at the end
    train(job, 6)
    at_6 = full_state(job)
    train(job, 7)  # changes every tensor right after save(6) returned
    at_7 = full_state(job)
    job.checkpointer.close()
    found: dict = {"at_6": at_6, "at_7": at_7}
    again = build(ours(), f"{root}/run", total_steps=7)
    try:
        again.checkpointer.load()  # the newest, step 7, holds the model alone (for export), as the stock one's
        found["newest"] = "loaded"
    except CheckpointError as exc:
        found["newest"] = str(exc)
    found["step 6"] = (again.checkpointer.load(step=6), full_state(again))
    partial = build(ours(exclude_from_loading=["lr_scheduler", "dataloader"]), f"{root}/run", total_steps=7)
    found["excluded"] = (partial.checkpointer.load(step=6), full_state(partial))
    seeded = build(ours(initial_load_path=f"{root}/run/checkpoint/step-7"), f"{root}/fresh", total_steps=7)
    found["initial"] = (seeded.checkpointer.load(), full_state(seeded))
    # the model alone from a full checkpoint: most of each file is not read, so its checksum is checked after
    model_only = build(ours(initial_load_path=f"{root}/run/checkpoint/step-6"), f"{root}/fresh2", total_steps=7)
    found["initial, model only"] = (model_only.checkpointer.load(), full_state(model_only))
    for manager in (again, partial, seeded, model_only):
        manager.checkpointer.close()
    return found


def test_stock_config_fields_async_saves_and_retention(tmp_path):
    found = distributed.launch(options_run, 2, str(tmp_path), timeout=240)[0]
    folder = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-6", "step-7"]  # keep_latest_k=2 of 1, 2, 4, 6, 7
    last = FileSystemReader(folder / "step-7").read_metadata().state_dict_metadata
    assert last.keys() == {k.removeprefix("model.") for k in found["at_7"] if k.startswith("model.")}
    assert {md.properties.dtype for md in last.values()} == {torch.bfloat16}
    assert "does not hold the dataloader, lr_scheduler, optimizer, train_state state" in found["newest"]
    loaded, state = found["step 6"]
    assert loaded
    assert_same(state, found["at_6"], "load_step=6 of an async save")
    loaded, state = found["excluded"]
    assert loaded and state["lr_scheduler.last_epoch"] == 0 and state["train_state"] == found["at_6"]["train_state"]
    assert torch.equal(state["optimizer.state.tok.weight.exp_avg"], found["at_6"]["optimizer.state.tok.weight.exp_avg"])
    loaded, state = found["initial"]
    assert loaded and state["train_state"] == {"step": 0, "ntokens_seen": 0}
    for key, value in found["at_7"].items():
        if key.startswith("model."):
            assert torch.equal(state[key], value.to(torch.bfloat16).float()), key
    assert not state["optimizer.state.tok.weight.exp_avg"].any()  # model only
    loaded, state = found["initial, model only"]
    assert loaded and state["train_state"]["step"] == 0 and not state["optimizer.state.tok.weight.exp_avg"].any()
    assert all(torch.equal(state[k], v) for k, v in found["at_6"].items() if k.startswith("model."))


def test_config_like_switches_the_manager_and_keeps_the_settings():
    base = CheckpointManager.Config(interval=10, last_save_model_only=False, async_mode="async", keep_latest_k=3)
    switched = ShardpointCheckpointManager.Config.like(base, enable=True)
    assert type(switched)._owner is ShardpointCheckpointManager  # what config.checkpoint.build() constructs
    assert (switched.interval, switched.last_save_model_only, switched.async_mode, switched.keep_latest_k) == (
        10,
        False,
        "async",
        3,
    )
    with pytest.raises(ValueError, match="last_save_in_hf"):
        ShardpointCheckpointManager.Config(last_save_in_hf=True)
    example = (ROOT / "examples" / "torchtitan_config.py").read_text()
    compile(example, "torchtitan_config.py", "exec")
    assert "config.checkpoint = ShardpointCheckpointManager.Config.like(config.checkpoint)" in example
