"""``shardpoint demo --nnodes 2``: torchrun nodes with node-local dirs and a loopback S3; one lost, resume on one."""

from __future__ import annotations

import json

import pytest

from shardpoint.cli import main


@pytest.mark.long  # tests/test_multinode.py loses a node and resumes resharded from S3
def test_demo_on_two_nodes_loses_one_and_resumes_resharded_from_the_object_store(tmp_path, capsys):
    directory = tmp_path / "demo"
    code = main(["demo", "--nnodes", "2", "--iters", "8", "--save-interval", "2", "--dir", str(directory), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0, summary["problems"]
    _, train, resume = summary["phases"]
    assert train["name"] == "train (2 nodes)" and train["comparison"] == "bit-identical"
    assert train["exit_codes"][1] == -9  # the second node's agent was SIGKILLed
    assert resume["layout"] == [1, 2, 2] and max(map(int, resume["losses"])) == 8
    assert "in the object store (s3://" in resume["note"]
    # the resume started from a checkpoint every rank had uploaded, before the node was lost
    assert min(map(int, resume["losses"])) - 1 <= max(map(int, train["losses"]))
    # the lost node kept only its own parts; the one-node resume saved whole checkpoints on node 0's disk
    lost = directory / "nodes" / "node1"
    assert list(lost.glob("iter_*/shardpoint-node.json")) and not list(lost.glob("iter_*/shardpoint.json"))
    assert (directory / "nodes" / "node0" / "latest_checkpointed_iteration.txt").read_text() == "8"
    assert (directory / "loss.png").stat().st_size > 10_000


@pytest.mark.long  # tests/test_local_tier.py replaces a node and resumes from the replicas
def test_demo_local_tier_loses_both_nodes_and_resumes_from_node_0s_replicas(tmp_path, capsys):
    """--local-interval 2: every node SIGKILLed, node 1 replaced empty; the restart loses fewer steps than S3 would."""
    directory = tmp_path / "demo"
    argv = ["demo", "--nnodes", "2", "--local-interval", "2", "--iters", "10", "--save-interval", "5"]
    code = main([*argv, "--dir", str(directory), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0, summary["problems"]
    _, train, resume = summary["phases"]
    assert train["exit_codes"] == [-9, -9] and train["comparison"] == "bit-identical"
    recovery = resume["recovery"]
    killed, persistent, local = recovery["killed_after"], recovery["persistent_iteration"], recovery["local_iteration"]
    # killed with the local tier ahead of the object store (persistent 5): local saves at 6 and 8 (10 is persistent)
    assert persistent == 5 and killed in (8, 9) and local in (6, 8)
    assert min(map(int, resume["losses"])) == local + 1 and max(map(int, resume["losses"])) == 10
    assert resume["comparison"] == "bit-identical"  # weights, optimizer, data position and RNG restored
    lost = recovery["steps_lost"]
    assert lost == {"with_tier": killed - local, "without_tier": killed - persistent}
    assert lost["with_tier"] < lost["without_tier"]
    tiers = {int(rank): tuple(where) for rank, where in recovery["tiers"].items()}
    assert sorted(tier for tier, _ in tiers.values()) == ["local", "local", "peer", "peer"]
    for tier, source in tiers.values():  # node 1 came back empty: everything came from node 0's disk
        assert "local/node0/run-run-" in source and f"/local_{local:07d}/" in source, source
        assert ("replica held by rank" in source) == (tier == "peer")
