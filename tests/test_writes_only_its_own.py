"""shardpoint writes only into what is new or its own (issue 54, defects 5 and 12; invariant 10).

* ``export`` writes something new: ``--to hf`` into a committed checkpoint (which
  ``verify`` then called damaged) or over an earlier export, and ``--to safetensors`` /
  ``--to release`` into a checkpoint or another run's directory, are refused before
  anything is read or written, naming the target and the fix.
* A save or a ``convert`` into a directory holding a Megatron-LM (or DeepSpeed) run
  would replace that run's tracker, and its resume would find shardpoint's checkpoint:
  refused, naming the tracker file, whose bytes stay as they were. shardpoint's own
  run, an empty directory and a tracker naming nothing still take a save.

Commands run in this process through ``cli.main`` (a fresh interpreter costs seconds of
imports on 2 cores); the Megatron-LM and DeepSpeed runs are the real fixtures.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint import cli
from shardpoint.commands.verify import check_checkpoint
from shardpoint.storage.base import ForeignDataError
from tests import distributed

FOREIGN = Path(__file__).parent / "fixtures" / "foreign"
MEGATRON = FOREIGN / "megatron-legacy-tp1" / "ckpt"  # iter_0000002/ and latest_checkpointed_iteration.txt
DEEPSPEED = FOREIGN / "deepspeed-pipe2" / "ckpt"  # global_step2/ and latest
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with the hash of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()
    }


def state() -> sp.TrainState:
    model = torch.nn.Linear(4, 4)
    return sp.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))


def shardpoint_run(root: Path, iterations=(1,)) -> Path:
    with sp.Checkpointer(root) as ckpt:
        for it in iterations:
            ckpt.save(it, state())
    return root


def run(capsys, *argv: object) -> tuple[int, str]:
    """``shardpoint ARGV`` in this process: exit code and stderr."""
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def verifies(checkpoint: Path) -> bool:
    report = check_checkpoint(checkpoint.name, str(checkpoint))
    return report["ok"] and not report["problems"]


# ----------------------------------------------------------------- export (defect 5)
def test_export_to_hf_into_a_committed_checkpoint_is_refused_and_it_still_verifies(tmp_path, capsys):
    checkpoint = shardpoint_run(tmp_path / "run") / "iter_0000001"
    before = tree(checkpoint)
    code, err = run(capsys, "export", MEGATRON, "--to", "hf", checkpoint)
    assert code != 0 and str(checkpoint) in err and "new or empty directory" in err, err
    assert tree(checkpoint) == before and verifies(checkpoint)
    inside = checkpoint / "hf"  # a new folder, but inside the checkpoint
    code, err = run(capsys, "export", MEGATRON, "--to", "hf", inside)
    assert code != 0 and "inside the shardpoint checkpoint" in err and str(checkpoint) in err, err
    assert tree(checkpoint) == before and not inside.exists()


def test_export_to_hf_over_an_earlier_export_is_refused_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "hf"
    code, err = run(capsys, "export", MEGATRON, "--to", "hf", out)
    assert code == 0, err
    first = tree(out)
    code, err = run(capsys, "export", MEGATRON, "--to", "hf", out, "--dtype", "bf16")
    assert code != 0 and str(out) in err and "config.json" in err and "new or empty directory" in err, err
    assert tree(out) == first
    (tmp_path / "empty").mkdir()  # an empty directory holds nothing to lose: taken
    assert run(capsys, "export", MEGATRON, "--to", "hf", tmp_path / "empty")[0] == 0


def test_export_and_convert_into_a_checkpoint_are_refused(tmp_path, capsys):
    source = shardpoint_run(tmp_path / "src")
    other = shardpoint_run(tmp_path / "other", (1, 2))
    before = tree(other)
    code, err = run(capsys, "export", source, "--to", "safetensors", other / "iter_0000002")
    assert code != 0 and "inside the shardpoint checkpoint" in err, err
    code, err = run(capsys, "export", source, "--to", "release", other)  # would move its tracker to 'release'
    assert code != 0 and str(other) in err and MEGATRON_TRACKER in err and "new or empty directory" in err, err
    for how in ([], ["--to", "megatron", "--tp", 1, "--pp", 1]):  # convert writes a new save directory too
        code, err = run(capsys, "convert", *how, source, other / "iter_0000002" / "converted")
        assert code != 0 and "inside the shardpoint checkpoint" in err, err
    assert tree(other) == before and all(verifies(other / n) for n in ("iter_0000001", "iter_0000002"))
    assert run(capsys, "export", source, "--to", "release", tmp_path / "release")[0] == 0


# ----------------------------------------------------------------- another run's tracker (defect 12)
@pytest.mark.parametrize(
    "fixture, layout, tracker, named",
    [(MEGATRON, "megatron", MEGATRON_TRACKER, "iter_0000002"), (DEEPSPEED, "neox", "latest", "global_step2")],
    ids=["megatron", "deepspeed"],
)
def test_a_save_into_another_tools_run_is_refused_and_its_tracker_stays(tmp_path, fixture, layout, tracker, named):
    root = tmp_path / "run"
    shutil.copytree(fixture, root)
    before = tree(root)
    ckpt = sp.Checkpointer(root, layout=layout)
    with pytest.raises(ForeignDataError) as info:
        ckpt.save(3, state())  # a new iteration: the iteration directory itself is free
    message = str(info.value)
    assert str(root / tracker) in message and named in message and "another directory" in message, message
    ckpt.close()
    after = {k: v for k, v in tree(root).items() if k != ".shardpoint.lock"}  # the writer lock, shardpoint's own
    assert after == before


def test_convert_into_a_megatron_run_is_refused_and_its_tracker_stays(tmp_path, capsys):
    source = shardpoint_run(tmp_path / "src")
    target = tmp_path / "megatron"
    shutil.copytree(MEGATRON, target)
    before = tree(target)
    code, err = run(capsys, "convert", source, target)
    assert code != 0 and str(target / MEGATRON_TRACKER) in err and "iter_0000002" in err, err
    assert run(capsys, "export", MEGATRON, "--to", "hf", tmp_path / "hf")[0] == 0
    code, err = run(capsys, "convert", "--from", "hf", tmp_path / "hf", target)  # an import: a release, its tracker
    assert code != 0 and str(target / MEGATRON_TRACKER) in err, err
    assert {k: v for k, v in tree(target).items() if k != ".shardpoint.lock"} == before


def test_shardpoints_own_run_an_empty_directory_and_a_tracker_naming_nothing_still_take_saves(tmp_path, capsys):
    root = shardpoint_run(tmp_path / "own", (1, 2))  # its own tracker: every later save moves it
    assert (root / MEGATRON_TRACKER).read_text() == "2"
    (tmp_path / "empty").mkdir()
    assert run(capsys, "convert", root, tmp_path / "empty")[0] == 0
    assert run(capsys, "convert", root, root, "--layout", "neox")[0] != 0  # (its source: refused as before)
    lost = shardpoint_run(tmp_path / "lost")
    (lost / MEGATRON_TRACKER).write_text("7")  # names a directory that is not there: proves nothing
    shardpoint_run(lost, (8,))
    assert (lost / MEGATRON_TRACKER).read_text() == "8"
    damaged = shardpoint_run(tmp_path / "damaged")
    (damaged / MEGATRON_TRACKER).write_bytes(b"\xff")  # a damaged tracker of its own: the next save repairs it
    shardpoint_run(damaged, (2,))
    assert (damaged / MEGATRON_TRACKER).read_text() == "2"


def _save_into_megatron_run(rank: int, world: int, root: str) -> str:
    ckpt = sp.Checkpointer(root, topology=sp.Topology(1, 1, world, rank=rank))
    try:
        ckpt.save(3, state())
        outcome = "saved"
    except sp.CheckpointError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    ckpt.close()
    return outcome


def test_every_rank_gets_the_refusal(tmp_path):
    """2 gloo ranks: rank 0 finds the tracker another tool wrote; rank 1 raises too, and nothing is written."""
    root = tmp_path / "run"
    shutil.copytree(MEGATRON, root)
    before = tree(root)
    outcomes = distributed.launch(_save_into_megatron_run, 2, str(root))
    assert all(o.startswith("ForeignDataError") or MEGATRON_TRACKER in o for o in outcomes), outcomes
    assert all(MEGATRON_TRACKER in o for o in outcomes), outcomes
    assert {k: v for k, v in tree(root).items() if k != ".shardpoint.lock"} == before


# ----------------------------------------------------------------- prune and a dead re-save's trash
def test_prune_puts_back_a_moved_aside_checkpoint_before_retiring_what_it_refers_to(tmp_path, capsys):
    """iter_10 is held (retired, its frozen file kept) for iter_30 alone; a re-save of iter_30 died between the
    two renames of its publish, leaving iter_30 as ``.shardpoint-trash-*``. prune used to retire held directories
    first (the trash is no referrer it lists), deleting iter_10's file, and then put iter_30 back without it."""
    root = tmp_path / "run"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    model[0].requires_grad_(False)
    train = sp.TrainState(model=model, optimizer=torch.optim.SGD(model[1].parameters(), lr=0.1))
    with sp.Checkpointer(root) as ckpt:
        ckpt.save(10, train)  # writes the frozen layer
        ckpt.save(30, train)  # refers to iter_0000010's file for it
        with torch.no_grad():
            model[0].weight.add_(1.0)
            model[0].bias.add_(1.0)
        ckpt.save(40, train)  # the frozen layer changed: its own bytes, refers to nothing
    assert run(capsys, "prune", root, "--keep-last", "2")[0] == 0  # iter_0000010: held for iter_0000030
    assert (root / "iter_0000010" / ".shardpoint-referenced").is_file()
    moved = root / ".shardpoint-trash-iter_0000030-4242"  # what a publish killed between its renames leaves
    (root / "iter_0000030").rename(moved)
    code, err = run(capsys, "prune", root, "--keep-last", "2")
    assert code == 0, err
    assert not moved.exists() and verifies(root / "iter_0000030"), check_checkpoint("", str(root / "iter_0000030"))
    assert verifies(root / "iter_0000040")
