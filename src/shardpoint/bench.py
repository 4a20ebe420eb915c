"""``shardpoint bench``: shardpoint against the limits of the machine and the baselines users would pick.

Every number is a median over ``--repeat`` rounds, and every comparison is the median
of *per-round ratios* between methods run back to back in the same round (their
order rotates each round), because a shared disk varies several-fold between
identical writes. Each target directory is measured separately; by default a
RAM-backed folder (``/dev/shm``: the software's own cost) beside the real disk.

The state is synthetic and GPT-like: fp32 weights plus two Adam moments, split
evenly over ``--ranks`` gloo processes along dim 0 (tensor parallel), ``--size``
bytes in total. Resharded loading is measured by ``ranks // 2`` processes, against a
same-layout load at that rank count in the same rounds (not at ``--ranks 1``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardpoint.commands import bench_dirs
from shardpoint.commands.bench_help import BENCH_EXAMPLES
from shardpoint.commands.bench_states import (
    SHAPE_PRESETS,
    is_expert_key,
    preset_state,
    sharded_train_state,
    state_bytes,
    synthetic_state,
)
from shardpoint.commands.bench_tier import tier_rounds
from shardpoint.commands.bench_timing import peak_memory, slowest, timed
from shardpoint.formats.tensor_archive import storage_bytes
from shardpoint.storage.base import open_storage

__all__ = ["BenchConfig", "add_parser", "parse_size", "run_bench"]


@dataclass
class BenchConfig:
    size: int
    ranks: int
    repeat: int
    dirs: list[str]
    json: bool = False
    quiet: bool = False
    shapes: str = "synthetic"
    keep_last: int | None = 1
    warmup: int = 1


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"size {text!r} is not like 64MB, 1GB or 512KiB")
    unit = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[match.group(2).upper()]
    if (match.group(3) or "").lower() == "ib":
        unit = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match.group(2).upper()]
    return int(float(match.group(1)) * unit)


# ------------------------------------------------------------------- methods
class Methods:
    """One rank's operations; each returns when this rank's part is done (callers barrier)."""

    def __init__(self, state: dict[str, torch.Tensor], root: str, rank: int, world: int, keep_last: int | None = 1):
        self.state, self.root, self.rank, self.world = state, root, rank, world
        self.keep_last = keep_last
        self.storage = open_storage(root)
        self.buffers = {k: torch.empty_like(t) for k, t in state.items()}

    def path(self, name: str) -> str:
        return self.storage.join(self.root, name)

    def fresh(self, name: str) -> str:
        path = self.path(name)
        if self.rank == 0:
            self.storage.remove(path)
            self.storage.makedirs(path)
        dist.barrier()
        return path

    def memcopy(self) -> None:
        for key, tensor in self.state.items():
            self.buffers[key].copy_(tensor)

    def raw_write(self) -> None:
        """The storage's limit: this rank's bytes as one sequential, durable write (fsync, or upload)."""
        path = self.storage.join(self.fresh("raw"), f"rank{self.rank}.bin")
        with self.storage.open_write(path) as f:
            for tensor in self.state.values():
                f.write(storage_bytes(tensor))  # any dtype, bf16 too

    def raw_read(self) -> None:
        with self.storage.open_read(self.path(f"raw/rank{self.rank}.bin")) as f:
            for tensor in self.buffers.values():
                view = storage_bytes(tensor)
                view[:] = f.read(view.nbytes)

    def torch_save(self) -> None:
        path = f"{self.fresh('torch')}/rank{self.rank}.pt"
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())

    def torch_load(self) -> None:
        loaded = torch.load(self.path(f"torch/rank{self.rank}.pt"), weights_only=True)
        for key, tensor in loaded.items():
            self.buffers[key].copy_(tensor)

    def _dtensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (self.world,))
        return {
            k: t if is_expert_key(k) else DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
            for k, t in tensors.items()
        }

    def dcp_save(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dtensors(self.state), checkpoint_id=self.fresh("dcp"))

    def dcp_async_save(self) -> tuple[float, Callable[[], None]]:
        import torch.distributed.checkpoint as dcp

        if not hasattr(self, "_dcp_group"):
            self._dcp_group = dist.new_group(backend="gloo")
        path = self.fresh("dcp_async")
        start = time.perf_counter()
        future = dcp.async_save(self._dtensors(self.state), checkpoint_id=path, process_group=self._dcp_group)
        return time.perf_counter() - start, future.result  # type: ignore[union-attr]

    def dcp_load(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self._dtensors(self.buffers), checkpoint_id=self.path("dcp"))

    def _sharded(self, tensors: dict[str, torch.Tensor]) -> Any:
        return sharded_train_state(tensors, self.world)

    def sp_save(self, async_save: bool = False) -> Any:
        import shardpoint as sp

        name = "sp_async" if async_save else "sp"
        topo, state = self._sharded(self.state)
        if not hasattr(self, "_ckpts"):
            self._ckpts: dict[str, Any] = {}
        if name not in self._ckpts:
            self._ckpts[name] = sp.Checkpointer(
                self.path(name), topology=topo, async_save=async_save, keep_last=self.keep_last
            )
        ckpt = self._ckpts[name]
        self._iteration = getattr(self, "_iteration", 0) + 1
        ckpt.save(self._iteration, state)
        return ckpt

    def settle(self) -> None:
        """Let shardpoint's background deletions finish (untimed), so they never land in the next measurement."""
        for ckpt in getattr(self, "_ckpts", {}).values():
            ckpt.wait()
        dist.barrier()

    def replica_hash(self) -> None:
        """What the replica check costs when every byte is replicated (pure data parallel): hash it all."""
        from shardpoint.state.replicas import fingerprint

        for tensor in self.state.values():
            fingerprint(tensor)

    def sp_load(self, root: str | None = None, verify: bool = True) -> None:
        import shardpoint as sp

        topo, state = self._sharded(self.buffers)
        sp.Checkpointer(root or self.path("sp"), topology=topo).load(state, verify=verify)


