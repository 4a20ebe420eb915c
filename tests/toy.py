"""A small model split Megatron-style over tp × pp, and a deterministic training step.

Tensors are defined from their *global* coordinates, and the step's gradient is
elementwise (``2 (w - target) + noise``), so the same training run gives the same
full tensors at any layout; noise comes from torch's RNG, so exact resume also
proves that the RNG streams were restored.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.demo.optim import DistributedAdamW
from shardpoint.state.train_state import collect

LAYERS, HIDDEN, VOCAB = 4, 8, 16


def full_init(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)) * 7919)
    return torch.randn(shape, generator=g)


class ToyModel(torch.nn.Module):
    def __init__(
        self, topo: sp.Topology, layers: int = LAYERS, hidden: int = HIDDEN, vocab: int = VOCAB, check: bool = True
    ):
        super().__init__()
        self.topo = topo
        tp, ffn = topo.tp_size, 4 * hidden
        per_stage = sp.divide(layers, topo.pp_size, "layers")
        self.first_layer = topo.pp_rank * per_stage
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        if topo.pp_rank == 0:
            self.specs["embed.weight"] = ((vocab, hidden), "col")
        for i in range(self.first_layer, self.first_layer + per_stage):
            self.specs[f"layers.{i}.fc1.weight"] = ((ffn, hidden), "col")
            self.specs[f"layers.{i}.fc1.bias"] = ((ffn,), "col")
            self.specs[f"layers.{i}.fc2.weight"] = ((hidden, ffn), "row")
            self.specs[f"layers.{i}.fc2.bias"] = ((hidden,), "rep")
            self.specs[f"layers.{i}.norm.weight"] = ((hidden,), "rep")
        self.params = torch.nn.ParameterDict()
        for key, (shape, kind) in self.specs.items():
            full = full_init(key, shape)
            dim = {"col": 0, "row": 1}.get(kind)
            local = full
            if dim is not None:
                size = sp.divide(shape[dim], tp, key) if check else shape[dim] // tp
                local = full.narrow(dim, size * topo.tp_rank, size)
            self.params[key.replace(".", "__")] = torch.nn.Parameter(local.clone())

    def param(self, key: str) -> torch.nn.Parameter:
        return self.params[key.replace(".", "__")]

    def sharded_state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, (_, kind) in self.specs.items():
            p = self.param(key)
            out[key] = {"col": sp.column_parallel, "row": sp.row_parallel}.get(kind, lambda t, _: t)(p, self.topo)
        return out


def build(
    topo: sp.Topology, zero: bool = False, lr: float = 0.05, optimizer: Any = None, **model_args: Any
) -> sp.TrainState:
    """``optimizer``: a ``torch.optim`` class (or factory of ``(params, lr=...)``) instead of AdamW."""
    model = ToyModel(topo, **model_args)
    if zero:
        opt = DistributedAdamW(model.parameters(), dp_group=topo.dp_group(), lr=lr, weight_decay=0.01)
    elif optimizer is not None:
        opt = optimizer(model.parameters(), lr=lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
    return sp.TrainState(model, opt, sched, extra={"consumed_samples": 0})


def seed_rng(topo: sp.Topology, seed: int = 1234) -> None:
    """Same stream on every rank of a pipeline stage, so replicas stay identical."""
    torch.manual_seed(seed + topo.pp_rank)


def train_step(state: sp.TrainState, step: int, noise: bool = True) -> float:
    model: ToyModel = state.model
    loss = torch.zeros(())
    for key in model.specs:
        p = model.param(key)
        target = torch.full_like(p, 0.1 * step)
        loss = loss + ((p - target) ** 2).sum()
    state.optimizer.zero_grad()
    loss.backward()
    if noise:
        for p in model.parameters():
            p.grad.add_(0.01 * torch.randn_like(p))
    state.optimizer.step()
    state.scheduler.step()
    state.extra["consumed_samples"] += 8
    return float(loss.detach())


def snapshot(state: sp.TrainState) -> dict[str, Any]:
    """Every global-key shard this rank holds (model and optimizer), plus scalars, cloned."""
    flat = collect(state, iteration=0, include_rng=False)
    return {
        "tensors": {k: (s.global_shape, s.global_offset, s.tensor.detach().clone()) for k, s in flat.tensors.items()},
        "lr": [g["lr"] for g in state.optimizer.param_groups],
        "sched": state.scheduler.state_dict()["last_epoch"],
        "extra": dict(state.extra),
        "rng": torch.get_rng_state(),
    }


def assemble(snapshots: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Full tensors from all ranks' snapshots; replicas of one box must be identical."""
    full: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for snap in snapshots:
        for key, (shape, offset, tensor) in snap["tensors"].items():
            if key not in full:
                full[key] = torch.zeros(shape, dtype=tensor.dtype)
                filled[key] = torch.zeros(shape, dtype=torch.bool)
            view, mask = full[key], filled[key]
            for dim, (o, n) in enumerate(zip(offset, tensor.shape)):
                view, mask = view.narrow(dim, o, n), mask.narrow(dim, o, n)
            if mask.any():
                assert torch.equal(view[mask], tensor[mask]), f"replicas of {key} differ"
            view.copy_(tensor)
            mask.fill_(True)
    for key, mask in filled.items():
        assert mask.all(), f"{key} not fully covered"
    return full


def optimizer_state(state: sp.TrainState) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's optimizer state by parameter key, cloned (whatever its shape)."""
    model: ToyModel = state.model
    out = {}
    for key in model.specs:
        per_param = state.optimizer.state.get(model.param(key), {})
        out[key] = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in per_param.items()}
    return out


def barrier_if_dist() -> None:
    if dist.is_initialized():
        dist.barrier()
