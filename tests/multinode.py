"""Multi-node jobs on this machine with the real launcher: one ``torchrun`` agent per "node".

The agents join through torchrun's c10d rendezvous on 127.0.0.1 (``--rdzv-backend
c10d``), as on a cluster; each agent starts its ranks. A node is simulated by giving
each agent its own local directory (``MN_LOCAL_DIR``) that no other node reads. With
c10d, which agent gets which global ranks is decided by the rendezvous, so the
worker reports its node directory with its results.

Each agent runs in a session of its own; :meth:`Node.kill` SIGKILLs the agent and
every rank it started (ranks are the agent's children, in sessions of their own).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.distributed import free_port

WORKER = str(Path(__file__).with_name("multinode_worker.py"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@dataclass
class Node:
    """One torchrun agent (a simulated node) and its log."""

    process: subprocess.Popen
    log: Path
    local_dir: str

    def descendants(self) -> list[int]:
        """The agent's ranks (and their children), found through /proc."""
        found, todo = [], [self.process.pid]
        while todo:
            pid = todo.pop()
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            found += [int(c) for c in children]
            todo += [int(c) for c in children]
        return found

    def kill(self) -> None:
        """SIGKILL the agent and every rank it started, as a node that loses power."""
        pids = self.descendants()
        for pid in [self.process.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(30)

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""


def start_job(
    local_dirs: list[str],
    nproc: int,
    worker_args: list[str],
    out: Path,
    env: dict[str, str],
    node_env: dict[int, dict[str, str]] | None = None,
) -> list[Node]:
    """Start one torchrun agent per entry of ``local_dirs`` (the nodes), joined by c10d rendezvous."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    rdzv_id = uuid.uuid4().hex[:12]
    nodes = []
    for index, local_dir in enumerate(local_dirs):
        command = [
            TORCHRUN,
            f"--nnodes={len(local_dirs)}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={rdzv_id}",
            "--rdzv-conf=join_timeout=120,read_timeout=120",
            "--local-addr=127.0.0.1",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            WORKER,
            *worker_args,
            f"--out={out}",
        ]
        node_vars = {**os.environ, **env, "MN_LOCAL_DIR": local_dir, "OMP_NUM_THREADS": "1"}
        node_vars.update((node_env or {}).get(index, {}))
        log = out / f"node{index}.log"
        with open(log, "w") as f:
            process = subprocess.Popen(
                command, env=node_vars, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        nodes.append(Node(process, log, local_dir))
    return nodes


def wait_job(nodes: list[Node], timeout: float = 240) -> None:
    """Wait for every agent to exit 0; on failure or timeout kill them all and raise with their logs."""
    deadline = time.time() + timeout
    try:
        for node in nodes:
            node.process.wait(max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    codes = [n.process.poll() for n in nodes]
    if any(c != 0 for c in codes):
        for node in nodes:
            if node.process.poll() is None:
                node.kill()
        logs = "\n".join(f"--- node {i} ({n.local_dir}) ---\n{n.tail()}" for i, n in enumerate(nodes))
        raise AssertionError(f"torchrun agents exited with {codes}\n{logs}")


def run_job(local_dirs: list[str], nproc: int, worker_args: list[str], out: Path, env: dict[str, str]) -> list[dict]:
    """Run a job to completion; every rank's result, by global rank."""
    wait_job(start_job(local_dirs, nproc, worker_args, out, env))
    return results(out, len(local_dirs) * nproc)


def results(out: Path, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"result_{r}.pt", weights_only=False) for r in range(world)]


def wait_for(paths: list[Path], nodes: list[Node], timeout: float = 180) -> None:
    """Until every path exists; raise with the logs if a node died first or time ran out."""
    deadline = time.time() + timeout
    while not all(p.exists() for p in paths):
        dead = [n for n in nodes if n.process.poll() is not None]
        if dead or time.time() > deadline:
            for node in nodes:
                if node.process.poll() is None:
                    node.kill()
            logs = "\n".join(f"--- node {i} ---\n{n.tail()}" for i, n in enumerate(nodes))
            raise AssertionError(f"waiting for {[str(p) for p in paths if not p.exists()]}\n{logs}")
        time.sleep(0.1)
