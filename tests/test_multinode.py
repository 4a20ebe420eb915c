"""Multi-node jobs with real torchrun agents (c10d rendezvous on 127.0.0.1), a real S3 server on loopback.

Each agent is a "node" with its own local directory that no other node reads
(node-local NVMe on a cloud); they share only the object store. See tests/multinode.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint.lifecycle.node_local import NODE_MARKER, PartialCheckpointError
from shardpoint.storage.s3 import s3_filesystem
from tests import toy
from tests.multinode import results, run_job, start_job, wait_for

TRACKER = "latest_checkpointed_iteration.txt"


def _args(tp: int, dp: int, steps: int, save_interval: int, remote: str | None) -> list[str]:
    args = [f"--tp={tp}", f"--dp={dp}", f"--steps={steps}", f"--save-interval={save_interval}"]
    return [*args, f"--remote={remote}"] if remote else args


def assert_same_state(a: dict, b: dict) -> None:
    """Two snapshots of one rank at one layout: same weights, moments, schedule, counters and RNG."""
    assert a["tensors"].keys() == b["tensors"].keys()
    for key, (_, _, tensor) in a["tensors"].items():
        assert torch.equal(tensor, b["tensors"][key][2]), key
    assert a["lr"] == b["lr"] and a["sched"] == b["sched"] and a["extra"] == b["extra"]
    assert torch.equal(a["rng"], b["rng"])


def assert_same_full_tensors(a: list[dict], b: list[dict]) -> None:
    """Snapshots of all ranks of two layouts assemble to bit-identical full tensors (model and optimizer)."""
    full_a, full_b = toy.assemble(a), toy.assemble(b)
    assert full_a.keys() == full_b.keys() and any(k.startswith("optimizer.") for k in full_a)
    for key in full_a:
        assert torch.equal(full_a[key], full_b[key]), key


def _remote_text(remote: str, name: str) -> bytes | None:
    fs = s3_filesystem()
    path = f"{remote.removeprefix('s3://')}/{name}"
    return fs.cat_file(path) if fs.exists(path) else None


def test_node_lost_during_upload_restart_on_two_nodes_then_one(s3_server, bucket, tmp_path):
    """2 nodes × 2 ranks with node-local dirs and upload_to.

    Iteration 2 is saved and uploaded; node 1 is SIGKILLed (agent and ranks) while it
    uploads iteration 4, which both nodes had committed locally. Then: the remote
    tracker still names 2; a restart on 2 nodes with node 1's disk wiped loads 2
    exactly (node 0 reading its own part from its disk); a restart on 1 node at another
    layout loads 2 from the object store with bit-identical full tensors.
    """
    remote = f"{bucket}/run"
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    out = tmp_path / "save"
    stall = {1: {"MN_STALL_UPLOAD_AFTER": "2"}}
    args = [*_args(2, 2, 4, 2, remote), "--wait-uploads-until=2"]
    nodes = start_job(dirs, 2, args, out, s3_server.env, node_env=stall)
    wait_for([out / f"result_{r}.pt" for r in range(4)] + [Path(dirs[1]) / "iter_0000004" / NODE_MARKER], nodes)
    nodes[1].kill()  # node 1 is lost mid-upload: its agent and both its ranks
    nodes[0].kill()  # the job is then restarted by the scheduler
    saved = results(out, 4)
    assert all(r["node_local"] for r in saved)
    assert _remote_text(remote, TRACKER) == b"2"
    assert _remote_text(remote, "iter_0000004/shardpoint.json") is None
    # each node keeps its own part: a node marker, no shardpoint.json, no tracker
    for d in dirs:
        for name in ("iter_0000002", "iter_0000004"):
            assert (Path(d) / name / NODE_MARKER).exists()
            assert not (Path(d) / name / "shardpoint.json").exists()
        assert not (Path(d) / TRACKER).exists()
    with pytest.raises(PartialCheckpointError, match="one node's part"):
        sp.Checkpointer(dirs[0]).load(toy.build(sp.Topology(2, 1, 2, rank=0)))
    # a damaged local file is read from the object store instead
    victim = max((Path(dirs[0]) / "iter_0000002").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    shutil.rmtree(dirs[1])  # a replacement node: nothing local
    restarted = run_job(dirs, 2, _args(2, 2, 2, 2, remote), tmp_path / "restart", s3_server.env)
    for before, after in zip(saved, restarted):
        assert after["loaded"]["iteration"] == 2
        assert_same_state(before["saves"][2], after["loaded"]["snapshot"])
        if after["node_dir"] == dirs[1]:
            assert after["loaded"]["opened"]["local"] == 0 and after["loaded"]["opened"]["remote"] > 0
    # node 0 read its own part from its disk (which of its ranks reads which file depends on the
    # ranks c10d gave each node, which may differ from the save's)
    assert sum(r["loaded"]["opened"]["local"] for r in restarted if r["node_dir"] == dirs[0]) > 0

    # fewer nodes, another layout (tp=1 dp=2 on one node): from the object store, resharded
    fewer = run_job([dirs[0]], 2, _args(1, 2, 2, 2, remote), tmp_path / "fewer", s3_server.env)
    assert {r["loaded"]["iteration"] for r in fewer} == {2}
    assert all(r["loaded"]["path"].startswith("s3://") and not r["node_local"] for r in fewer)
    assert_same_full_tensors([r["saves"][2] for r in saved], [r["loaded"]["snapshot"] for r in fewer])


def test_shared_directory_on_two_nodes_exact_resume(s3_server, bucket, tmp_path):
    """Two agents, one directory for both (NFS/Lustre style): the classic commit, and an exact resume."""
    remote = f"{bucket}/run"
    shared = str(tmp_path / "shared")
    first = run_job([shared, shared], 2, _args(2, 2, 5, 3, remote), tmp_path / "first", s3_server.env)
    assert not any(r["node_local"] for r in first)
    assert (Path(shared) / TRACKER).read_text() == "3" and (Path(shared) / "iter_0000003" / "shardpoint.json").exists()
    assert _remote_text(remote, TRACKER) == b"3"
    resumed = run_job([shared, shared], 2, _args(2, 2, 5, 3, remote), tmp_path / "resumed", s3_server.env)
    for before, after in zip(first, resumed):
        assert after["loaded"]["iteration"] == 3 and after["loaded"]["path"].startswith(shared)
        assert_same_state(before["saves"][3], after["loaded"]["snapshot"])
        assert_same_state(before["final"], after["final"])
