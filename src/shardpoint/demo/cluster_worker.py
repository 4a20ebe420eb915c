"""One rank of ``shardpoint demo --nnodes N``, started by ``torchrun`` on each "node".

``python -m shardpoint.demo.cluster_worker --config CONFIG.json --save NODE_DIR --events FILE``:
the training run of ``CONFIG.json`` (a :class:`~shardpoint.demo.trainer.TrainConfig`
as JSON) with this node's own checkpoint directory (and, with ``--local-dir``, this
node's own directory for the non-persistent local tier). Global rank 0 appends each step
to ``FILE`` as a JSON line (the demo follows it for progress and preemption) and
writes the run's result to ``FILE.result.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from shardpoint.demo.model import GPTConfig
from shardpoint.demo.trainer import StepInfo, TrainConfig, Trainer

__all__ = ["config_from_json", "main"]


def config_from_json(text: str) -> TrainConfig:
    """The inverse of ``json.dumps(asdict(config))``."""
    data = json.loads(text)
    return TrainConfig(**{**data, "model": GPTConfig(**data["model"])})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--save", required=True, help="this node's checkpoint directory")
    parser.add_argument("--events", required=True)
    parser.add_argument("--local-dir", help="this node's local-tier directory (with the config's local_interval)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s",
        filename=f"{args.events}.rank_{rank:02d}.log",
    )
    with open(args.config) as f:
        config = replace(config_from_json(f.read()), save=args.save)
    if args.local_dir:
        config = replace(config, local_dir=args.local_dir)
    dist.init_process_group("gloo")
    try:
        report = None
        if dist.get_rank() == 0:

            def report(info: StepInfo) -> None:
                with open(args.events, "a") as f:
                    f.write(json.dumps(asdict(info)) + "\n")

        result = Trainer(config, on_step=report).run()
        if dist.get_rank() == 0:
            with open(f"{args.events}.result.json", "w") as f:
                json.dump(asdict(result), f)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
