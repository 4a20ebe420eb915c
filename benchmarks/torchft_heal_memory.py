"""What making a failed heal harmless costs the recovering rank: host copies per chunk, or staging.

A failed heal (a damaged chunk, a sender killed midway) must leave the recovering rank's
state as it was. ``ShardpointTransport`` receives in place and keeps a host copy of each
chunk of the rank's own tensors before overwriting it ("in place"); the alternative is to
receive into new tensors and copy them into the rank's own only once every chunk is
checked ("staging"). This receives ``--mib`` MiB of float32 tensors (16 of them) from a
sender in another process (gloo loopback), ``--rounds`` times, and reports for each way
the time of a heal and the recovering process's peak resident memory above what it held
before the heal (``VmHWM`` reset through ``/proc/self/clear_refs``; Linux only).

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/torchft_heal_memory.py [--mib 256] [--rounds 6]

(The fixed mmap threshold makes glibc return freed tensors to the system at once, so that
one heal's peak does not hide in memory kept from the previous one.)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from datetime import timedelta

import torch

TIMEOUT = timedelta(seconds=120)


def _group(port: int, rank: int):
    from torchft.process_group import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=TIMEOUT)
    pg.configure(store_addr=f"localhost:{port}/p", replica_id="0", rank=rank, world_size=2)
    return pg


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i}": torch.randn(mib * (1 << 20) // 4 // 16, generator=g) for i in range(16)}


def _sender(port: int, mib: int, rounds: int) -> None:
    from shardpoint.integrations.torchft import ShardpointTransport

    torch.set_num_threads(1)
    transport = ShardpointTransport(_group(port, 0), timeout=TIMEOUT, device=torch.device("cpu"))
    state = _state(mib)
    for step in range(rounds):
        transport.send_checkpoint([1], step=step, state_dict=state, timeout=TIMEOUT)
        transport.disallow_checkpoint()


def _mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field))


def _measure(way: str, mib: int, rounds: int) -> tuple[list[float], list[float]]:
    """Heals ``rounds`` times; returns each heal's seconds and peak MiB above the RSS before it."""
    from torch.distributed import TCPStore

    from shardpoint.integrations.torchft import ShardpointTransport

    store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    sender = mp.get_context("spawn").Process(target=_sender, args=(store.port, mib, rounds))
    sender.start()
    expected = _state(mib)
    own = {k: torch.full_like(v, 1.0) for k, v in expected.items()}
    options = {"state_dict": lambda: own} if way == "in place" else {}
    receiver = ShardpointTransport(_group(store.port, 1), timeout=TIMEOUT, device=torch.device("cpu"), **options)
    seconds, extra = [], []
    for step in range(rounds):
        for tensor in own.values():
            tensor.fill_(1.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before, start = _mib("VmRSS"), time.perf_counter()
        got = receiver.recv_checkpoint(0, "<n/a>", step=step, timeout=TIMEOUT)
        if way == "staging":  # every chunk checked: now into the rank's own tensors
            for key, value in got.items():
                own[key].copy_(value)
        seconds.append(time.perf_counter() - start)
        extra.append(_mib("VmHWM") - before)
        del got
        assert all(torch.equal(own[k], expected[k]) for k in own)
    sender.join()
    return seconds, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for way in ("in place", "staging"):
        seconds, extra = _measure(way, args.mib, args.rounds)
        rest = seconds[1:]  # the first is a warm-up
        print(
            f"{way:9s} {args.mib} MiB: a heal takes {min(rest):.3f} s (min; median {statistics.median(rest):.3f} s "
            f"of {len(rest)}), peak memory {max(extra):.0f} MiB above the recovering process's before the heal"
        )


if __name__ == "__main__":
    main()
