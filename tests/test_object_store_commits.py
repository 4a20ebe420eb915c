"""Object-store commits at the two seams issue 54 found open: a re-save of an existing iteration, two writers.

On s3://, gs:// and az:// (moto, fake-gcs-server, Azurite) a save writes into a staging prefix of its
own and a create-only claim decides which of two saves of one iteration commits
(:mod:`shardpoint.lifecycle.commit`). These tests kill a re-save before its commit and race two jobs
saving the same iteration, and check what the local-disk protocol guarantees: the committed checkpoint
stays loadable, exactly, until a new one replaces it whole.
"""

from __future__ import annotations

import os
import threading
import time

import torch

import shardpoint as sp
from shardpoint.storage.object_store import object_filesystem
from tests.distributed import launch
from tests.test_checkpointer import make_state, train
from tests.test_cli_s3 import run_cli

TRACKER = "latest_checkpointed_iteration.txt"


def _tensors(state: sp.TrainState) -> dict[str, torch.Tensor]:
    """Model weights and optimizer moments: what "exactly" compares."""
    out = {f"model.{k}": v.clone() for k, v in state.model.state_dict().items()}
    for pid, entry in state.optimizer.state_dict()["state"].items():
        out.update({f"optim.{pid}.{k}": v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor)})
    return out


def _assert_exactly(expected: dict[str, torch.Tensor], state: sp.TrainState) -> None:
    got = _tensors(state)
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


def _resave_and_die(rank: int, world: int, root: str, point: str) -> None:
    """A job rolled back to iteration 1 that saves iteration 2 again and is killed at ``point``."""
    state = make_state(7)
    ckpt = sp.Checkpointer(root)
    ckpt.load(state, iteration=1)
    train(state, 3)
    os.environ["SHARDPOINT_FAULT"] = f"point={point},rank=0,action=kill"
    ckpt.save(2, state)


def test_a_resave_killed_before_its_commit_leaves_the_old_checkpoint_loadable(cloud, cloud_bucket):
    """Defect 3: the re-save used to remove the committed iteration first; killed after its data
    (``before-marker``), load() and load(fallback=True) then raised although nothing newer had committed."""
    root = f"{cloud_bucket}/run"
    state = make_state()
    ckpt = sp.Checkpointer(root)
    ckpt.save(1, state)
    train(state)
    ckpt.save(2, state)
    committed = _tensors(state)
    codes = launch(_resave_and_die, 1, root, "before-marker", env=cloud.env, expect_failure=True)
    assert codes == [-9], codes
    assert object_filesystem(root).cat_file(f"{root}/{TRACKER}") == b"2"
    for fallback in (False, True):
        fresh = make_state(3)
        result = sp.Checkpointer(root).load(fresh, fallback=fallback)
        assert result.iteration == 2
        _assert_exactly(committed, fresh)


def _racer(rank: int, world: int, root: str, seed: int, barrier: str) -> dict:
    """One of two single-rank jobs saving iteration 7 under one prefix at the same instant."""
    state = make_state(seed)
    train(state)
    open(os.path.join(barrier, f"ready-{seed}"), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(barrier)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # both jobs are up: they start their saves together
    # both write their data, then wait a moment before committing: both began before either commits
    os.environ["SHARDPOINT_FAULT"] = "point=before-marker,rank=0,action=stall,seconds=1"
    try:
        sp.Checkpointer(root).save(7, state)
        outcome = "committed"
    except sp.ConcurrentSaveError as exc:
        outcome = f"ConcurrentSaveError: {exc}"
    return {"outcome": outcome, "tensors": _tensors(state)}


def test_two_writers_of_one_iteration_exactly_one_commits(cloud, cloud_bucket, tmp_path):
    """Defect 6: both used to return (the second replacing the first), or the loser's cleanup deleted the
    winner's committed objects. Exactly one commits; the other gets ConcurrentSaveError and leaves the
    winner's checkpoint as it committed."""
    root = f"{cloud_bucket}/run"
    results: dict[int, dict] = {}

    def job(seed: int) -> None:
        results[seed] = launch(_racer, 1, root, seed, str(tmp_path), env=cloud.env)[0]

    threads = [threading.Thread(target=job, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    outcomes = sorted(r["outcome"].split(":")[0] for r in results.values())
    assert outcomes == ["ConcurrentSaveError", "committed"], outcomes
    (winner,) = [r for r in results.values() if r["outcome"] == "committed"]
    assert object_filesystem(root).cat_file(f"{root}/{TRACKER}") == b"7"
    checked = run_cli(cloud.env, "verify", root, "--json")  # every file of the tracked checkpoint, checksummed
    assert checked.rc == 0 and checked.json()["ok"], checked.out + checked.err
    fresh = make_state(5)
    assert sp.Checkpointer(root).load(fresh, verify=True).iteration == 7
    _assert_exactly(winner["tensors"], fresh)
    names = [p.rsplit("/", 1)[-1] for p in object_filesystem(root).ls(root, detail=False)]
    assert not [n for n in names if n.startswith(".shardpoint-tmp-")], names  # the loser removed only its own
