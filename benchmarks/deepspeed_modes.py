"""DeepSpeed's own checkpoint engine against shardpoint's two modes, in one run (CPU, gloo, ZeRO-2).

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 benchmarks/deepspeed_modes.py --dir /tmp/dsbench --hidden 2048

Saves the same trained state four ways (DeepSpeed's ``TorchCheckpointEngine``, engine
mode via ``use(engine)``, the reshardable mode, engine mode with ``async_save``: its
save time is the training stall), then loads the first three into a fresh engine;
prints save and load seconds (slowest rank, after a barrier) and bytes written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist


def _engine(hidden: int, layers: int):
    import deepspeed
    import deepspeed.ops
    from deepspeed.runtime import compiler

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no ninja build of the shm allreduce
    compile_, compiler.compile = compiler.compile, lambda: compiler.dummy_decorator
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer
    finally:
        compiler.compile = compile_
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.Adam(net.parameters()), config=config)
    loss = engine(torch.randn(2, hidden)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    from shardpoint.integrations import deepspeed as sp_ds

    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()
    engine = _engine(args.hidden, args.layers)
    dirs = {m: os.path.join(args.dir, m) for m in ("deepspeed", "engine-mode", "reshardable")}
    saves = {"deepspeed": _timed(lambda: engine.save_checkpoint(dirs["deepspeed"], tag="global_step1"))}
    sp_ds.use(engine)
    saves["engine-mode"] = _timed(lambda: engine.save_checkpoint(dirs["engine-mode"], tag="global_step1"))
    saves["reshardable"] = _timed(lambda: sp_ds.save_checkpoint(engine, dirs["reshardable"], tag="global_step1"))
    dirs["engine-async"] = os.path.join(args.dir, "engine-async")
    background = sp_ds.use(engine, async_save=True)
    saves["engine-async"] = _timed(lambda: engine.save_checkpoint(dirs["engine-async"], tag="global_step1"))
    committed = _timed(background.wait)  # the write goes on behind training; here nothing else runs
    loads = {}
    fresh = _engine(args.hidden, args.layers)
    loads["deepspeed"] = _timed(lambda: fresh.load_checkpoint(dirs["deepspeed"]))
    sp_ds.use(fresh)
    loads["engine-mode"] = _timed(lambda: fresh.load_checkpoint(dirs["engine-mode"]))
    loads["reshardable"] = _timed(lambda: sp_ds.load_checkpoint(fresh, dirs["reshardable"]))
    if rank == 0:
        params = sum(p.numel() for p in engine.module.parameters())
        print(f"{params / 1e6:.1f}M parameters, fp32, ZeRO-2, {dist.get_world_size()} ranks")
        print(f"{'mode':<12} {'save s':>8} {'load s':>8} {'MB written':>11}")
        for mode, path in dirs.items():
            load = f"{loads[mode]:>8.2f}" if mode in loads else f"{'-':>8}"
            print(f"{mode:<12} {saves[mode]:>8.2f} {load} {_bytes(path) / 1e6:>11.1f}")
        held = saves["engine-async"]
        print(f"engine-async: training held {held:.2f} s; written and committed {committed:.2f} s later")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
