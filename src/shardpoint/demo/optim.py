"""A ZeRO-1 distributed AdamW: each data-parallel rank owns a slice of the optimizer state.

Each parameter is split along dim 0 into ``dp_size`` nearly equal row ranges; rank
``r`` keeps Adam's moments only for its rows, updates them, and the full parameter is
reassembled with an all-gather. Because each slice is a rectangle of the global
tensor, it is described with :class:`shardpoint.Shard` and the checkpoint reshards
to any other dp size on load (DeepSpeed needs a "universal checkpoint" step for this).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import ParamsT

from shardpoint.state.sharding import Shard
from shardpoint.state.train_state import find_param, param_shard_index

__all__ = ["DistributedAdamW"]

# renamed in recent torch; keep working with torch>=2.6
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DistributedAdamW(torch.optim.Optimizer):
    """AdamW whose state is sharded over a data-parallel group (ZeRO stage 1).

    Args:
        params: the parameters of this rank's model part.
        dp_group: the data-parallel process group (None: no data parallelism).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.

    ``step()`` averages gradients over ``dp_group`` itself; the trainer must not.
    """

    def __init__(
        self,
        params: ParamsT,
        dp_group: Any = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.step_count = torch.zeros((), dtype=torch.int64)
        for group in self.param_groups:
            for p in group["params"]:
                start, end = self._rows(p)
                self.state[p] = {
                    "exp_avg": torch.zeros_like(p.detach()[start:end] if p.dim() else p, dtype=torch.float32),
                    "exp_avg_sq": torch.zeros_like(p.detach()[start:end] if p.dim() else p, dtype=torch.float32),
                }

    def _rows(self, p: torch.Tensor) -> tuple[int, int]:
        if p.dim() == 0:
            return 0, 0
        per = math.ceil(p.shape[0] / self.dp_size)
        start = min(per * self.dp_rank, p.shape[0])
        return start, min(start + per, p.shape[0])

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # torch's may return a closure's loss
        self.step_count += 1
        step = int(self.step_count)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                if self.dp_size > 1:
                    dist.all_reduce(grad, group=self.dp_group)
                    grad = grad / self.dp_size
                start, end = self._rows(p)
                full = p.dim() == 0
                local_p = p if full else p[start:end]
                local_g = grad if full else grad[start:end]
                state = self.state[p]
                state["exp_avg"].mul_(beta1).add_(local_g.float(), alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(local_g.float(), local_g.float(), value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["eps"])
                update = (state["exp_avg"] / (1 - beta1**step)) / denom
                local_p.mul_(1 - group["lr"] * group["weight_decay"])
                local_p.add_(update.to(p.dtype), alpha=-group["lr"])
                if self.dp_size > 1 and not full:
                    self._all_gather_rows(p)

    def _all_gather_rows(self, p: torch.Tensor) -> None:
        per = math.ceil(p.shape[0] / self.dp_size)
        padded = torch.zeros((per * self.dp_size, *p.shape[1:]), dtype=p.dtype, device=p.device)
        start, end = self._rows(p)
        mine = torch.zeros((per, *p.shape[1:]), dtype=p.dtype, device=p.device)
        mine[: end - start] = p[start:end]
        _all_gather_single(padded, mine, group=self.dp_group)
        p.copy_(padded[: p.shape[0]])

    def sharded_state_dict(self, model_shards: Mapping[str, Shard]) -> dict[str, Any]:
        """This rank's slice of every moment, as Shards of the parameter's global tensor."""
        index = param_shard_index(model_shards)
        out: dict[str, Any] = {}
        for group in self.param_groups:
            for p in group["params"]:
                key, shard = find_param(index, p)
                start, _ = self._rows(p)
                for name in ("exp_avg", "exp_avg_sq"):
                    out[f"{key}.{name}"] = self._slice_shard(self.state[p][name], shard, start)
                out[f"{key}.step"] = self.step_count
        return out

    def _slice_shard(self, tensor: torch.Tensor, shard: Shard, start: int) -> Shard:
        if tensor.dim() == 0:
            return Shard(tensor, shard.global_shape, shard.global_offset, self.dp_rank)
        offset = (shard.global_offset[0] + start, *shard.global_offset[1:])
        return Shard(tensor, shard.global_shape, offset)

    def load_sharded_state_dict(self, values: Mapping[str, Any]) -> None:
        """Values were loaded in place; nothing else to do."""
