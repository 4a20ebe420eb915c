"""Healing a replica group with torchft: ShardpointTransport against torchft's PGTransport and HTTPTransport.

A replica group of ``--group-ranks`` ranks heals from a healthy one: each recovering rank
receives ``--mib`` MiB of float32 tensors (16 of them) from its counterpart, all at once,
over real gloo ``ProcessGroupGloo`` pairs on loopback (HTTPTransport: its HTTP server),
every rank a thread of one process as torchft's own transport tests run them. Rounds
interleave the transports; medians (of per-round ratios where a ratio is shown):

- transfer: from the first ``send_checkpoint`` until the last ``recv_checkpoint`` returns
  (received into new tensors, and in place into the recovering ranks' own); against a
  raw send/recv of the same bytes on the same kind of groups (the limit);
- what the healthy ranks wait: how long ``send_checkpoint`` blocks its caller (torchft's
  Manager calls it inside the step), and the time of a fixed CPU step (matmuls) run
  right after it while the transfer may still go on, against the same step alone.

    python benchmarks/torchft_transport.py [--mib 256] [--group-ranks 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

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


def _round(kind: str, states: list[dict], owns: list[dict] | None) -> dict[str, float]:
    """One heal of a replica group of ``len(states)`` ranks: each rank from its counterpart, all at once."""
    found: dict[str, list[float]] = {"done": [], "blocked": [], "step": []}
    lock = threading.Lock()
    pairs = [_pair(kind, own) for own in (owns or [None] * len(states))]
    start = time.perf_counter()

    def recover(receiver: Any, sender: Any) -> None:
        receiver.recv_checkpoint(0, sender.metadata(), step=1, timeout=TIMEOUT)
        with lock:
            found["done"].append(time.perf_counter() - start)

    def serve(sender: Any, state: dict) -> None:  # a healthy rank: send, then its next step
        began = time.perf_counter()
        sender.send_checkpoint([1], step=1, state_dict=state, timeout=TIMEOUT)  # PGTransport: blocks until sent
        blocked = time.perf_counter() - began
        step = _step()
        if kind != "http":  # HTTPTransport serves until disallowed: that waits for nobody's receive
            sender.disallow_checkpoint()
        with lock:
            found["blocked"].append(blocked)
            found["step"].append(step)

    threads = [threading.Thread(target=recover, args=(r, s)) for s, r, _ in pairs]
    threads += [threading.Thread(target=serve, args=(s, state)) for (s, _, _), state in zip(pairs, states)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for sender, receiver, _ in pairs:
        if kind == "http":
            sender.disallow_checkpoint()
            for transport in (sender, receiver):
                transport.shutdown(wait=False)
    return {"transfer s": max(found["done"]), "blocked s": max(found["blocked"]), "step s": max(found["step"])}


def _pair(kind: str, own: dict | None) -> tuple[Any, Any, Any]:
    """A healthy rank's transport and its recovering counterpart's, on a group of their own."""
    if kind == "http":
        return HTTPTransport(TIMEOUT, num_chunks=0), HTTPTransport(TIMEOUT, num_chunks=0), None
    groups = _groups()
    cls = ShardpointTransport if kind == "shardpoint" else PGTransport
    options = {"state_dict": (lambda: own)} if own is not None else {}
    sender = cls(groups[0], timeout=TIMEOUT, device=torch.device("cpu"))
    return sender, cls(groups[1], timeout=TIMEOUT, device=torch.device("cpu"), **options), groups


def _raw(states: list[dict]) -> float:
    """The limit: the same bytes by plain send/recv on the same kind of groups, nothing checked or described."""
    pairs = [_groups() for _ in states]
    start = time.perf_counter()

    def move(groups: list, state: dict) -> None:
        targets = [torch.empty_like(v) for v in state.values()]
        works = [groups[0].send([v], 1, tag=i) for i, v in enumerate(state.values())]
        for i, t in enumerate(targets):
            groups[1].recv([t], 0, tag=i).wait(TIMEOUT)
        for w in works:
            w.wait(TIMEOUT)

    with ThreadPoolExecutor(len(states)) as pool:
        list(pool.map(move, pairs, states))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--group-ranks", type=int, default=2, help="ranks per replica group (each heals from its peer)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.mib * (1 << 20) // 4 // 16
    state = [{f"layer.{i}": torch.randn(n) for i in range(16)} for _ in range(args.group_ranks)]
    own = [{k: torch.zeros_like(v) for k, v in s.items()} for s in state]
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
        f"{args.group_ranks} ranks per group, {args.mib} MiB each, over gloo loopback, {args.repeat} rounds; "
        f"a step alone {statistics.median(alone):.3f} s; "
        f"raw send/recv {limit:.3f} s ({args.group_ranks * args.mib / 1024 / limit:.2f} GiB/s)"
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
