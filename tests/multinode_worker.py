"""One rank of a multi-node test job, started by ``torchrun`` (see tests/multinode.py).

Trains the toy tp × dp model of tests/toy.py with a Checkpointer on this "node's"
local directory (``MN_LOCAL_DIR``, different per torchrun agent to simulate nodes
without a shared filesystem), optionally uploading to ``--remote``. It loads whatever
there is to load first, then trains to ``--steps``, saving every ``--save-interval``.

Results go to ``--out/result_<rank>.pt``: the node directory, what the load found,
which files it read locally or remotely, and a snapshot of the state after the load
and after every save (tests compare them across runs). ``MN_STALL_UPLOAD_AFTER=k``
stalls this node's uploads after the save at step k has been uploaded (the test
kills the node then, while the other node waits for that upload in ``close``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardpoint as sp
from tests import toy

CONFIG = {"num_layers": toy.LAYERS, "hidden_size": toy.HIDDEN}


def main() -> None:
    print("T start", time.time(), flush=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--dp", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-interval", type=int, required=True)
    parser.add_argument("--remote")
    parser.add_argument("--out", required=True)
    parser.add_argument("--wait-uploads-until", type=int, default=10**9, help="saves up to this step wait for uploads")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    print("T init", time.time(), flush=True)
    local_dir = os.environ["MN_LOCAL_DIR"]
    stall_after = int(os.environ.get("MN_STALL_UPLOAD_AFTER", "0"))
    topo = sp.Topology(args.tp, 1, args.dp)
    toy.seed_rng(topo, seed=999)  # not the training seed: a load must restore the RNG
    state = toy.build(topo)
    ckpt = sp.Checkpointer(
        local_dir, topology=topo, upload_to=args.remote, save_interval=args.save_interval, config=CONFIG
    )
    record: dict = {"rank": rank, "node_dir": local_dir, "node_local": ckpt._node is not None, "saves": {}}
    result = ckpt.load(state)
    if result is None:
        toy.seed_rng(topo)
    else:
        record["loaded"] = {
            "iteration": result.iteration,
            "path": result.path,
            "opened": dict(getattr(result.storage, "opened", {})),
            "snapshot": toy.snapshot(state),
        }
    for step in range((result.iteration if result else 0) + 1, args.steps + 1):
        toy.train_step(state, step)
        if ckpt.maybe_save(step, state):
            if args.remote and step <= args.wait_uploads_until:
                ckpt.wait()  # the upload is committed remotely before training goes on: deterministic tests
            record["saves"][step] = toy.snapshot(state)
            if step == stall_after:
                os.environ["SHARDPOINT_FAULT"] = "point=during-upload,action=stall,seconds=600"
    record["final"] = toy.snapshot(state)
    print("T done", time.time(), flush=True)
    # written whole, then renamed: a test that sees the file may kill this process right away
    partial = os.path.join(args.out, f".result_{rank}.pt.partial")
    torch.save(record, partial)
    os.replace(partial, os.path.join(args.out, f"result_{rank}.pt"))
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown: seconds per launch on a loaded machine


if __name__ == "__main__":
    main()
