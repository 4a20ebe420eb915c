"""An elastic job (issue 35 item 4): torchrun's own elastic agent restarts it at another node count.

Two agents (``--nnodes 1:2 --max-restarts 1``, c10d rendezvous on 127.0.0.1), one rank
each, a persistent directory both see and a local tier per node. Node 1 is SIGKILLed
after step 6 (persistent save at 4, local copies up to 6). Node 0's rank fails at its
next all-reduce; its agent re-rendezvouses alone and restarts it at dp=1. The local
tier's copies are at dp=2 and cannot serve dp=1: the restart loads the persistent
checkpoint of step 4 at dp=1, and says why. A later restart of the same one node
(same layout) then loads the newest local copy.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import torch

from tests import toy
from tests.distributed import free_port
from tests.multinode import TORCHRUN, Node, wait_job

WORKER = str(Path(__file__).with_name("elastic_worker.py"))


def _agent(index: int, port: int, rdzv_id: str, local_dir: Path, args: list[str], out: Path) -> Node:
    command = [
        TORCHRUN,
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        # a lost node drops out of the rendezvous after 2 missed 1 s heartbeats; a round closes
        # 10 s after its first node arrives (time for the second agent's start; a round that
        # closed with one node would admit the second only by restarting the first one's rank)
        "--rdzv-conf=join_timeout=120,last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=2",
        "--local-addr=127.0.0.1",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        WORKER,
        *args,
        f"--out={out}",
    ]
    env = {**os.environ, "MN_LOCAL_DIR": str(local_dir), "OMP_NUM_THREADS": "1"}
    log = out / f"agent{index}.log"
    with open(log, "a") as f:
        process = subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return Node(process, log, str(local_dir))


def _listening(port: int, timeout: float = 60) -> None:
    """Until the rendezvous store (hosted by the first agent) accepts connections."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"no rendezvous store on port {port}")


def _start(nodes: int, tmp: Path, args: list[str], out: Path) -> list[Node]:
    """Agent 0 first, so that it hosts the rendezvous store (the node the test keeps)."""
    out.mkdir(parents=True, exist_ok=True)
    port, rdzv_id = free_port(), os.urandom(6).hex()
    agents = [_agent(0, port, rdzv_id, tmp / "node0", args, out)]
    _listening(port)
    agents += [_agent(i, port, rdzv_id, tmp / f"node{i}", args, out) for i in range(1, nodes)]
    return agents


def _wait_files(paths: list[Path], agents: list[Node], timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not all(p.exists() for p in paths):
        if time.time() > deadline or any(a.process.poll() is not None for a in agents):
            for a in agents:
                a.kill() if a.process.poll() is None else None
            logs = "\n".join(a.tail() for a in agents)
            raise AssertionError(f"waiting for {[p.name for p in paths if not p.exists()]}\n{logs}")
        time.sleep(0.1)


def test_an_elastic_restart_on_fewer_nodes_loads_the_persistent_store_then_the_local_tier(tmp_path):
    persistent = tmp_path / "persistent"
    args = [f"--persistent={persistent}", "--steps=10", "--hold-at=6"]
    out = tmp_path / "elastic"
    agents = _start(2, tmp_path, args, out)
    _wait_files([out / "held_0", out / "held_1"], agents)
    first = [torch.load(out / f"attempt0_rank{r}.pt", weights_only=False) for r in range(2)]
    assert [f["world"] for f in first] == [2, 2] and sorted(first[0]["saves"]) == [4]
    agents[1].kill()  # node 1 is lost: its agent and its rank
    (out / "release").touch()  # node 0 trains on, fails at its next all-reduce, and is restarted alone
    wait_job(agents[:1], timeout=240)

    again = torch.load(out / "attempt1_rank0.pt", weights_only=False)
    assert again["world"] == 1 and again["loaded"]["iteration"] == 4 and again["loaded"]["tier"] == "persistent"
    said = " ".join(text for _, text in again["messages"])
    assert "the local tier loads only at the layout it was saved at" in said, said
    # step 4 at dp=1 is step 4 at dp=2, bit for bit (model and optimizer): as the first attempt saved it
    saved = toy.assemble([f["saves"][4] for f in first])
    loaded = toy.assemble([again["loaded"]["snapshot"]])
    assert saved.keys() == loaded.keys() and any(k.startswith("optimizer.") for k in saved)
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), key

    # the same node restarted at the same layout: the local tier's newest copy (step 10)
    out2 = tmp_path / "same"
    agents = _start(1, tmp_path, [f"--persistent={persistent}", "--steps=12"], out2)
    wait_job(agents, timeout=240)
    same = torch.load(out2 / "attempt0_rank0.pt", weights_only=False)
    assert same["loaded"]["tier"] == "local" and same["loaded"]["iteration"] == 10
    final = toy.assemble([again["final"]])
    for key, tensor in toy.assemble([same["loaded"]["snapshot"]]).items():
        assert torch.equal(tensor, final[key]), key