def _peak_rss_during(fn: Callable[[], Any]) -> int:
    """Extra peak resident memory of this process while ``fn`` runs (Linux; 0 elsewhere)."""
    with peak_memory() as found:
        fn()
    return found.extra


# ------------------------------------------------------------------- rounds
def _main_rounds(m: Methods, repeat: int, warmup: int = 1) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}

    def async_sp() -> None:
        start = time.perf_counter()
        ckpt = m.sp_save(async_save=True)
        stall = time.perf_counter() - start
        ckpt.wait()
        times.setdefault("shardpoint async stall", []).append(max(slowest(stall), 0.0))

    def async_dcp() -> None:
        stall, wait = m.dcp_async_save()
        wait()
        times.setdefault("dcp async_save stall", []).append(slowest(stall))

    # writes and their reads stay paired; the pairs rotate between rounds
    pairs: list[list[tuple[str, Callable[[], Any]]]] = [
        [("memory copy", m.memcopy)],
        [("replica check, all bytes hashed", m.replica_hash)],
        [("sequential write+fsync", m.raw_write), ("sequential read", m.raw_read)],
        [
            ("shardpoint save", m.sp_save),
            ("shardpoint load", m.sp_load),
            ("shardpoint load, sizes only", lambda: m.sp_load(verify=False)),
        ],
        [("shardpoint async total", async_sp)],
    ]
    if m.storage.is_local:  # the baselines write local files only
        pairs += [
            [("torch.save per rank", m.torch_save), ("torch.load per rank", m.torch_load)],
            [("dcp save", m.dcp_save), ("dcp load", m.dcp_load)],
            [("dcp async_save total", async_dcp)],
        ]
    _warm_up(m, pairs, warmup)
    times.clear()  # what the warm-up's async saves recorded
    for round_index in range(repeat):
        shift = round_index % len(pairs)
        for pair in pairs[shift:] + pairs[:shift]:
            for name, fn in pair:
                times.setdefault(name, []).append(timed(fn))
                m.settle()
    return times


def _warm_up(m: Methods, pairs: list[list[tuple[str, Callable[[], Any]]]], rounds: int) -> None:
    """Untimed rounds first, shardpoint's saves until their retention is full and one more.

    Each method's files then take the space its previous files left, in every timed
    round, as they do in a long run. Without it the first rounds of a method whose
    footprint still grows write onto memory the machine never touched, which on a
    virtual machine (tmpfs pages first mapped by the host) made shardpoint's saves
    vary 4x between rounds of the same bytes: 1.28 s against 0.16 s in ``write``
    calls alone, while ``torch.save`` wrote into the space it had just freed.
    """
    for _ in range(rounds):
        for pair in pairs:
            for name, fn in pair:
                for _ in range(((m.keep_last or 0) + 1) if name in _RETAINED else 1):
                    fn()
                    m.settle()


