"""One rank of a multi-node local-tier job, started by ``torchrun`` (see tests/multinode.py).

Trains the toy model of tests/toy.py with a Checkpointer whose persistent store is
``--persistent`` (the loopback S3 server) and whose local tier lives in this "node's"
directory (``MN_LOCAL_DIR``, a different one per torchrun agent). It loads whatever
there is to load first, then trains to ``--steps``.

``--then-wipe-and-reload``: after the load, every node's ``local_dir`` is deleted and a
new Checkpointer loads again (recorded as ``reloaded``).

``--stop-saving-after K``: after step K, wait until the local tier has committed and
replicated its last save, then train on to ``--steps`` without saving (the
uninterrupted reference run), write the results and wait to be SIGKILLed: the disks
then hold exactly what a node loss at step K leaves.

Results go to ``--out/result_<rank>.pt``: the node directory, what the load found
(iteration, tier, source, every rank's tiers, snapshot), a snapshot after every
step, and the warnings shardpoint logged.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardpoint as sp
from tests import toy

CONFIG = {"num_layers": toy.LAYERS, "hidden_size": toy.HIDDEN}


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelname, record.getMessage()))


def checkpointer(persistent: str, topo: sp.Topology, local_dir: str) -> sp.Checkpointer:
    return sp.Checkpointer(
        persistent,
        topology=topo,
        save_interval=10,
        config=CONFIG,
        local_dir=local_dir,
        local_interval=2,
        local_keep=2,
        local_replicas=1,
    )


def describe(result: sp.LoadResult, state: sp.TrainState) -> dict:
    return {
        "iteration": result.iteration,
        "tier": result.tier,
        "source": result.source,
        "tiers": result.tiers,
        "snapshot": toy.snapshot(state),
    }


def main() -> None:
    print("T start", time.time(), flush=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--persistent", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop-saving-after", type=int, default=10**9)
    parser.add_argument("--then-wipe-and-reload", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    recorder = Recorder()
    logging.getLogger("shardpoint").addHandler(recorder)
    logging.getLogger("shardpoint").setLevel(logging.INFO)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    print("T init", time.time(), flush=True)
    local_dir = os.environ["MN_LOCAL_DIR"]
    topo = sp.Topology(args.tp, 1, args.dp)
    toy.seed_rng(topo, seed=999)  # not the training seed: a load must restore the RNG
    state = toy.build(topo)
    ckpt = checkpointer(args.persistent, topo, local_dir)
    record: dict = {"rank": rank, "node_dir": local_dir, "steps": {}}
    print("T constructed", time.time(), flush=True)
    result = ckpt.load(state)
    print("T loaded", time.time(), flush=True)
    if result is None:
        toy.seed_rng(topo)
    else:
        record["loaded"] = describe(result, state)
    if args.then_wipe_and_reload:  # both nodes lose their local disks; a new Checkpointer loads again
        ckpt.close()
        dist.barrier()
        shutil.rmtree(local_dir)  # one rank per node: this rank's node
        dist.barrier()
        state = toy.build(topo)
        ckpt = checkpointer(args.persistent, topo, local_dir)
        record["reloaded"] = describe(ckpt.load(state), state)
    for step in range((result.iteration if result else 0) + 1, args.steps + 1):
        toy.train_step(state, step)
        if step <= args.stop_saving_after:
            ckpt.maybe_save(step, state)
        if step == args.stop_saving_after:
            ckpt.wait()  # the local save of this step's predecessor is committed and replicated everywhere
        record["steps"][step] = toy.snapshot(state)
        print("T step", step, time.time(), flush=True)
    record["messages"] = recorder.messages
    partial = os.path.join(args.out, f".result_{rank}.pt.partial")
    torch.save(record, partial)
    os.replace(partial, os.path.join(args.out, f"result_{rank}.pt"))
    if args.stop_saving_after < args.steps:
        time.sleep(600)  # the test SIGKILLs both nodes now
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown: seconds per launch on a loaded machine


if __name__ == "__main__":
    main()
