"""A torchtitan training job in miniature: its own containers, built and stepped as its ``Trainer`` does.

The full ``Trainer`` needs a GPU here (triton, CUDA device fallback, FlexAttention), so
this builds what the trainer hands its checkpoint manager, with torchtitan's own classes:
``OptimizersContainer`` from an optimizer config (``default_adamw``), the
``LRSchedulersContainer`` from its config, a ``ParallelAwareDataloader`` (a torchdata
``StatefulDataLoader``), and a ``Stateful`` train state like ``Trainer.state_dict``. The
manager is built with ``config.checkpoint.build(...)`` and the trainer's keyword arguments.
Each step follows ``Trainer.train``: step += 1, zero grads, forward, backward,
``maybe_wait_for_staging``, optimizer and scheduler steps, ``save(step, last_step=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

DIM, SAMPLES, BATCH = 8, 64, 2


class Tiny(torch.nn.Module):
    """Named like torchtitan's models: ``tok``, ``layers.<i>``, ``norm``, ``output``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Linear(DIM, 16)
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(16, 16) for i in range(2)})
        self.norm = torch.nn.LayerNorm(16)
        self.output = torch.nn.Linear(16, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x)
        for layer in self.layers.values():
            h = h + torch.tanh(layer(h))
        return self.output(self.norm(h))


class Samples(IterableDataset):
    """Deterministic samples, this data-parallel rank's share; the loader's state is how many it took."""

    def __init__(self, dp_rank: int, dp_world: int):
        self.dp_rank, self.dp_world = dp_rank, dp_world

    def __iter__(self):
        for i in range(self.dp_rank, SAMPLES, self.dp_world):
            g = torch.Generator().manual_seed(i)
            yield torch.randn(DIM, generator=g), torch.randn(DIM, generator=g)


class Progress(Stateful):
    """What torchtitan's ``Trainer`` saves as ``train_state``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


@dataclass
class Job:
    model: torch.nn.Module
    optimizers: Any
    lr_schedulers: Any
    dataloader: Any
    progress: Progress
    checkpointer: Any
    total_steps: int


def build(checkpoint_config: Any, folder: str, *, total_steps: int = 6, fsdp: bool = False) -> Job:
    """Model (FSDP2 over every rank with ``fsdp``), containers and checkpoint manager, as the trainer builds them."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = Tiny()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer_config = default_adamw(lr=1e-2)
    optimizer_config.implementation = "for-loop"  # "fused" is torchtitan's GPU default
    optimizers = optimizer_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5).build(
        optimizers=optimizers, training_steps=total_steps
    )
    dp_rank, dp_world = (rank, world) if fsdp else (0, 1)  # without FSDP every rank is one replica
    dataloader = ParallelAwareDataloader(Samples(dp_rank, dp_world), dp_rank, dp_world, batch_size=BATCH)
    progress = Progress()
    checkpointer = checkpoint_config.build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": progress},
        sd_adapter=None,
        base_folder=folder,
    )
    return Job(model, optimizers, lr_schedulers, dataloader, progress, checkpointer, total_steps)


def train(job: Job, until: int) -> None:
    """Steps after ``job.progress.step`` up to ``until``, saving after each as ``Trainer.train`` does."""
    batches = iter(job.dataloader)
    while job.progress.step < until:
        job.progress.step += 1
        x, target = next(batches)
        job.optimizers.zero_grad()
        loss = torch.nn.functional.mse_loss(job.model(x), target)
        loss.backward()
        job.progress.ntokens_seen += x.shape[0]
        job.checkpointer.maybe_wait_for_staging()
        job.optimizers.step()
        job.lr_schedulers.step()
        job.checkpointer.save(job.progress.step, last_step=job.progress.step == job.total_steps)


def full_state(job: Job) -> dict[str, Any]:
    """Everything a resume must restore, at full size: weights, optimizer state, schedule, progress."""

    def full(value: Any) -> Any:
        if isinstance(value, DTensor):
            value = value.full_tensor()
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    state = {f"model.{k}": full(v) for k, v in job.model.state_dict().items()}
    state.update({f"optimizer.{k}": full(v) for k, v in job.optimizers.state_dict().items()})
    state["lr_scheduler.last_epoch"] = job.lr_schedulers.state_dict()["last_epoch"]
    state["lr"] = [g["lr"] for o in job.optimizers for g in o.param_groups]
    state["train_state"] = job.progress.state_dict()
    return state