_RETAINED = ("shardpoint save", "shardpoint async total")  # saves that keep ``--keep-last`` checkpoints


def _reshard_rounds(m: Methods, source: str, repeat: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    m.sp_save()  # a same-layout checkpoint at this rank count
    for round_index in range(repeat):
        ops = [("shardpoint load (same layout)", m.sp_load), ("shardpoint load (resharded)", lambda: m.sp_load(source))]
        for name, fn in ops if round_index % 2 == 0 else ops[::-1]:
            times.setdefault(name, []).append(timed(fn))
    times["reshard load peak extra RSS"] = [float(_peak_rss_during(lambda: m.sp_load(source)))]
    return times


def _worker(rank: int, world: int, port: int, config: dict[str, Any], root: str, phase: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import logging

    logging.disable(logging.INFO)
    try:
        # the full-size state is split over the main phase's ranks; the reshard phase holds the same total
        if config["shapes"] == "synthetic":
            state = synthetic_state(config["size"], rank, world)
        else:
            state = preset_state(config["shapes"], config["size"], rank, world, config["ranks"])
        m = Methods(state, root, rank, world, config["keep_last"])
        if phase == "main":
            # first, while no snapshot buffer exists in the process: the memory an async save adds
            peak = float(_peak_rss_during(lambda: m.sp_save(async_save=True).wait()))
            staging = float(m._ckpts["sp_async"].staging_bytes)  # the slab that snapshot kept
            times = _main_rounds(m, config["repeat"], config.get("warmup", 1))
            if m.storage.is_local:  # the local tier writes node-local directories
                times.update(tier_rounds(m, config["repeat"]))
            times["async peak extra RSS"] = [peak]
            times["staging bytes per rank"] = [staging]
            times["bytes per rank"] = [float(_bytes_written(m.path("sp"), rank))]
        else:
            times = _reshard_rounds(m, m.path("sp"), config["repeat"])
        times["state bytes per rank"] = [float(state_bytes(state))]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, times)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)
        dist.barrier()  # no rank tears gloo down while another still talks to it (an abort at exit, seen once)
    finally:
        dist.destroy_process_group()


def _bytes_written(root: str, rank: int) -> int:
    """Bytes of the newest checkpoint under ``root`` in this rank's DCP files (from its marker)."""
    from shardpoint.catalog.layout import get_layout
    from shardpoint.lifecycle import commit

    storage = open_storage(root)
    entries = [e for e in commit.list_checkpoints(storage, storage.root, get_layout("megatron")) if e.committed]
    files = entries[-1].meta.files  # type: ignore[union-attr]  # committed: its marker was read
    return sum(int(r.size) for name, r in files.items() if name.startswith(f"__{rank}_"))


