"""shardpoint never deletes what it did not write: a Megatron-LM checkpoint beside its own survives."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import shardpoint as sp
from shardpoint.commands.verify import check_checkpoint
from shardpoint.lifecycle import commit
from shardpoint.storage.base import open_storage
from shardpoint.storage.s3 import s3_filesystem
from tests.test_cli_commands import run_cli
from tests.test_foreign_import import FIXTURES

FOREIGN = FIXTURES / "megatron-legacy-tp1" / "ckpt" / "iter_0000002"


def state() -> sp.TrainState:
    model = torch.nn.Linear(4, 4)
    return sp.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))


def test_local_foreign_checkpoint_beside_shardpoints_own_is_untouched(tmp_path):
    shutil.copytree(FOREIGN, tmp_path / "iter_0000007")  # Megatron's own files, no shardpoint.json
    ckpt = sp.Checkpointer(tmp_path)
    ckpt.save(1, state())
    ckpt.close()
    assert commit.clean_leftovers(open_storage(str(tmp_path)), str(tmp_path)) == []
    assert (tmp_path / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt").exists()


def test_s3_foreign_prefix_survives_while_a_dead_shardpoint_save_is_removed(s3_server, bucket):
    root = f"{bucket}/run"
    fs = s3_filesystem()
    key = root.removeprefix("s3://")
    fs.put(str(FOREIGN), f"{key}/iter_0000007", recursive=True)  # uploaded by Megatron-LM: no marker
    fs.pipe_file(f"{key}/iter_0000005/.shardpoint-in-progress", b"{}")  # a shardpoint save that died
    fs.pipe_file(f"{key}/iter_0000005/__0_0.distcp", b"half written")
    ckpt = sp.Checkpointer(root)
    ckpt.save(1, state())  # the first save cleans leftovers
    ckpt.close()
    assert fs.exists(f"{key}/iter_0000007/mp_rank_00/model_optim_rng.pt")
    assert not fs.exists(f"{key}/iter_0000005")
    assert not fs.exists(f"{key}/iter_0000001/.shardpoint-in-progress")  # removed once committed
    assert sp.Checkpointer(root).load(state()).iteration == 1


def test_s3_save_refuses_to_overwrite_a_foreign_prefix_of_the_same_name(s3_server, bucket):
    root = f"{bucket}/run"
    fs = s3_filesystem()
    key = root.removeprefix("s3://")
    fs.put(str(FOREIGN), f"{key}/iter_0000002", recursive=True)
    ckpt = sp.Checkpointer(root)
    try:
        ckpt.save(2, state())
        raise AssertionError("the save should have refused")
    except sp.CheckpointError as exc:
        assert "not written by shardpoint" in str(exc)
    assert fs.exists(f"{key}/iter_0000002/mp_rank_00/model_optim_rng.pt")
    assert Path(FOREIGN).exists()


def test_verify_ignores_a_leftover_in_progress_object_but_not_other_strays(tmp_path):
    ckpt = sp.Checkpointer(tmp_path)
    ckpt.save(1, state())
    ckpt.close()
    # what a save on object storage leaves when it dies after the marker, before removing this object
    (tmp_path / "iter_0000001" / commit.IN_PROGRESS_NAME).write_text('{"save": "iter_0000001"}')
    clean = run_cli("verify", tmp_path, "--json")
    assert clean.rc == 0, clean.out + clean.err
    assert clean.json()["checkpoints"][0]["unrecorded"] == []
    (tmp_path / "iter_0000001" / "stray.bin").write_bytes(b"x")  # still reported: the check still runs
    stray = run_cli("verify", tmp_path, "--json")
    assert stray.rc == 1 and stray.json()["checkpoints"][0]["unrecorded"] == ["stray.bin"]


def test_verify_on_s3_ignores_the_in_progress_object_of_a_committed_save(s3_server, bucket):
    root = f"{bucket}/run"
    ckpt = sp.Checkpointer(root)
    ckpt.save(1, state())
    ckpt.close()
    key = root.removeprefix("s3://")
    s3_filesystem().pipe_file(f"{key}/iter_0000001/{commit.IN_PROGRESS_NAME}", b"{}")
    report = check_checkpoint("iter_0000001", f"{root}/iter_0000001")
    assert report["ok"] and report["unrecorded"] == [], report
