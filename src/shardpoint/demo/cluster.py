"""``shardpoint demo --nnodes 2``: the demo on torchrun "nodes" with node-local disks and object storage.

Phases::

    reference  uninterrupted run at the first layout (local ranks, as in the one-node demo)
    train      N torchrun agents joined by c10d rendezvous on 127.0.0.1, each a "node"
               with its own checkpoint directory (no node reads another's) uploading to
               the object store; the last node's agent and ranks are SIGKILLed mid-run,
               once a checkpoint has been committed to the object store
    resume     one torchrun agent at the reshard layout: loads what the object store's
               tracker names (resharded) and trains to the end

With ``--local-interval N`` the nodes also keep the non-persistent local tier
(:mod:`shardpoint.tier`, a directory per node under ``--out``, replicated to the other
node) and the phases are instead::

    reference  as above
    train      N nodes, persistent every --save-interval, local every N; once the
               local tier is ahead of the object store, every agent is SIGKILLed
    resume     node 1 replaced by an empty one (no local or staging files); the same
               N nodes resume from the newer local tier, node 1's ranks from node
               0's replicas, and train to the end

and a table of the steps lost with the local tier and without it.

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
from shardpoint.demo.report import PhaseReport, Recovery, compare_losses, phase_progress, plot_losses
from shardpoint.demo.trainer import TrainConfig
from shardpoint.lifecycle import commit
from shardpoint.storage.base import LocalStorage, Storage, open_storage
from shardpoint.storage.object_store import is_object_url
from shardpoint.tier.marker import describe_local_dir

__all__ = ["loopback_s3", "run_cluster_demo", "wait_for_s3_server"]

_WORKER = "shardpoint.demo.cluster_worker"


@contextmanager
def loopback_s3(directory: str) -> Any:
    """Yield the ``s3://`` root to use: ``directory`` itself, or a bucket on a moto_server started here."""
    if is_object_url(directory):
        yield directory
        return
    beside = Path(sys.executable).with_name("moto_server")  # this environment's moto before any on PATH
    server = str(beside) if beside.exists() else shutil.which("moto_server")
    if not server:
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


def _start_agents(
    config: TrainConfig, node_dirs: list[str], log_dir: str, local_dirs: list[str] | None = None
) -> tuple[list[_Agent], str]:
    """torchrun agents for ``config`` (one per node directory), joined by c10d rendezvous; and the events file.

    ``local_dirs``: each node's local-tier directory (with ``config.local_interval``).
    """
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
            *([f"--local-dir={local_dirs[index]}"] if local_dirs else []),
        ]
        agents.append(_Agent(command, os.path.join(log_dir, f"node{index}.log")))
    return agents, events


def _read_events(path: str) -> dict[int, float]:
    if not os.path.exists(path):
        return {}
    lines = Path(path).read_text().splitlines()
    return {e["iteration"]: e["loss"] for e in map(json.loads, filter(None, lines))}


def _run_phase(
    name: str,
    config: TrainConfig,
    node_dirs: list[str],
    log_dir: str,
    progress: Progress,
    kill_when: Any = None,
    kill_all: bool = False,
    local_dirs: list[str] | None = None,
) -> tuple[PhaseReport, dict[str, Any] | None, int | None]:
    """Run one torchrun job to its end; ``kill_when(losses)`` True SIGKILLs the last node (then the others).

    ``kill_all``: SIGKILL every node at once (a failure that leaves no rank to save).

    Returns the phase's report, rank 0's result (None when it did not finish) and the
    iteration after which the node was killed (None: it was not).
    """
    task = progress.add_task(name, total=config.train_iters, loss="-")
    agents, events = _start_agents(config, node_dirs, log_dir, local_dirs)
    started, deadline, killed = time.perf_counter(), time.time() + 900, None
    while any(a.process.poll() is None for a in agents):
        losses = _read_events(events)
        if losses:
            progress.update(task, completed=max(losses), loss=f"{losses[max(losses)]:.3f}")
        if kill_when is not None and killed is None and kill_when(losses):
            for agent in agents if kill_all else agents[-1:]:
                agent.kill()
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

    if settings.local_interval:
        return _local_tier_demo(settings, storage, remote_root, out, node_dirs, progress)
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


