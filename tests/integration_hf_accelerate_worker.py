"""Worker of tests/test_integration_accelerate.py: shardpoint's save_state / load_state under torchrun (CPU, gloo).

Training runs as an unedited Accelerate script would, with ``patch(accelerator)`` added:
its ``accelerator.save_state(...)`` / ``accelerator.load_state()`` calls go through shardpoint.

``python integration_hf_accelerate_worker.py PHASE OUT``; each phase writes its results under OUT:

* ``runs`` (2 ranks, ``Accelerator(cpu=True)``: DDP): an uninterrupted run (project
  ``full/``) and a run stopped after the save at step ``STOP`` (``stopped/``), each
  saving every ``SAVE_EVERY`` steps with automatic naming and ``total_limit=2``;
  ``full.pt`` / ``stopped.pt`` describe how they ended. ``mesh.json``: the topology
  shardpoint reads from the device mesh Accelerate builds for FSDP2.
* ``resume`` (2 ranks): loads the damaged copy ``corrupt/`` (the test made it; each
  rank's error goes to ``corrupt.error<rank>``), then resumes ``stopped/`` to the end
  (``resumed.pt``).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ParallelismConfig, ProjectConfiguration

import shardpoint as sp
from shardpoint.integrations.accelerate import load_state, patch

EPOCHS, STEPS_PER_EPOCH, SAVE_EVERY, STOP = 2, 4, 2, 6  # 32 samples, 4 per rank and step, 2 ranks


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),  # the resumed run must get the random streams back to match
            torch.nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Progress:
    """Training progress, registered with ``register_for_checkpointing`` as Accelerate's docs suggest."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def train(project: str, stop_after: int | None = None) -> dict:
    """Train (resuming from the project's latest checkpoint if any) until the end or ``stop_after``."""
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    patch(accelerator)  # the script's own accelerator.save_state / load_state calls go through shardpoint
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 40)
    # a generator of its own: a DataLoader otherwise draws from torch's global stream whenever an
    # iterator starts, which a resumed epoch does at another point of the stream than an uninterrupted one
    loader = torch.utils.data.DataLoader(data(), batch_size=4, shuffle=True, generator=torch.Generator())
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    loaded = accelerator.load_state()  # None on a fresh start
    start = progress.step
    for epoch in range(start // STEPS_PER_EPOCH, EPOCHS):
        loader.set_epoch(epoch)
        skip = start - epoch * STEPS_PER_EPOCH if epoch == start // STEPS_PER_EPOCH else 0
        for x, y in accelerator.skip_first_batches(loader, skip) if skip else loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            if progress.step % SAVE_EVERY == 0:
                accelerator.save_state(safe_serialization=True)
            if progress.step == stop_after:
                return snapshot(accelerator, model, optimizer, scheduler, progress, loaded)
    return snapshot(accelerator, model, optimizer, scheduler, progress, loaded)


def snapshot(accelerator, model, optimizer, scheduler, progress, loaded) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "optimizer": optimizer.optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": progress.step,
        "accelerator_step": accelerator.step,
        "save_iteration": accelerator.save_iteration,
        "loaded": None if loaded is None else loaded.path,
    }


def save_rank0(obj, path: str) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(obj, path)


def mesh_topology(out: str) -> None:
    """The topology shardpoint reads from the mesh Accelerate builds for FSDP2 (``dp_shard``, flattened dims)."""
    mesh = ParallelismConfig(dp_shard_size=2).build_device_mesh("cpu")
    topology = sp.Topology.from_mesh(mesh)
    if int(os.environ.get("RANK", 0)) == 0:
        with open(f"{out}/mesh.json", "w") as f:
            json.dump({"names": list(mesh.mesh_dim_names), **topology.describe()}, f)


def runs(out: str) -> None:
    save_rank0(train(f"{out}/full"), f"{out}/full.pt")
    save_rank0(train(f"{out}/stopped", stop_after=STOP), f"{out}/stopped.pt")
    mesh_topology(out)


def resume(out: str) -> None:
    accelerator = Accelerator(cpu=True)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(Progress())
    try:
        load_state(accelerator, f"{out}/corrupt/checkpoints")
        message = "no error"
    except sp.CheckpointError as exc:  # the rank that found the damage raises CorruptCheckpointError
        message = f"{type(exc).__name__}: {exc}"
    with open(f"{out}/corrupt.error{os.environ.get('RANK', 0)}", "w") as f:
        f.write(message)
    accelerator.free_memory()
    save_rank0(train(f"{out}/stopped"), f"{out}/resumed.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"runs": runs, "resume": resume}[sys.argv[1]](sys.argv[2])
    # Once in ~30 runs, after the resume scenario's refused load, interpreter teardown aborted in
    # C++ ("terminate called without an active exception", no Python frame left; destroying the
    # process groups first did not stop it). Every result is written by now: skip the teardown,
    # as the Lightning and scale workers do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
