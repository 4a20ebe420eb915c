"""Node-local directories on gloo ranks of one launcher (fast): probe, async saves, retention, checks.

The torchrun jobs of test_multinode.py show the same protocol across real agents;
here ranks ``0..1`` and ``2..3`` are given different directories to act as two nodes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint.lifecycle import node_view
from shardpoint.lifecycle.node_local import NODE_MARKER, NodeLocalError, _check_partition, probe_domains
from shardpoint.storage.base import LocalStorage
from shardpoint.storage.s3 import s3_filesystem
from tests import toy
from tests.distributed import launch


def _probe(rank: int, world: int, dirs: list[str]):
    return probe_domains(LocalStorage(dirs[rank]), dirs[rank])


def test_probe_groups_ranks_by_directory(tmp_path):
    split = [str(tmp_path / f"node{r // 2}") for r in range(4)]
    assert launch(_probe, 4, split)[0] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    shared = [str(tmp_path / "shared")] * 4
    assert launch(_probe, 4, shared)[0] == [(0, 1, 2, 3)] * 4
    assert not [p for p in Path(tmp_path).rglob("*") if p.is_file()]  # probes removed


def test_inconsistent_visibility_and_missing_remote_are_refused(tmp_path):
    with pytest.raises(NodeLocalError, match="inconsistently"):
        _check_partition([(0, 1), (1,)], str(tmp_path))
    with pytest.raises(ValueError, match="needs upload_to"):
        sp.Checkpointer(tmp_path / "run", node_local=True)


def _train(rank: int, world: int, base: str, remote: str, steps: int, fmt: str):
    topo = sp.Topology(2, 1, 2)
    toy.seed_rng(topo, seed=7)
    state = toy.build(topo)
    ckpt = sp.Checkpointer(
        f"{base}/node{rank // 2}",
        topology=topo,
        format=fmt,
        upload_to=remote,
        save_interval=2,
        keep_last=1,
        async_save=fmt == "dist",
    )
    result = ckpt.load(state)
    loaded = None
    if result is not None:
        loaded = {"iteration": result.iteration, "opened": dict(result.storage.opened), "state": toy.snapshot(state)}
        ckpt.load(state)  # a second load replaces the first one's node view instead of adding one
        loaded["views"] = len(node_view._VIEWS)
    for step in range((result.iteration if result else 0) + 1, steps + 1):
        toy.train_step(state, step)
        ckpt.maybe_save(step, state)
    ckpt.close()
    views_after_close = len(node_view._VIEWS)
    return {"loaded": loaded, "final": toy.snapshot(state), "node": ckpt._node.ranks, "views": views_after_close}


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_node_parts_retention_restart(s3_server, bucket, tmp_path, fmt):
    """dist (async saves) and torch format: node parts, retention on each node and remotely, exact restart."""
    remote = f"{bucket}/run"
    saved = launch(_train, 4, str(tmp_path), remote, 4, fmt, env=s3_server.env)
    assert [r["node"] for r in saved] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    for node in ("node0", "node1"):  # keep_last=1 applies to each node's parts and to the object store
        assert sorted(p.name for p in (tmp_path / node).iterdir() if not p.name.startswith(".")) == ["iter_0000004"]
        assert (tmp_path / node / "iter_0000004" / NODE_MARKER).exists()
    fs = s3_filesystem()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(remote.removeprefix("s3://"))) == [
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]
    shutil.rmtree(tmp_path / "node1")
    resumed = launch(_train, 4, str(tmp_path), remote, 4, fmt, env=s3_server.env)
    for rank, (before, after) in enumerate(zip(saved, resumed)):
        assert after["loaded"]["iteration"] == 4
        assert after["loaded"]["views"] == 1 and after["views"] == 0  # node views are released
        # torch format: mp ranks' files are written by dp rank 0, all on node 0
        assert (after["loaded"]["opened"]["local"] > 0) == (rank < 2), after["loaded"]["opened"]
        for key, (_, _, tensor) in before["final"]["tensors"].items():
            assert torch.equal(after["loaded"]["state"]["tensors"][key][2], tensor), key
        assert torch.equal(before["final"]["rng"], after["loaded"]["state"]["rng"])
