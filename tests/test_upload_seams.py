"""``upload_to`` at its seams: a re-save, a second writer and a second job's start-up (issue 54, defect 3).

Each test runs on an object store (moto) and on a local path, which stands for a
cluster's shared filesystem mounted on every node. The two-rank cells of
tests/test_seams.py run the same faults on every store; these pin each defect with one
rank in one process, so each takes a second or two.
"""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest

import shardpoint as sp
from tests.distributed import launch
from tests.test_checkpointer import assert_same, make_state, train


@pytest.fixture(params=["local", "s3"])
def remote(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "shared" / "run")
    request.getfixturevalue("s3_server")
    return f"{request.getfixturevalue('bucket')}/run"


def _names(remote: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(remote)
    fs.invalidate_cache()  # s3fs caches listings
    if not fs.exists(root):
        return []  # an object store's prefix with no objects left
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


def _loaded(remote: str) -> tuple[int, sp.TrainState]:
    fresh = make_state(9)
    result = sp.Checkpointer(remote).load(fresh)
    return result.iteration, fresh


def test_a_resave_that_fails_mid_upload_keeps_the_committed_checkpoint(remote, tmp_path, monkeypatch):
    """Rolled back and saving iteration 2 again: until the new upload commits, the old one stays loadable."""
    committed = make_state()
    with sp.Checkpointer(tmp_path / "a", upload_to=remote) as ckpt:
        ckpt.save(2, committed)
    again = make_state()
    train(again)
    ckpt = sp.Checkpointer(tmp_path / "b", upload_to=remote)
    ckpt.mirror.max_attempts = 1
    monkeypatch.setenv("SHARDPOINT_FAULT", "point=during-upload,rank=0,action=raise")
    ckpt.save(2, again)
    with pytest.raises(sp.StorageError, match="failed 1 times"):
        ckpt.close()
    monkeypatch.delenv("SHARDPOINT_FAULT")
    iteration, fresh = _loaded(remote)
    assert iteration == 2
    assert_same(committed, fresh)
    assert not [n for n in _names(remote) if n.startswith(".shardpoint-tmp-")]  # the failed upload removed its own


def test_a_save_begun_before_another_jobs_commit_does_not_replace_it(remote, tmp_path):
    """Two writers: B began saving iteration 3 first, A committed it while B wrote; B's upload must lose.

    B saves asynchronously, so its upload begins only at its ``close()``, after A's
    commit: what B may replace is what the store held when B's save began.
    """
    first, second = make_state(1), make_state(2)
    late = sp.Checkpointer(tmp_path / "b", upload_to=remote, async_save=True)
    late.save(3, second)  # began: iteration 3 does not exist yet
    with sp.Checkpointer(tmp_path / "a", upload_to=remote) as winner:
        winner.save(3, first)
    with pytest.raises(sp.ConcurrentSaveError, match="iter_0000003"):
        late.close()
    iteration, fresh = _loaded(remote)
    assert iteration == 3
    assert_same(first, fresh)
    assert not [n for n in _names(remote) if n.startswith(".shardpoint-tmp-")]  # the loser removed its own


def test_another_jobs_start_never_removes_a_live_upload(remote, tmp_path):
    """A job starting against the same store cleans dead uploads only: a live one's objects stay and commit."""
    state = make_state()
    ckpt = sp.Checkpointer(tmp_path / "a", upload_to=remote)
    ckpt.save(3, state)
    ckpt.mirror._pending.writer.wait()  # every object uploaded; the commit waits for the next poll
    sp.Checkpointer(tmp_path / "b", upload_to=remote).close()  # another job's start-up cleans leftovers
    ckpt.close()
    iteration, fresh = _loaded(remote)
    assert iteration == 3
    assert_same(state, fresh)


def _killed_mid_upload(rank: int, world: int, local: str, remote: str) -> None:
    ckpt = sp.Checkpointer(local, upload_to=remote)
    os.environ["SHARDPOINT_FAULT"] = "point=during-upload,rank=0,action=kill"
    ckpt.save(1, make_state())
    ckpt.close()


def test_a_killed_upload_is_removed_once_older_than_the_leftover_age(remote, tmp_path, monkeypatch, request):
    """What a job killed mid-upload staged is removed by a later job, but only once it cannot be a live upload."""
    env = request.getfixturevalue("s3_server").env if remote.startswith("s3://") else {}
    launch(_killed_mid_upload, 1, str(tmp_path / "dead"), remote, env=env, expect_failure=True)
    assert [n for n in _names(remote) if n.startswith(".shardpoint-tmp-iter_0000001-")]
    sp.Checkpointer(tmp_path / "next", upload_to=remote).close()
    young = [n for n in _names(remote) if n.startswith(".shardpoint-tmp-")]
    assert bool(young) == remote.startswith("s3://")  # a filesystem's writer lock is free: the writer is dead
    monkeypatch.setenv("SHARDPOINT_LEFTOVER_AGE", "0")
    sp.Checkpointer(tmp_path / "next", upload_to=remote).close()
    assert not [n for n in _names(remote) if n.startswith((".shardpoint-tmp-", "iter_"))]


def test_a_local_upload_target_is_written_by_one_job_at_a_time(tmp_path):
    """A shared filesystem has no create-only claim: a second live job's upload is refused, nothing of it lands."""
    remote = str(tmp_path / "shared" / "run")
    state = make_state()
    with sp.Checkpointer(tmp_path / "a", upload_to=remote) as first:
        first.save(1, state)
        other = sp.Checkpointer(tmp_path / "b", upload_to=remote)
        with pytest.raises(sp.ConcurrentSaveError, match="another"):
            other.save(2, make_state(5))
        other.close()
    assert sorted(p.name for p in Path(remote).iterdir() if not p.name.startswith(".")) == [
        "iter_0000001",
        "latest_checkpointed_iteration.txt",
    ]
    iteration, fresh = _loaded(remote)
    assert iteration == 1
    assert_same(state, fresh)
