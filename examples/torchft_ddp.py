"""Two torchft replica groups; one is killed mid-run and its replacement heals through ShardpointTransport.

    python examples/torchft_ddp.py [--steps 12] [--kill-at 5] [--out result.json]

The example starts the lighthouse that the torchft wheel provides, then two replica
groups (one process of one rank each: CPU, gloo), each with a torchft ``Manager``,
torchft's ``DistributedDataParallel`` and ``OptimizerWrapper``, and
:class:`~shardpoint.integrations.torchft.ShardpointTransport` as the checkpoint
transport. When replica 1 reaches ``--kill-at`` it is killed (SIGKILL) and a
replacement starts, from another random initialisation: it joins the next quorum and
heals from replica 0, which never stops. Every replica sees the same batch at a step,
so the result does not depend on who took part: the final weights of both replicas
must equal those of a run where nothing failed (run first, in the same way, without
the kill). Prints what happened and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

SEED_FIRST, SEED_REPLACEMENT = 0, 1234


def replica_manager(replica_id: int, lighthouse: str, model: Any, optimizer: Any, timeout: float = 30) -> tuple:
    """A torchft ``Manager`` for a replica group of one rank, healing through ShardpointTransport.

    Returns ``(manager, transport, store)``; keep the store alive as long as the manager.
    A step needs both replica groups (``min_replica_size=2``), so a lone group waits for
    its peer instead of training on by itself.
    """
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from shardpoint.integrations.torchft import ShardpointTransport

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo()
    transport = ShardpointTransport(
        pg,
        timeout=timedelta(seconds=timeout),
        device=torch.device("cpu"),
        state_dict=lambda: {"user": state_dict()},  # receive in place, as the README shows
    )
    manager = Manager(
        pg=pg,
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=str(replica_id),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        port=0,
        timeout=timedelta(seconds=timeout),
        checkpoint_transport=transport,
    )
    return manager, transport, store


def replica(replica_id: int, lighthouse: str, steps: int, seed: int, out: str) -> None:
    """One replica group's training loop; writes its progress and, at the end, its state to ``out``."""
    from torch import nn
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters())
    manager, transport, _store = replica_manager(replica_id, lighthouse, model, optimizer)
    ddp = DistributedDataParallel(manager, model)
    wrapped = OptimizerWrapper(manager, optimizer)
    started = time.perf_counter()
    first_step, iterations = None, 0
    while manager.current_step() < steps:
        iterations += 1
        step = manager.current_step()
        g = torch.Generator().manual_seed(step)  # the same batch on every replica at a step
        inputs, labels = torch.randn(8, 16, generator=g), torch.randint(4, (8,), generator=g)
        wrapped.zero_grad()
        nn.functional.cross_entropy(ddp(inputs), labels).backward()
        wrapped.step()
        if first_step is None:
            first_step = manager.current_step()  # a healed replacement's first step lands past the healthy one's
        with open(out + ".progress", "w") as f:
            f.write(str(manager.current_step()))
        time.sleep(0.05)  # a step of real work
    with open(out, "w") as f:
        json.dump(
            {
                "weights": {k: v.flatten().tolist() for k, v in model.state_dict().items()},
                "first step": first_step,
                "steps redone": iterations - steps,  # steps whose update was not committed (a peer failed in it)
                "seconds": time.perf_counter() - started,
                "healed": transport.received,
            },
            f,
        )
    manager.shutdown(wait=False)


def _start(replica_id: int, lighthouse: str, steps: int, seed: int, out: str) -> subprocess.Popen:
    args = [sys.executable, __file__, "--replica", str(replica_id), "--lighthouse", lighthouse]
    args += ["--steps", str(steps), "--seed", str(seed), "--out", out]
    return subprocess.Popen(args, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _progress(out: str) -> int:
    try:
        with open(out + ".progress") as f:
            return int(f.read() or 0)
    except (FileNotFoundError, ValueError):
        return -1


def run(steps: int, kill_at: int | None, folder: str) -> dict:
    """Both replicas to ``steps``; with ``kill_at``, replica 1 is SIGKILLed there and replaced."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)  # a step needs both groups: no split brain
    outs = [os.path.join(folder, f"replica{r}-{kill_at}.json") for r in range(2)]
    try:
        procs = [_start(r, lighthouse.address(), steps, SEED_FIRST, outs[r]) for r in range(2)]
        killed_at = None
        if kill_at is not None:
            while _progress(outs[1]) < kill_at and procs[1].poll() is None:
                time.sleep(0.01)
            killed_at = _progress(outs[1])
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait()
            died = time.perf_counter()
            procs[1] = _start(1, lighthouse.address(), steps, SEED_REPLACEMENT, outs[1])
        for proc in procs:
            if proc.wait(timeout=300) != 0:
                raise RuntimeError(f"a replica exited with {proc.returncode}")
    finally:
        lighthouse.shutdown()
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    found = {"replicas": results, "killed at step": killed_at}
    if kill_at is not None:
        found["replacement's first step"] = results[1]["first step"]
        found["healthy replica's steps redone"] = results[0]["steps redone"]
        found["healed"] = results[1]["healed"]
        found["replacement ran s (from its start, after the kill)"] = results[1]["seconds"]
        found["since the kill s"] = time.perf_counter() - died
    return found


def _show(faulty: dict, healed: list[dict], same: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="one replica group killed with SIGKILL, replaced, healed from the other")
    table.add_column("what")
    table.add_column("found")
    heal = healed[0] if healed else {}
    rows = [
        ("replica 1 killed at step", str(faulty["killed at step"])),
        ("steps the healthy replica redid (its update not committed)", str(faulty["healthy replica's steps redone"])),
        ("the replacement healed from", f"rank {heal['from rank']} at step {heal['step']}" if heal else "nothing"),
        ("time to heal (receive and check every chunk)", f"{heal.get('seconds', 0):.3f} s"),
        ("bytes moved", str(heal.get("bytes", 0))),
        ("final weights equal a run without a failure", "yes" if same else "NO"),
    ]
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=SEED_FIRST, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica is not None:
        replica(args.replica, args.lighthouse, args.steps, args.seed, args.out)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        clean = run(args.steps, None, folder)
        faulty = run(args.steps, args.kill_at, folder)
    reference = clean["replicas"][0]["weights"]
    same = all(r["weights"] == reference for r in faulty["replicas"])
    healed = faulty["healed"]
    _show(faulty, healed, same)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"same": same, **{k: v for k, v in faulty.items() if k != "replicas"}}, f, indent=1)
    return 0 if same and healed else 1


if __name__ == "__main__":
    sys.exit(main())
