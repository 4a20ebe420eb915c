"""``ShardpointTrainer`` in real ``torchrun`` jobs on CPU (gloo), with the real ``transformers.Trainer``.

The jobs run in tests/integration_hf_trainer_worker.py (see its phases). Shown here:

* DDP at 2 ranks: a run stopped after step 4 of 6 and resumed in new processes ends
  with weights, optimizer state and scheduler bit-identical to an uninterrupted run;
  ``shardpoint verify`` passes on what was written; ``save_total_limit`` holds; a
  flipped byte in the newest checkpoint (a data file, or ``trainer_state.json``) is
  named on resume; a disk failing mid-save leaves no ``checkpoint-6``;
* ``load_best_model_at_end`` with ``save_total_limit=1``: the best checkpoint survives
  retention and its weights are the ones loaded at the end;
* transformers' own FSDP2 at 2 ranks (``from_pretrained(distributed_config=...)``, which
  the stock Trainer refuses to checkpoint), resumed by one process with every tensor
  of model and optimizer as saved. Accelerate's FSDP plugin does not run on CPU
  (Accelerate keeps ``MULTI_CPU`` and ignores the plugin), so this is the FSDP2 path a
  CPU can test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers.trainer_utils import get_last_checkpoint

WORKER = str(Path(__file__).with_name("integration_hf_trainer_worker.py"))
BIN = Path(sys.executable).parent
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}


def run_worker(phase: str, out: Path, nproc: int = 2, timeout: float = 240) -> None:
    """One phase of the worker: under torchrun with ``nproc`` ranks, or as one plain process."""
    launcher = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    done = subprocess.run(
        [*launcher, WORKER, phase, str(out)], capture_output=True, text=True, timeout=timeout, env=ENV
    )
    assert done.returncode == 0, f"{phase} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


def verify(directory: Path) -> subprocess.CompletedProcess:
    """``shardpoint verify --all`` as a user runs it."""
    return subprocess.run(
        [str(BIN / "shardpoint"), "verify", str(directory), "--all"], capture_output=True, text=True, timeout=120
    )


def damaged_copy(source: Path, target: Path, file_of) -> str:
    """Copy the save directory ``source``, flip one byte of ``file_of(newest checkpoint)``; the file's name."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".shardpoint.lock"))
    newest = Path(get_last_checkpoint(str(target)))
    path = file_of(newest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return path.name


def largest_data_file(checkpoint: Path) -> Path:
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def assert_same_state(a: dict, b: dict) -> None:
    """Model tensors, optimizer state, learning rates and scheduler, bit for bit."""
    assert sorted(a["model"]) == sorted(b["model"])
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sorted(state_a) == sorted(state_b) and state_a
    for param, values in state_a.items():
        assert sorted(values) == sorted(state_b[param])
        for name, value in values.items():
            assert torch.equal(value, state_b[param][name]), (param, name)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["lr"] == b["lr"] and a["scheduler"] == b["scheduler"]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The DDP runs, the damaged copies of ``stopped/``, then the resumes; the names of the damaged files."""
    out = tmp_path_factory.mktemp("hf_ddp")
    run_worker("ddp-runs", out)
    damaged = {
        "corrupt": damaged_copy(out / "stopped", out / "corrupt", largest_data_file),
        "corrupt_state": damaged_copy(out / "stopped", out / "corrupt_state", lambda c: c / "trainer_state.json"),
    }
    shutil.copytree(out / "stopped", out / "failsave", ignore=shutil.ignore_patterns(".shardpoint.lock"))
    run_worker("ddp-resume", out)
    return out, damaged


def test_ddp_stop_and_resume_is_bit_identical(ddp):
    out, _ = ddp
    full, stopped, resumed = load(out / "full.pt"), load(out / "stopped.pt"), load(out / "resumed.pt")
    assert (full["global_step"], stopped["global_step"], resumed["global_step"]) == (6, 4, 6)
    assert not all(torch.equal(v, full["model"][k]) for k, v in stopped["model"].items())  # it did stop early
    assert_same_state(full, resumed)
    # the Trainer's own names, each with its trainer_state.json; save_total_limit=2 through retention
    run = out / "stopped"
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint-4", "checkpoint-6"]
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-6")
    state = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6 and state["max_steps"] == 6
    checked = verify(run)  # checkpoint-4 written before the stop, checkpoint-6 after the resume
    assert checked.returncode == 0 and "2 checkpoint(s) verified" in checked.stdout, checked.stdout + checked.stderr


def test_ddp_damaged_newest_checkpoint_is_named_on_resume(ddp):
    out, damaged = ddp
    for copy, name in damaged.items():
        for rank in (0, 1):
            error = (out / f"{copy}.error{rank}").read_text()
            assert "Error" in error and name in error and "checkpoint-4" in error, error
    assert "checksum mismatch" in (out / "corrupt.error0").read_text()


def test_ddp_save_failing_midway_leaves_the_last_checkpoint(ddp):
    out, _ = ddp
    for rank in (0, 1):
        assert "injected fault at mid-data on rank 1" in (out / f"failsave.error{rank}").read_text()
    run = out / "failsave"
    # no checkpoint-6, complete or not, and no partial files left: the tracker still names checkpoint-4
    assert sorted(p.name for p in run.iterdir()) == [
        ".shardpoint.lock",
        "checkpoint-2",
        "checkpoint-4",
        "latest_checkpoint.txt",
    ]
    assert get_last_checkpoint(str(run)) == str(run / "checkpoint-4")
    assert (run / "latest_checkpoint.txt").read_text() == "checkpoint-4"


def test_best_model_survives_save_total_limit_and_is_loaded(ddp):
    out, _ = ddp
    best = json.loads((out / "best.json").read_text())
    run = out / "best"
    # step 4 scored best: kept beside the newest (save_total_limit=1), and its weights loaded at the end
    assert best["best_model_checkpoint"] == str(run / "checkpoint-4")
    assert best["best_loaded"]
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint-4", "checkpoint-6"]
    metrics = json.loads((run / "checkpoint-4" / "shardpoint.json").read_text())["metrics"]
    assert metrics == {"eval_score": 0.9}


def test_fsdp2_saved_at_two_ranks_resumes_at_one(tmp_path):
    run_worker("fsdp-save", tmp_path)
    run = tmp_path / "fsdp"
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint-2", "checkpoint-4"]
    marker = json.loads((run / "checkpoint-4" / "shardpoint.json").read_text())
    assert marker["topology"] == {"tp": 1, "pp": 1, "dp": 2}

    run_worker("fsdp-resume", tmp_path, nproc=1)
    reference, resumed = load(tmp_path / "reference.pt"), load(tmp_path / "fsdp_resume.pt")
    assert reference["global_step"] == 4 and resumed["loaded"]["global_step"] == 4
    assert_same_state(reference, resumed["loaded"])  # every tensor as the two ranks saved it
    assert resumed["global_step"] == 6
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["checkpoint-4", "checkpoint-6"]
    marker = json.loads((run / "checkpoint-6" / "shardpoint.json").read_text())
    assert marker["topology"] == {"tp": 1, "pp": 1, "dp": 1}
    checked = verify(run)  # checkpoint-4 from the two FSDP2 ranks, checkpoint-6 from the one process
    assert checked.returncode == 0 and "2 checkpoint(s) verified" in checked.stdout, checked.stdout + checked.stderr
