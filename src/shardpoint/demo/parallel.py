"""Process groups of a tensor × pipeline × data parallel job, built the way Megatron builds them.

Ranks are ordered tensor-parallel fastest, then data parallel, then pipeline
(``rank = tp + tp_size * (dp + dp_size * pp)``, as :class:`shardpoint.Topology`), so
the ranks of one tensor-parallel group sit next to each other (on one node in a real
job, where their frequent all-reduces are cheapest).

Every group of every kind is created on every rank in the same order, because
``torch.distributed.new_group`` is collective over the whole world. Four kinds:

* tensor parallel: the ranks that split one layer (same pp stage and dp replica);
* data parallel: the replicas of one model shard (same tp rank and stage);
* pipeline: one rank per stage (same tp rank and dp replica), for send / recv;
* embedding: the first and last stage of a pipeline, which hold the tied word
  embedding and all-reduce its gradient (Megatron's "embedding group").

With a world of one process no process group is needed: every group is ``None`` and
the model's collectives are skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import shardpoint as sp

__all__ = ["ParallelState", "build_parallel_state", "pick_device"]


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the job and the process groups it talks over.

    Attributes:
        topology: sizes and coordinates (also handed to the Checkpointer).
        tp_group, dp_group, pp_group, embedding_group: process groups (None: size 1
            without a process group).
        pp_ranks: global rank of each stage of this rank's pipeline.
        device: where this rank's tensors live.
    """

    topology: sp.Topology
    tp_group: Any
    dp_group: Any
    pp_group: Any
    embedding_group: Any
    pp_ranks: tuple[int, ...]
    device: torch.device

    @property
    def tp_size(self) -> int:
        return self.topology.tp_size

    @property
    def tp_rank(self) -> int:
        return self.topology.tp_rank

    @property
    def pp_size(self) -> int:
        return self.topology.pp_size

    @property
    def pp_rank(self) -> int:
        return self.topology.pp_rank

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (only valid when not the first stage)."""
        return self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (only valid when not the last stage)."""
        return self.pp_ranks[self.pp_rank + 1]


def pick_device(backend: str | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` under NCCL (made current), else the CPU.

    The backend decides, not whether a GPU happens to be visible: a gloo job on a
    GPU machine keeps its tensors on the CPU, where gloo can reach them.
    """
    if backend is None:
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def build_parallel_state(tp: int, pp: int, dp: int, device: torch.device | None = None) -> ParallelState:
    """Create the process groups for ``tp × pp × dp`` (every rank calls this, in the same order).

    Raises:
        TopologyMismatchError: the sizes' product is not the world size.
    """
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    plain = sp.Topology(tp, pp, dp, rank=rank)  # validates the sizes against the world
    device = device or pick_device()
    if not initialized:
        return ParallelState(plain, None, None, None, None, (0,), device)

    def ranks(t: int | None = None, p: int | None = None, d: int | None = None) -> list[int]:
        return [
            plain.rank_of(tp=ti, pp=pi, dp=di)
            for pi in range(pp)
            for di in range(dp)
            for ti in range(tp)
            if (t is None or ti == t) and (p is None or pi == p) and (d is None or di == d)
        ]

    tp_members = [ranks(p=p, d=d) for p in range(pp) for d in range(dp)]
    dp_members = [ranks(t=t, p=p) for p in range(pp) for t in range(tp)]
    pp_members = [ranks(t=t, d=d) for d in range(dp) for t in range(tp)]
    embedding_members = [sorted({m[0], m[-1]}) for m in pp_members]
    groups = {
        name: _new_groups(members, rank)
        for name, members in (
            ("tp", tp_members),
            ("dp", dp_members),
            ("pp", pp_members),
            ("embedding", embedding_members),
        )
    }
    topology = sp.Topology.from_groups(tp_group=groups["tp"], pp_group=groups["pp"], dp_group=groups["dp"])
    pipeline = next(m for m in pp_members if rank in m)
    return ParallelState(
        topology, groups["tp"], groups["dp"], groups["pp"], groups["embedding"], tuple(pipeline), device
    )


def _new_groups(members: list[list[int]], rank: int) -> Any:
    """Create one group per member list (collective); return the one holding ``rank``."""
    mine = None
    for group_ranks in members:
        group = dist.new_group(group_ranks)
        if rank in group_ranks:
            mine = group
    return mine
