"""One rank of an elastic job (``torchrun --nnodes 1:2 --max-restarts 1``), see tests/test_elastic.py.

The data-parallel size is whatever world torchrun gives this attempt (tp=1, dp=world),
so a restart at another node count runs at another layout, as an elastic job does.
The persistent store ``--persistent`` is a directory every node sees; the local tier
lives in this node's own ``MN_LOCAL_DIR``. Each step ends with an all-reduce, the
job's own collective, so a rank notices a lost peer at the next step as training does.

``--hold-at K`` (first attempt only): after step K every rank writes ``held_<rank>``
and waits for ``release`` in ``--out``; the test kills a node meanwhile.

Each attempt writes ``attempt<k>_rank<r>.pt`` right after its load (what it loaded, from
which tier, and the warnings shardpoint logged) again when it holds, and at the end, with its saves.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardpoint as sp
from tests import toy
from tests.local_tier_worker import CONFIG, Recorder


def _write(out: Path, name: str, record: dict) -> None:
    partial = out / f".{name}.partial"
    torch.save(record, partial)
    os.replace(partial, out / name)


def _hold(out: Path, rank: int) -> None:
    (out / f"held_{rank}").touch()
    deadline = time.time() + 120
    while not (out / "release").exists() and time.time() < deadline:
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--persistent", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold-at", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    recorder = Recorder()
    logging.getLogger("shardpoint").addHandler(recorder)
    logging.getLogger("shardpoint").setLevel(logging.INFO)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    topo = sp.Topology(1, 1, world)
    toy.seed_rng(topo, seed=999)  # not the training seed: a load must restore the RNG
    state = toy.build(topo)
    ckpt = sp.Checkpointer(
        args.persistent,
        topology=topo,
        save_interval=4,
        config=CONFIG,
        local_dir=os.environ["MN_LOCAL_DIR"],
        local_interval=1,
        local_replicas=1,
        round_timeout=60,
    )
    result = ckpt.load(state)
    record: dict = {"rank": rank, "world": world, "attempt": attempt, "saves": {}, "loaded": None}
    if result is None:
        toy.seed_rng(topo)
    else:
        record["loaded"] = {"iteration": result.iteration, "tier": result.tier, "snapshot": toy.snapshot(state)}
    record["messages"] = list(recorder.messages)
    name = f"attempt{attempt}_rank{rank}.pt"
    _write(out, name, record)
    for step in range((result.iteration if result else 0) + 1, args.steps + 1):
        toy.train_step(state, step)
        dist.all_reduce(torch.zeros(1))  # the training step's own collective
        if ckpt.maybe_save(step, state) and step % 4 == 0:
            ckpt.wait()
            record["saves"][step] = toy.snapshot(state)
        if step == args.hold_at and attempt == 0:
            ckpt.wait()  # the local copy of this step is committed and replicated
            _write(out, name, record)  # with the saves so far: this attempt may never reach its end
            _hold(out, rank)
    ckpt.close()
    record["final"] = toy.snapshot(state)
    record["messages"] = list(recorder.messages)
    _write(out, name, record)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