def _launch(world: int, config: dict[str, Any], root: str, phase: str) -> list[dict[str, list[float]]]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(prefix="sp-bench-"), "times.json")
    mp.start_processes(_worker, args=(world, port, config, root, phase, out), nprocs=world, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure save/load speed against the disk's limits and baselines",
        description="Time shardpoint's saves and loads on this machine's disks (gloo ranks on CPU) beside the "
        "disk's own write/read speed and torch.save/torch.load of the same state; or, with one of the "
        "'instead' options, coordination at many ranks, planning at simulated rank counts, frozen bytes "
        "stored once, or S3 clients.",
        epilog=BENCH_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--size",
        type=parse_size,
        default=parse_size("256MB"),
        help="total bytes of fp32 weights + Adam moments over all ranks (default 256MB)",
    )
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes: 1 or an even number (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds first, shardpoint's saves until --keep-last is full (default 1)",
    )
    parser.add_argument(
        "--dir",
        action="append",
        dest="dirs",
        help="target directory (repeatable); default: /dev/shm and a folder in the current directory",
    )
    parser.add_argument(
        "--shapes",
        choices=["synthetic", *SHAPE_PRESETS, "lora"],
        default="synthetic",
        help="tensor shapes: 'synthetic' (GPT-like, many mid-sized tensors) or a rank of a real tensor-parallel "
        "model (7b-tp8: fewer, larger tensors; 1b-tp2), uniform-8mib (equal 8 MiB tensors), moe (one "
        "expert-parallel rank: thousands of bf16 expert matrices), many-small (10,000 tensors of 256 values, "
        "whatever --size says) or lora (the --frozen-base rows); the layer count follows --size",
    )
    parser.add_argument(
        "--keep-last",
        type=int,
        default=1,
        help="retention of shardpoint's saves, part of what is measured (default 1; 0 keeps all)",
    )
    parser.add_argument(
        "--scale",
        type=_counts,
        default=[],
        help="instead: coordination vs plain DCP on tiny state at these rank counts (e.g. 2,4,8,16)",
    )
    parser.add_argument(
        "--simulate-ranks",
        type=_counts,
        default=[],
        help="instead: rank-0 planning of one save and of its load at these simulated rank counts (e.g. 1024,4096)",
    )
    parser.add_argument(
        "--frozen-base",
        action="store_true",
        help="instead: saves of a LoRA-like fine-tune (95%% frozen) with the frozen base stored once and without",
    )
    parser.add_argument(
        "--store",
        default=None,
        help="instead: s3fs, obstore and s3torchconnector against shardpoint on S3, at --ranks (give s3 for a "
        "loopback server started here, or an s3:// URL)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.set_defaults(func=_run)


def _counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _run(args: argparse.Namespace) -> int:
    if args.scale or args.simulate_ranks:
        from shardpoint.commands import scale

        return scale.report(args.scale, args.simulate_ranks, args.repeat, args.json, args.quiet)
    if args.store:
        from shardpoint.commands import bench_store

        return bench_store.report(args.store, args.size, args.ranks, args.repeat, args.json, args.quiet)
    if args.frozen_base or args.shapes == "lora":
        from shardpoint.commands import bench_frozen

        return bench_frozen.report(
            args.size, max(args.repeat, 4), args.dirs or bench_dirs.default_dirs(), args.json, args.quiet
        )
    return run_bench(
        BenchConfig(
            args.size,
            args.ranks,
            args.repeat,
            args.dirs or bench_dirs.default_dirs(),
            args.json,
            args.quiet,
            args.shapes,
            args.keep_last or None,
            args.warmup,
        )
    )


def run_bench(config: BenchConfig) -> int:
    """Run every measurement on every directory and print (or return as JSON) the report."""
    if config.ranks < 1 or (config.ranks > 1 and config.ranks % 2):
        raise SystemExit("shardpoint bench: --ranks must be 1 or an even number (resharding loads at ranks/2)")
    reports = []
    for directory in config.dirs:
        storage = open_storage(directory)
        root = bench_dirs.run_root(storage)
        try:
            if not config.quiet:
                _say(
                    f"bench: {config.size / 1e9:.2f} GB over {config.ranks} ranks in {directory} "
                    f"({config.repeat} rounds)..."
                )
            settings = {
                "size": config.size,
                "repeat": config.repeat,
                "shapes": config.shapes,
                "ranks": config.ranks,
                "keep_last": config.keep_last,
                "warmup": config.warmup,
            }
            main = _launch(config.ranks, settings, root, "main")
            reshard = _launch(config.ranks // 2, settings, root, "reshard") if config.ranks > 1 else [{}]
            if config.shapes == "moe" and config.ranks > 2:  # experts also to one rank: ep 4 -> 2 -> 1
                one = _launch(1, settings, root, "reshard")[0]["shardpoint load (resharded)"]
                reshard[0]["shardpoint load (resharded to 1 rank)"] = one
            reports.append(summarize(directory, config, main, reshard))
        finally:
            storage.remove(root)
    if config.json:
        print(json.dumps(reports, indent=1))
    else:
        for report in reports:
            print_report(report)
    return 0


def _say(text: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(text)


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b) if y > 0)


def summarize(directory: str, config: BenchConfig, main: list[dict], reshard: list[dict]) -> dict[str, Any]:
    """Medians, per-round ratios and target checks for one directory."""
    times = {**main[0], **{k: v for k, v in reshard[0].items() if k.startswith("shardpoint load (")}}
    total = sum(r["state bytes per rank"][0] for r in main)  # presets round --size to whole layers
    rows = [
        {
            "name": name,
            "median_s": statistics.median(v),
            "min_s": min(v),
            "max_s": max(v),
            "gb_per_s": total / 1e9 / statistics.median(v) if statistics.median(v) > 0 else None,
        }
        for name, v in times.items()
        if not name.endswith(("RSS", "bytes per rank"))
    ]
    state_per_rank = main[0]["state bytes per rank"][0]
    bytes_written = [r["bytes per rank"][0] for r in main]
    wanted = {
        "async stall / memory copy": ("shardpoint async stall", "memory copy", "<=", 1.5),
        "async stall / sync save": ("shardpoint async stall", "shardpoint save", "<=", 0.10),
        "local-tier stall / memory copy": ("local tier stall", "memory copy", "<=", 1.5),
        "write limit time / save time": ("sequential write+fsync", "shardpoint save", ">=", 0.8),
        "save / torch.save per rank": ("shardpoint save", "torch.save per rank", "<=", 1.0),
        "replica check (worst case) / save": ("replica check, all bytes hashed", "shardpoint save", "<=", 0.1),
        "save / plain DCP save": ("shardpoint save", "dcp save", "<=", 0.9),
        "load / torch.load per rank (checksums on)": ("shardpoint load", "torch.load per rank", "<=", 1.0),
        "load / plain DCP load": ("shardpoint load", "dcp load", "<=", 1.0),
        "load without checksums / plain DCP load": ("shardpoint load, sizes only", "dcp load", "<=", 1.0),
        "resharded load / same-layout load": (
            "shardpoint load (resharded)",
            "shardpoint load (same layout)",
            "<=",
            1.25,
        ),
    }
    ratios = {
        name: (_median_ratio(times[a], times[b]), op, limit)
        for name, (a, b, op, limit) in wanted.items()
        if a in times and b in times
    }
    ratios["async peak extra memory / state"] = (
        max(r["async peak extra RSS"][0] for r in main) / state_per_rank,
        "<=",
        1.1,
    )
    ratios["async staging host memory / state"] = (
        max(r["staging bytes per rank"][0] / r["state bytes per rank"][0] for r in main),
        "<=",
        1.1,
    )
    checks = {
        name: {"value": value, "target": f"{op} {limit}", "met": _meets(value, op, limit)}
        for name, (value, op, limit) in ratios.items()
    }
    return {
        "dir": directory,
        "size_bytes": total,
        "shapes": config.shapes,
        "keep_last": config.keep_last,
        "ranks": config.ranks,
        "repeat": config.repeat,
        "warmup": config.warmup,
        "state_bytes_per_rank": state_per_rank,
        "bytes_written_per_rank": bytes_written,
        "reshard_load_peak_extra_rss_per_rank": [r["reshard load peak extra RSS"][0] for r in reshard if r],
        "rows": rows,
        "ratios": checks,
    }


def _meets(value: float, op: str, limit: float) -> bool:
    return {"<=": value <= limit, ">=": value >= limit, "<": value < limit}[op]


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(
        title=f"{report['dir']}: {report['size_bytes'] / 1e9:.2f} GB ({report['shapes']} shapes) over "
        f"{report['ranks']} ranks, keep_last={report['keep_last']}, median of {report['repeat']} "
        f"after {report.get('warmup', 0)} warm-up"
    )
    for column in ("operation", "median s", "min–max s", "GB/s"):
        table.add_column(column, justify="left" if column == "operation" else "right")
    for row in report["rows"]:
        rate = f"{row['gb_per_s']:.2f}" if row["gb_per_s"] else "-"
        table.add_row(row["name"], f"{row['median_s']:.3f}", f"{row['min_s']:.3f}–{row['max_s']:.3f}", rate)
    console.print(table)
    targets = Table(title="targets (medians of per-round ratios)")
    for column in ("ratio", "value", "target", "met"):
        targets.add_column(column)
    for name, check in report["ratios"].items():
        targets.add_row(name, f"{check['value']:.3f}", check["target"], "yes" if check["met"] else "[red]no[/red]")
    console.print(targets)
    per_rank = ", ".join(f"{b / 1e6:.1f}" for b in report["bytes_written_per_rank"])
    reshard_rss = ", ".join(f"{b / 1e6:.1f}" for b in report["reshard_load_peak_extra_rss_per_rank"])
    console.print(
        f"state per rank {report['state_bytes_per_rank'] / 1e6:.1f} MB; written per rank (MB): {per_rank}"
        + (f"; resharded-load peak extra RSS per rank (MB): {reshard_rss}" if reshard_rss else "")
    )
