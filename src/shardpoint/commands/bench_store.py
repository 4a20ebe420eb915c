"""``shardpoint bench --store s3``: which S3 client moves checkpoint bytes fastest, and how near shardpoint comes.

Three clients, each at its lowest-level call, on the same server in the same rounds
(the order rotates each round; a client that is not installed is left out with a
line saying how to add it):

- ``s3fs`` (aiobotocore; what shardpoint's object storage uses): ``pipe_file`` / ``cat_file``;
- ``obstore`` (Rust ``object_store``, which also speaks GCS and Azure): ``put`` / ``get`` / ``get_range``;
- ``s3torchconnector`` (AWS CRT, Mountpoint's client): ``put_object`` writer / ranged ``get_object`` reader.

``--ranks`` processes run each step at once, every rank on its own share of ``--size``:

- ``upload`` / ``download``: the share as one object (MB/s summed over ranks);
- ``many small``: 64 KiB objects put, then read back (objects/s);
- ``ranged``: 1 MiB ranges at spread offsets of one object every rank shares (MB/s),
  the access pattern of a resharded load.

Then shardpoint saves and loads the same bytes (``dist`` format, checksums checked on
load) at the same ranks; its rate is reported as the median of per-round ratios to
the raw upload and download of its own client, s3fs, measured in the same round.
Without an ``s3://`` URL a loopback moto server is started here; it is in Python and
bounds every client below what a real store gives, so read the table for ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardpoint.commands.bench_states import sharded_train_state, state_bytes, synthetic_state
from shardpoint.commands.bench_timing import timed

__all__ = ["CLIENTS", "STORE_TARGET", "report"]

STORE_TARGET = 0.9  # shardpoint's save and load rate over its client's raw rate
SMALL = 64 << 10
RANGE = 1 << 20
CLIENTS = ("s3fs", "obstore", "s3torchconnector")
_INSTALL = {name: "pip install 'shardpoint[bench-store]'" for name in ("obstore", "s3torchconnector")}


def _split(url: str) -> tuple[str, str]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


class _S3fs:
    def __init__(self, bucket: str) -> None:
        from shardpoint.storage.s3 import s3_filesystem

        self.fs, self.bucket = s3_filesystem(), bucket

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.bucket}/{key}", data)

    def get(self, key: str) -> bytes:
        return self.fs.cat_file(f"{self.bucket}/{key}")

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.fs.cat_file(f"{self.bucket}/{key}", start=start, end=start + length)


class _Obstore:
    def __init__(self, bucket: str) -> None:
        import obstore
        from obstore.store import S3Store

        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        options: dict[str, Any] = {"region": os.environ.get("AWS_DEFAULT_REGION", "us-east-1")}
        if endpoint:
            options.update(
                endpoint=endpoint, allow_http=endpoint.startswith("http:"), virtual_hosted_style_request=False
            )
        self.obstore, self.store = obstore, S3Store(bucket, **options)

    def put(self, key: str, data: bytes) -> None:
        self.obstore.put(self.store, key, data)

    def get(self, key: str) -> bytes:
        return bytes(self.obstore.get(self.store, key).bytes())

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return bytes(self.obstore.get_range(self.store, key, start=start, length=length))


class _Crt:
    def __init__(self, bucket: str) -> None:
        from s3torchconnector import S3ClientConfig, S3ReaderConstructor
        from s3torchconnector._s3client import S3Client  # the client S3Checkpoint wraps, for ranged readers

        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        config = S3ClientConfig(force_path_style=bool(endpoint))
        self.client = S3Client(
            os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), endpoint=endpoint, s3client_config=config
        )
        self.bucket, self.ranged = bucket, S3ReaderConstructor.range_based(buffer_size=0)

    def put(self, key: str, data: bytes) -> None:
        writer = self.client.put_object(self.bucket, key)
        writer.write(data)
        writer.close()

    def get(self, key: str) -> bytes:
        return self.client.get_object(self.bucket, key).read()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        reader = self.client.get_object(self.bucket, key, reader_constructor=self.ranged)
        reader.seek(start)
        return reader.read(length)


_MAKERS: dict[str, Callable[[str], Any]] = {"s3fs": _S3fs, "obstore": _Obstore, "s3torchconnector": _Crt}


def available() -> tuple[list[str], list[str]]:
    """Clients that import here, and a line for each that does not."""
    import importlib.util

    found, missing = [], []
    for name in CLIENTS:
        if importlib.util.find_spec(name) is None:
            missing.append(f"{name} is not installed ({_INSTALL[name]}); left out")
        else:
            found.append(name)
    return found, missing


def _client_rounds(client: Any, prefix: str, share: bytes, small: int, rank: int, world: int) -> dict[str, float]:
    """One round of every raw step for one client: seconds, slowest rank."""
    own = f"{prefix}/rank{rank}.bin"
    shared = f"{prefix}/rank0.bin"
    offsets = [(i * 7919 * RANGE + rank * RANGE) % max(1, len(share) - RANGE) for i in range(16)]
    ranged = len(offsets) * RANGE
    out = {
        "upload": timed(lambda: client.put(own, share)),
        "download": timed(lambda: client.get(own)),
        "small put": timed(lambda: [client.put(f"{prefix}/small/{rank}-{i}", share[:SMALL]) for i in range(small)]),
        "small get": timed(lambda: [client.get(f"{prefix}/small/{rank}-{i}") for i in range(small)]),
        "ranged": timed(lambda: [client.get_range(shared, o, RANGE) for o in offsets]),
    }
    check = client.get_range(shared, offsets[0], RANGE)
    if rank == 0 and check != share[offsets[0] : offsets[0] + RANGE]:
        raise RuntimeError("a ranged read returned other bytes than were written")
    rates = {"upload": len(share) * world, "download": len(share) * world, "ranged": ranged * world}
    rates.update({"small put": small * world, "small get": small * world})
    return {step: rates[step] / seconds for step, seconds in out.items()}


def _sp_round(root: str, state: dict[str, torch.Tensor], iteration: int, world: int) -> dict[str, float]:
    import shardpoint as sp

    topo, train = sharded_train_state(state, world)
    ckpt = sp.Checkpointer(root, topology=topo, keep_last=1)
    save = timed(lambda: ckpt.save(iteration, train))
    _, into = sharded_train_state({k: torch.empty_like(t) for k, t in state.items()}, world)
    load = timed(lambda: sp.Checkpointer(root, topology=topo).load(into))
    total = state_bytes(state) * world
    return {"save": total / save, "load": total / load}


def _worker(rank: int, world: int, port: int, config: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import logging

    logging.disable(logging.INFO)
    try:
        state = synthetic_state(config["size"], rank, world)
        share = b"".join(bytes(t.reshape(-1).view(torch.uint8).numpy()) for t in state.values())
        bucket, prefix = _split(config["url"])
        clients = {name: _MAKERS[name](bucket) for name in config["clients"]}
        rows: dict[str, list[float]] = {}
        for r in range(config["repeat"]):
            names = config["clients"][r % len(clients) :] + config["clients"][: r % len(clients)]
            for name in names:
                for step, rate in _client_rounds(clients[name], f"{prefix}/{name}", share, 64, rank, world).items():
                    rows.setdefault(f"{name} {step}", []).append(rate)
            for step, rate in _sp_round(f"{config['url']}/shardpoint", state, r + 1, world).items():
                rows.setdefault(f"shardpoint {step}", []).append(rate)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(url: str, size: int, ranks: int, repeat: int, clients: list[str]) -> dict[str, Any]:
    """Every row at ``url`` (an ``s3://bucket/prefix`` the environment's credentials reach)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(prefix="sp-bench-store-"), "rows.json")
    config = {"url": url, "size": size, "repeat": repeat, "clients": clients}
    mp.start_processes(_worker, args=(ranks, port, config, out), nprocs=ranks, start_method="spawn")
    with open(out) as f:
        rows = json.load(f)
    result: dict[str, Any] = {"url": url, "size": size, "ranks": ranks, "rates": {}}
    for key, values in rows.items():
        result["rates"][key] = statistics.median(values)
    for step, raw in (("save", "upload"), ("load", "download")):
        ratios = [a / b for a, b in zip(rows[f"shardpoint {step}"], rows[f"s3fs {raw}"], strict=True)]
        result[f"{step} ÷ s3fs {raw}"] = statistics.median(ratios)
    return result


def report(target: str, size: int, ranks: int, repeat: int, as_json: bool, quiet: bool) -> int:
    """Measure at ``target`` (``s3`` for a loopback server, or an ``s3://`` URL) and print the table."""
    from rich.console import Console

    from shardpoint.demo.cluster import loopback_s3

    console = Console(stderr=True, quiet=quiet or as_json)
    clients, missing = available()
    for line in missing:
        console.print(line)
    if target != "s3" and not target.startswith("s3://"):
        raise SystemExit("shardpoint bench --store: give s3 (a loopback server started here) or an s3:// URL")
    with loopback_s3("" if target == "s3" else target) as root:
        url = f"{root.rstrip('/')}/bench-{uuid.uuid4().hex[:8]}"
        console.print(f"store bench: {size / 1e6:.0f} MB over {ranks} ranks at {url}, {repeat} rounds...")
        try:
            result = measure(url, size, ranks, repeat, clients)
        finally:
            _remove(url)
    result["missing"] = missing
    if as_json:
        print(json.dumps(result, indent=1))
        return 0
    _print(result, clients)
    return 0


def _remove(url: str) -> None:
    from shardpoint.storage.s3 import s3_filesystem

    fs = s3_filesystem()
    if fs.exists(url):
        fs.rm(url, recursive=True)


def _print(result: dict[str, Any], clients: list[str]) -> None:
    from rich.console import Console

    from shardpoint.commands._output import new_table

    rates = result["rates"]
    title = f"{result['url']}: {result['size'] / 1e6:.0f} MB at {result['ranks']} ranks (medians)"
    table = new_table(
        "client", "upload MB/s", "download MB/s", "small put/s", "small get/s", "ranged MB/s", title=title
    )
    for name in clients:
        table.add_row(
            name,
            *(f"{rates[f'{name} {s}'] / 1e6:.0f}" for s in ("upload", "download")),
            *(f"{rates[f'{name} {s}']:.0f}" for s in ("small put", "small get")),
            f"{rates[f'{name} ranged'] / 1e6:.0f}",
        )
    table.add_row("shardpoint (s3fs)", f"{rates['shardpoint save'] / 1e6:.0f}", f"{rates['shardpoint load'] / 1e6:.0f}")
    Console().print(table)
    ratios = new_table("measure", "value", "target", "")
    for key in ("save ÷ s3fs upload", "load ÷ s3fs download"):
        ok = result[key] >= STORE_TARGET
        verdict = "[green]met[/green]" if ok else "[red]missed[/red]"
        ratios.add_row(f"shardpoint {key}", f"{result[key]:.2f}", f">= {STORE_TARGET}", verdict)
    Console().print(ratios)
