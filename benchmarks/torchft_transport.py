"""Healing one rank from another with torchft: ShardpointTransport against torchft's PGTransport.

Two ranks in threads of one process over a real gloo ``ProcessGroupGloo`` on loopback,
as torchft's own transport tests run them. The state: ``--mib`` MiB of float32 tensors
(16 of them). Measured, rounds interleaved, medians of per-round ratios:

- transfer: ``send_checkpoint`` on rank 0 until ``recv_checkpoint`` on rank 1 returns
  (received into new tensors, and in place into rank 1's own), then ``disallow_checkpoint``;
- what the healthy rank waits: how long ``send_checkpoint`` blocks its caller (torchft's
  Manager calls it inside the step), and the time of a fixed CPU step (matmuls) run on
  rank 0 while the transfer goes on, against the same step alone.

    python benchmarks/torchft_transport.py [--mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.checkpointing.pg_transport import PGTransport
from torchft.process_group import ProcessGroupGloo

from shardpoint.integrations.torchft import ShardpointTransport

TIMEOUT = timedelta(seconds=120)


def _groups(world: int = 2) -> list[ProcessGroupGloo]:
    store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)

    def make(rank: int) -> ProcessGroupGloo:
        pg = ProcessGroupGloo(timeout=TIMEOUT)
        pg.configure(store_addr=f"localhost:{store.port}/p", replica_id="0", rank=rank, world_size=world)
        return pg

    with ThreadPoolExecutor(world) as pool:
        groups = list(pool.map(make, range(world)))
    groups.append(store)  # kept alive with the groups
    return groups


def _step() -> float:
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(40):
        a = torch.tanh(a @ a)
    return time.perf_counter() - start


def _round(kind: str, state: dict, own: dict | None) -> dict[str, float]:
    groups = _groups()
    options = {"state_dict": (lambda: own)} if own is not None else {}
    if kind == "http":
        sender, receiver = HTTPTransport(TIMEOUT, num_chunks=0), HTTPTransport(TIMEOUT, num_chunks=0)
    else:
        cls = ShardpointTransport if kind == "shardpoint" else PGTransport
        sender = cls(groups[0], timeout=TIMEOUT, device=torch.device("cpu"))
        receiver = cls(groups[1], timeout=TIMEOUT, device=torch.device("cpu"), **options)
    done = {}

    def recover() -> None:
        receiver.recv_checkpoint(0, sender.metadata(), step=1, timeout=TIMEOUT)
        done["at"] = time.perf_counter()

    thread = threading.Thread(target=recover)
    start = time.perf_counter()
    thread.start()
    sender.send_checkpoint([1], step=1, state_dict=state, timeout=TIMEOUT)  # PGTransport: blocks until sent
    blocked = time.perf_counter() - start
    step = _step()  # the healthy rank's next step, while the transfer goes on (if it still does)
    if kind != "http":  # HTTPTransport serves until disallowed: that waits for nobody's receive
        sender.disallow_checkpoint()
    thread.join()
    if kind == "http":
        sender.disallow_checkpoint()
        for transport in (sender, receiver):
            transport.shutdown(wait=False)
    return {"transfer s": done["at"] - start, "blocked s": blocked, "step s": step}


def _raw(state: dict) -> float:
    """The limit: the same bytes by plain send/recv on the same kind of group, nothing checked or described."""
    groups = _groups()
    targets = [torch.empty_like(v) for v in state.values()]
    start = time.perf_counter()
    works = [groups[0].send([v], 1, tag=i) for i, v in enumerate(state.values())]
    for i, t in enumerate(targets):
        groups[1].recv([t], 0, tag=i).wait(TIMEOUT)
    for w in works:
        w.wait(TIMEOUT)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.mib * (1 << 20) // 4 // 16
    state = {f"layer.{i}": torch.randn(n) for i in range(16)}
    own = {k: torch.zeros_like(v) for k, v in state.items()}
    rows: dict[str, list[dict[str, float]]] = {
        "shardpoint": [],
        "shardpoint in place": [],
        "PGTransport": [],
        "HTTPTransport": [],
    }
    alone = []
    raw = []
    for _ in range(args.repeat):
        alone.append(_step())
        raw.append(_raw(state))
        rows["PGTransport"].append(_round("pg", state, None))
        rows["shardpoint"].append(_round("shardpoint", state, None))
        rows["shardpoint in place"].append(_round("shardpoint", state, own))
        rows["HTTPTransport"].append(_round("http", state, None))
    base = rows["PGTransport"]
    limit = statistics.median(raw)
    print(
        f"{args.mib} MiB over gloo loopback, {args.repeat} rounds; a step alone {statistics.median(alone):.3f} s; "
        f"raw send/recv {limit:.3f} s ({args.mib / 1024 / limit:.2f} GiB/s)"
    )
    for name, found in rows.items():
        ratio = statistics.median(r["transfer s"] / b["transfer s"] for r, b in zip(found, base))
        step = statistics.median(r["step s"] / a for r, a in zip(found, alone))
        blocked = statistics.median(r["blocked s"] for r in found)
        transfer = statistics.median(r["transfer s"] for r in found)
        print(
            f"{name:20s} transfer {transfer:.3f} s ({ratio:.2f}x PGTransport, {transfer / limit:.2f}x raw), "
            f"send_checkpoint blocks "
            f"{blocked * 1e3:.1f} ms, the next step takes {step:.2f}x its time alone"
        )


if __name__ == "__main__":
    main()
