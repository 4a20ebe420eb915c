"""Save/load time of one FSDP2 state under 4 gloo ranks: shardpoint against its peers.

The state: 16 ``nn.Linear(1024, 4096, bias=False)`` layers, each ``fully_shard``-ed on a
1-D CPU mesh of 4 ranks, plus AdamW state from one step (weights, exp_avg, exp_avg_sq:
768 MiB of ``Shard(0)`` DTensors in all). Contenders, each a save to a fresh directory
then a load into a second model+optimizer whose values were zeroed (checked equal after):

- shardpoint: ``Checkpointer(dir, keep_last=2).save`` / ``Checkpointer(dir).load``
- dcp: ``get_state_dict`` + ``dcp.save`` / ``dcp.load`` + ``set_state_dict``
- torch.save: each rank's local shards, ``torch.save`` / ``torch.load`` + ``copy_``
- torch-checkpointing 0.1.1: synchronous saver, no O_DIRECT, without and with
  ``DefaultResharder`` (whose metadata all-gather is hard-wired to CUDA in 0.1.1: here
  it runs on gloo via ``all_gather_object`` instead)

Each rank times its own call after a barrier; a round's time is the slowest rank's.
Rounds rotate the contenders' order, a warm-up round is discarded. Run:

    python benchmarks/fsdp2_peers.py [--repeat 5] [--dir /dev/shm] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

WORLD = 4
Run = Callable[[Path], Callable[[], object]]  # untimed setup for a dir, returning the timed save or load


def now(fn: Callable[[Path], None]) -> Run:  # a save or load with no untimed setup
    return lambda d: lambda: fn(d)


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 4096, bias=False) for _ in range(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x).pow(2).mean() for layer in self.layers)  # type: ignore[return-value]


def build(mesh: DeviceMesh, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Layers()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def local_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every rank-local tensor of the state (live storage), keyed by name."""
    msd, osd = get_state_dict(model, optimizer)
    out = {f"model.{k}": v for k, v in msd.items()}
    for name, state in osd["state"].items():
        out.update({f"optim.{name}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in out.items()}


def check_equal(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], who: str) -> None:
    bad = [k for k in ref if not torch.equal(ref[k], got[k])]
    if bad or len(ref) != len(got) or not any(".exp_avg" in k for k in ref):
        raise AssertionError(f"{who}: loaded state differs from saved on rank {dist.get_rank()}: {bad[:4]}")


def contenders(model: nn.Module, opt: torch.optim.Optimizer, model2: nn.Module, opt2: torch.optim.Optimizer,
               mesh: DeviceMesh) -> tuple[dict[str, tuple[Run, Run]], dict[str, str]]:  # fmt: skip
    import shardpoint as sp

    topo = sp.Topology.from_mesh(mesh)
    skipped: dict[str, str] = {}
    open_ckpts: list[sp.Checkpointer] = []

    def sp_save(d: Path) -> Callable[[], object]:
        ckpt = sp.Checkpointer(str(d), topology=topo, keep_last=2)
        open_ckpts.append(ckpt)
        return lambda: ckpt.save(1, sp.TrainState(model, opt))

    def sp_load(d: Path) -> Callable[[], object]:  # (a load that found nothing fails check_equal)
        while open_ckpts:
            open_ckpts.pop().close()
        ckpt = sp.Checkpointer(str(d), topology=topo)
        return lambda: ckpt.load(sp.TrainState(model2, opt2))

    def dcp_save(d: Path) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(d))

    def dcp_load(d: Path) -> None:
        msd, osd = get_state_dict(model2, opt2)
        dcp.load(sd := {"model": msd, "optim": osd}, checkpoint_id=str(d))
        set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def ts_save(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        torch.save(local_tensors(model, opt), d / f"rank_{dist.get_rank()}.pt")

    def ts_load(d: Path) -> None:
        loaded = torch.load(d / f"rank_{dist.get_rank()}.pt", weights_only=True)
        for k, v in local_tensors(model2, opt2).items():
            v.copy_(loaded[k])

    runs = {"shardpoint": (sp_save, sp_load), "dcp": (now(dcp_save), now(dcp_load))}
    runs["torch.save"] = (now(ts_save), now(ts_load))
    try:
        from torch_checkpointing import CheckpointManager, ItemSpec
        from torch_checkpointing.config import SyncCheckpointSaverConfig
        from torch_checkpointing.default_resharder import DefaultResharder
        from torch_checkpointing.metadata_manager import DefaultMetadataManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    except ImportError as e:
        skipped["torch-checkpointing"] = f"{e}; install: pip install --no-deps torch-checkpointing==0.1.1"
        return runs, skipped

    def gather_cpu(self: object, data: object, process_group: dist.ProcessGroup | None = None) -> dict[int, object]:
        out: list[object] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    DefaultMetadataManager._all_gather_pickled_data = gather_cpu  # type: ignore[method-assign]

    def tc_pair(resharder: bool) -> tuple[Run, Run]:
        # Synchronous saver: save() returns after the write and the commit barrier, no
        # staging (the async default stages into shared memory for a writer subprocess).
        # No O_DIRECT: 0.1.1 opens with it where the open succeeds (ext4) and then fails
        # with EINVAL on its unaligned buffered writes.
        items = {k: ItemSpec(resharder=DefaultResharder()) for k in ("model", "optim")} if resharder else {}
        storage = LocalFileSystemStorageConfig(use_direct_io=False)
        config = CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), storage_config=storage)
        manager = CheckpointManager(config)

        def save(d: Path) -> None:
            msd, osd = get_state_dict(model, opt)
            if manager.save(str(d), {"model": msd, "optim": osd}) is not None:
                raise AssertionError("torch-checkpointing: save was not synchronous")

        def load(d: Path) -> None:
            msd, osd = get_state_dict(model2, opt2)
            out = manager.load(str(d), into={"model": msd, "optim": osd})
            set_state_dict(model2, opt2, model_state_dict=out["model"], optim_state_dict=out["optim"])

        return now(save), now(load)

    runs["torch-ckpt"] = tc_pair(False)
    runs["torch-ckpt+reshard"] = tc_pair(True)
    return runs, skipped