def _local_tier_demo(
    settings: Any, storage: Storage, remote_root: str, out: str, node_dirs: list[str], progress: Progress
) -> tuple[list[PhaseReport], list[str]]:
    """The ``--local-interval`` phases of the module docstring; returns their reports and the checks that failed."""
    run_remote, tracker = storage.join(storage.root, "run"), get_layout("megatron")
    local_dirs = [os.path.join(out, "local", f"node{k}") for k in range(len(node_dirs))]
    shutil.rmtree(os.path.join(out, "local"), ignore_errors=True)
    every, n = settings.local_interval, settings.iters
    # kill once the local tier is ahead of the object store, before the next persistent save
    ahead = 2 * every + 1 if 2 * every + 1 < settings.save_interval else every + 1

    def local_tier_ahead(losses: dict[int, float]) -> bool:
        persistent = commit.read_tracker(storage, run_remote, tracker)[1] if losses else None
        return bool(persistent) and persistent + ahead <= max(losses) < persistent + settings.save_interval

    config = settings.train_config(node_dirs[0], settings.layout, upload_to=run_remote, local_interval=every)
    with progress:
        reference = reference_phase(replace(settings, directory=remote_root), storage, storage.root, out, progress)
        train, _, killed = _run_phase(
            f"train ({len(node_dirs)} nodes)", config, node_dirs, os.path.join(out, "logs", "train"), progress,
            kill_when=local_tier_ahead, kill_all=True, local_dirs=local_dirs,
        )  # fmt: skip
        persistent = commit.read_tracker(storage, run_remote, tracker)[1] or 0
        newest_local = _newest_complete(local_dirs[0], config.tp * config.pp * config.dp)
        for directory in (node_dirs[-1], local_dirs[-1]):  # the replacement node starts with empty disks
            shutil.rmtree(directory, ignore_errors=True)
        resume, result, _ = _run_phase(
            f"resume (node {len(node_dirs) - 1} replaced)", config, node_dirs, os.path.join(out, "logs", "resume"),
            progress, local_dirs=local_dirs,
        )  # fmt: skip
    tiers = {int(rank): (tier, source) for rank, (tier, source) in (result or {}).get("loaded_tiers", {}).items()}
    start = (result or {}).get("start_iteration", 0)
    if killed is not None:
        resume.recovery = Recovery(killed, settings.save_interval, persistent, every, start, tiers)
    train.note = f"every node SIGKILLed after it {killed}; agents exited {train.exit_codes}"
    train.comparison = compare_losses(train.losses, reference.losses)
    resume.comparison = compare_losses(resume.losses, reference.losses)
    used = sorted({tier for tier, _ in tiers.values()})
    resume.note = f"from it {start} ({'/'.join(used) or 'nothing'}); the object store had it {persistent}"
    problems = _local_tier_problems(train, resume, killed, persistent, newest_local, tiers, n, len(node_dirs))
    if result is None:
        problems.append(f"the resumed run did not finish; see {os.path.join(out, 'logs', 'resume')}")
    plot_losses([train, resume], reference.losses, os.path.join(out, "loss.png"))
    return [reference, train, resume], problems


def _newest_complete(local_dir: str, world: int) -> int | None:
    """The newest local-tier iteration of which ``local_dir`` (one node) holds every rank's files, or None."""
    rows = describe_local_dir(LocalStorage(local_dir), local_dir)["checkpoints"]
    return max((row["iteration"] for row in rows if len(set(row["ranks_held"])) == world), default=None)


def _local_tier_problems(
    train: PhaseReport,
    resume: PhaseReport,
    killed: int | None,
    persistent: int,
    newest_local: int | None,
    tiers: dict[int, tuple[str, str]],
    n: int,
    nnodes: int,
) -> list[str]:
    """The checks of the ``--local-interval`` demo: resumed from the newer local tier, peers served node 1."""
    problems = []
    if killed is None:
        problems.append("the run ended before the local tier got ahead of the object store; pass more --iters")
    for phase in (train, resume):
        if phase.comparison != "bit-identical":
            problems.append(f"{phase.name} is not bit-identical to the reference ({phase.comparison})")
    if max(resume.losses, default=0) != n:
        problems.append(f"the resumed run stopped at {max(resume.losses, default=0)}, not {n}")
    start = min(resume.losses, default=1) - 1
    if newest_local is None or start != newest_local or start <= persistent:
        problems.append(
            f"the restart resumed from it {start}, not from the local tier's newest complete it {newest_local} "
            f"(the object store had {persistent})"
        )
    kinds = [tier for tier, _ in tiers.values()]
    if not tiers or set(kinds) != {"local", "peer"} or kinds.count("peer") != len(tiers) // nnodes:
        problems.append(f"expected the replaced node's ranks from peers' replicas, the others local: {tiers}")
    return problems
