"""``shardpoint demo --nnodes 2``: the demo on torchrun "nodes" with node-local disks and object storage.

Phases::

    reference  uninterrupted run at the first layout (local ranks, as in the one-node demo)
    train      N torchrun agents joined by c10d rendezvous on 127.0.0.1, each a "node"
               with its own checkpoint directory (no node reads another's) uploading to
               the object store; the last node's agent and ranks are SIGKILLed mid-run,
               once a checkpoint has been committed to the object store
    resume     one torchrun agent at the reshard layout: loads what the object store's
               tracker names (resharded) and trains to the end

Without an ``s3://`` ``--dir`` the demo starts a loopback S3 server (``moto_server``,
from ``pip install 'moto[server]'``) for itself; to use a real store, pass
``--dir s3://bucket/prefix`` with the standard AWS variables (``AWS_ENDPOINT_URL``, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

import shardpoint as sp
from shardpoint.catalog.layout import get_layout
from shardpoint.demo.phases import prepare_directories, reference_phase
from shardpoint.demo.procs import free_port
from shardpoint.demo.report import PhaseReport, compare_losses, phase_progress, plot_losses
from shardpoint.demo.trainer import TrainConfig
from shardpoint.lifecycle import commit
from shardpoint.storage.base import open_storage

__all__ = ["loopback_s3", "run_cluster_demo", "wait_for_s3_server"]

_WORKER = "shardpoint.demo.cluster_worker"


@contextmanager
def loopback_s3(directory: str) -> Any:
    """Yield the ``s3://`` root to use: ``directory`` itself, or a bucket on a moto_server started here."""
    if directory.startswith("s3://"):
        yield directory
        return
    server = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    if not os.path.exists(server):
        raise sp.CheckpointError(
            "demo --nnodes needs object storage: install moto ('pip install \"moto[server]\"') for a loopback "
            "S3 server, or pass --dir s3://bucket/prefix with AWS_ENDPOINT_URL and credentials set"
        )
    port = free_port()
    process = subprocess.Popen(
        [server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    try:
        wait_for_s3_server(port, process)
        os.environ.update(
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="demo", AWS_SECRET_ACCESS_KEY="demo"
        )
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        from shardpoint.storage.s3 import s3_filesystem

        s3_filesystem().mkdir("shardpoint-demo")
        yield "s3://shardpoint-demo/demo"
    finally:
        process.terminate()
        process.wait(10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wait_for_s3_server(port: int, process: subprocess.Popen) -> None:
    """Block until the moto_server ``process`` answers on ``port`` (30 s at most)."""
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return
        except OSError:
            if time.time() > deadline or process.poll() is not None:
                raise sp.CheckpointError("the loopback S3 server (moto_server) did not start") from None
            time.sleep(0.2)


class _Agent:
    """One torchrun agent (a node) and the ranks it started."""

    def __init__(self, command: list[str], log: str):
        with open(log, "w") as f:
            self.process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        """SIGKILL the agent and its ranks (children in sessions of their own), as a node losing power."""
        pids, todo = [self.process.pid], [self.process.pid]
        while todo:
            pid = todo.pop()
            try:
                children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            except OSError:
                continue
            pids += children
            todo += children
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(30)


def _start_agents(config: TrainConfig, node_dirs: list[str], log_dir: str) -> tuple[list[_Agent], str]:
    """torchrun agents for ``config`` (one per node directory), joined by c10d rendezvous; and the events file."""
    os.makedirs(log_dir, exist_ok=True)
    world = config.tp * config.pp * config.dp
    config_path, events = os.path.join(log_dir, "config.json"), os.path.join(log_dir, "events.jsonl")
    Path(config_path).write_text(json.dumps(asdict(config)))
    port, rdzv_id = free_port(), uuid.uuid4().hex[:12]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    agents = []
    for index, node_dir in enumerate(node_dirs):
        command = [
            *([torchrun] if os.path.exists(torchrun) else [sys.executable, "-m", "torch.distributed.run"]),
            f"--nnodes={len(node_dirs)}",
            f"--nproc-per-node={world // len(node_dirs)}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={rdzv_id}",
            "--rdzv-conf=join_timeout=120",
            "--local-addr=127.0.0.1",
            "--max-restarts=0",
            "-m",
            _WORKER,
            f"--config={config_path}",
            f"--save={node_dir}",
            f"--events={events}",
        ]
        agents.append(_Agent(command, os.path.join(log_dir, f"node{index}.log")))
    return agents, events


def _read_events(path: str) -> dict[int, float]:
    if not os.path.exists(path):
        return {}
    lines = Path(path).read_text().splitlines()
    return {e["iteration"]: e["loss"] for e in map(json.loads, filter(None, lines))}


def _run_phase(
    name: str, config: TrainConfig, node_dirs: list[str], log_dir: str, progress: Progress, kill_when: Any = None
) -> tuple[PhaseReport, dict[str, Any] | None, int | None]:
    """Run one torchrun job to its end; ``kill_when(losses)`` True SIGKILLs the last node (then the others).

    Returns the phase's report, rank 0's result (None when it did not finish) and the
    iteration after which the node was killed (None: it was not).
    """
    task = progress.add_task(name, total=config.train_iters, loss="-")
    agents, events = _start_agents(config, node_dirs, log_dir)
    started, deadline, killed = time.perf_counter(), time.time() + 900, None
    while any(a.process.poll() is None for a in agents):
        losses = _read_events(events)
        if losses:
            progress.update(task, completed=max(losses), loss=f"{losses[max(losses)]:.3f}")
        if kill_when is not None and killed is None and kill_when(losses):
            agents[-1].kill()
            killed = max(losses)
            deadline = min(deadline, time.time() + 120)  # the others fail in their next collective
        if time.time() > deadline:
            for agent in agents:
                agent.kill()
        time.sleep(0.1)
    result_path = f"{events}.result.json"
    result = json.loads(Path(result_path).read_text()) if os.path.exists(result_path) else None
    losses = {int(k): v for k, v in result["losses"].items()} if result else _read_events(events)
    saves = result["saves"] if result else []
    report = PhaseReport(
        name,
        (config.tp, config.pp, config.dp),
        losses,
        sum(s["seconds"] for s in saves),
        sum(s["bytes"] for s in saves),
        time.perf_counter() - started,
        exit_codes=[a.process.returncode for a in agents],
    )
    return report, result, killed


def run_cluster_demo(
    settings: Any, nnodes: int, remote_root: str, out: str, console: Console, show_progress: bool = True
) -> tuple[list[PhaseReport], list[str]]:
    """The phases of the module docstring; returns their reports and the checks that failed."""
    storage = open_storage(remote_root)
    prepare_directories([(storage, storage.root, "--dir"), (open_storage(out), out, "--out")])
    node_root = os.path.join(out, "nodes")
    shutil.rmtree(node_root, ignore_errors=True)
    node_dirs = [os.path.join(node_root, f"node{k}") for k in range(nnodes)]
    run_remote = storage.join(storage.root, "run")
    n, problems = settings.iters, []
    progress = phase_progress(console, show_progress, width=26)
    tracker = get_layout("megatron")

    def committed_remotely(losses: dict[int, float]) -> bool:
        return bool(losses) and max(losses) >= n // 2 and commit.read_tracker(storage, run_remote, tracker)[0]

    with progress:
        reference = reference_phase(replace(settings, directory=remote_root), storage, storage.root, out, progress)
        config = settings.train_config(node_dirs[0], settings.layout, upload_to=run_remote)
        train, _, killed = _run_phase(
            f"train ({nnodes} nodes)", config, node_dirs, os.path.join(out, "logs", "train"), progress,
            kill_when=committed_remotely,
        )  # fmt: skip
        _, at_kill = commit.read_tracker(storage, run_remote, tracker)
        config = settings.train_config(node_dirs[0], settings.reshard_layout, upload_to=run_remote)
        resume, result, _ = _run_phase(
            "resume (1 node, resharded)", config, node_dirs[:1], os.path.join(out, "logs", "resume"), progress
        )
    train.note = f"node {nnodes - 1} SIGKILLed after it {killed}; agents exited {train.exit_codes}"
    train.comparison = compare_losses(train.losses, reference.losses)
    resume.comparison = compare_losses(resume.losses, reference.losses)
    loaded = (result or {}).get("loaded_from") or "nothing"
    resume.note = f"from it {at_kill} in the object store ({loaded}), saved at {train.layout_text}"
    if killed is None:
        problems.append(f"the {nnodes}-node run ended before a node could be killed; pass more --iters")
    if train.comparison != "bit-identical":
        problems.append(f"the {nnodes}-node run is not bit-identical to the reference ({train.comparison})")
    if result is None or max(resume.losses, default=0) != n:
        problems.append(f"the resumed run did not reach iteration {n}; see {os.path.join(out, 'logs', 'resume')}")
    elif result.get("start_iteration") != at_kill or not str(loaded).startswith("s3://"):
        problems.append(f"the resumed run started from {loaded} at {result.get('start_iteration')}, not {at_kill}")
    plot_losses([train, resume], reference.losses, os.path.join(out, "loss.png"))
    return [reference, train, resume], problems