def zero_(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for v in local_tensors(model, opt).values():
            v.zero_()


def slowest(fn: Callable[[], object]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    mine = time.perf_counter() - t0
    times: list[float] = [0.0] * WORLD
    dist.all_gather_object(times, mine)
    return max(times)


def worker(rank: int, port: int, args: argparse.Namespace, parent: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(minutes=5))
    mesh = init_device_mesh("cpu", (WORLD,))
    model, opt = build(mesh, seed=0)
    model2, opt2 = build(mesh, seed=1)
    ref = {k: v.clone() for k, v in local_tensors(model, opt).items()}
    zero_(model2, opt2)  # loads must write into live storage: zeroing through it must show
    if any(v.any() for v in local_tensors(model2, opt2).values()):
        raise AssertionError("local_tensors() is not the live storage of the second model")
    runs, skipped = contenders(model, opt, model2, opt2, mesh)
    names = list(runs)
    times: dict[str, dict[str, list[float]]] = {n: {"save": [], "load": []} for n in names}
    for rnd in range(args.repeat + 1):  # round 0: warm-up
        if rnd == 1:  # torch-checkpointing warns at every save ("Found 16 plain tensors..."): once is enough
            logging.getLogger("torch_checkpointing").setLevel(logging.ERROR)
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            if name in skipped:
                continue
            d = Path(parent) / f"{name}_r{rnd}"
            zero_(model2, opt2)
            save, load = runs[name]
            try:
                t_save = slowest(save(d))
                t_load = slowest(load(d))
                ok, why = True, ""
            except Exception as e:  # noqa: BLE001 -- a contender that cannot run is skipped, not fatal
                ok, why = False, f"{type(e).__name__}: {e}"
            if ok:  # but one that loads wrong values stops the benchmark
                check_equal(ref, local_tensors(model2, opt2), name)
            oks: list[tuple[bool, str]] = [(True, "")] * WORLD
            dist.all_gather_object(oks, (ok, why))
            if not all(o for o, _ in oks):
                skipped[name] = next(w for o, w in oks if not o)[:300]
            elif rnd > 0:
                times[name]["save"].append(t_save)
                times[name]["load"].append(t_load)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
    if rank == 0:
        report(times, skipped, args)
    dist.destroy_process_group()


def report(times: dict[str, dict[str, list[float]]], skipped: dict[str, str], args: argparse.Namespace) -> None:
    sp_t = None if "shardpoint" in skipped else times["shardpoint"]
    rows: dict[str, dict[str, float | None]] = {}
    for name, t in ((n, t) for n, t in times.items() if n not in skipped):
        row: dict[str, float | None] = {op: statistics.median(t[op]) for op in ("save", "load")}
        for op in ("save", "load"):
            ratios = [a / b for a, b in zip(sp_t[op], t[op], strict=True)] if sp_t and name != "shardpoint" else []
            row[f"sp/x {op}"] = statistics.median(ratios) if ratios else None
        rows[name] = row
    if args.json:
        print(json.dumps({"dir": args.dir, "repeat": args.repeat, "rows": rows, "skipped": skipped}, indent=2))
        return
    print(f"\nFSDP2, 4 gloo ranks, 768 MiB state, {args.dir}, median of {args.repeat} rounds\n")
    print("| contender | save s | load s | shardpoint/x save | shardpoint/x load |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        cells = [f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("save", "load", "sp/x save", "sp/x load")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, why in skipped.items():
        print(f"\nskipped {name}: {why}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5, help="timed rounds after one warm-up (default 5)")
    p.add_argument("--dir", default="/dev/shm", help="parent folder of the checkpoints (default /dev/shm)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = p.parse_args()
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    parent = tempfile.mkdtemp(prefix="fsdp2_peers_", dir=args.dir)
    try:
        mp.spawn(worker, args=(port, args, parent), nprocs=WORLD)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
