"""``shardpoint demo --nnodes 2``: torchrun nodes with node-local dirs and a loopback S3; one lost, resume on one."""

from __future__ import annotations

import json

from shardpoint.cli import main


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
