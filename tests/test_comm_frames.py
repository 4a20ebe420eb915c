"""shardpoint's object collectives: one message when the object fits its frame, exact either way.

Real gloo processes. Objects just under, at and over the inline sizes cross every
branch (one collective, a second collective, point-to-point for a large gather), on
the control group and on a data-parallel subgroup whose ranks are not its group ranks.
"""

from __future__ import annotations

import torch.distributed as dist

import shardpoint as sp
from shardpoint.commands.scale import count_collectives
from shardpoint.parallel import comm
from tests.distributed import launch


def _payload(rank: int, size: int) -> dict:
    return {"rank": rank, "bytes": bytes([rank % 256]) * size, "nested": [None, (rank, "x")]}


def _rounds(rank: int, world: int) -> dict:
    calls = count_collectives()
    out: dict = {}
    for size in (0, 100, comm.GATHER_INLINE, 3 * comm.GATHER_INLINE, comm.BROADCAST_INLINE + 1):
        # rank 1's object alone is large: the others must still learn to wait for it
        mine = _payload(rank, size if rank == 1 else 10)
        before = sum(calls.values())
        out[("all_gather", size)] = comm.all_gather(mine)
        out[("gather_to", size)] = comm.gather_to(mine, 0)
        out[("broadcast", size)] = comm.broadcast(mine, src=1)
        out[("calls", size)] = sum(calls.values()) - before
    topo = sp.Topology(2, 1, world // 2)  # dp groups {0, 2} and {1, 3}
    group = topo.dp_group()
    members = dist.get_process_group_ranks(group)
    out["dp"] = (members, comm.all_gather(_payload(rank, 5000), group), comm.gather_to(rank, members[-1], group))
    return out


def test_framed_collectives_are_exact_and_take_one_call_when_the_object_fits():
    results = launch(_rounds, 4)
    for rank, out in enumerate(results):
        for size in (0, 100, comm.GATHER_INLINE, 3 * comm.GATHER_INLINE, comm.BROADCAST_INLINE + 1):
            expected = [_payload(r, size if r == 1 else 10) for r in range(4)]
            assert out[("all_gather", size)] == expected, (rank, size)
            assert out[("gather_to", size)] == (expected if rank == 0 else None), (rank, size)
            assert out[("broadcast", size)] == expected[1], (rank, size)
        # small objects: one call per round; larger ones need one more per gather/broadcast
        assert out[("calls", 100)] == 3, out[("calls", 100)]
        assert out[("calls", 3 * comm.GATHER_INLINE)] == 4  # the all-gather's second round; the gather goes p2p
        assert out[("calls", comm.BROADCAST_INLINE + 1)] == 5
        members, gathered, to_last = out["dp"]
        assert members == [rank % 2, rank % 2 + 2]
        assert gathered == [_payload(m, 5000) for m in members]
        assert to_last == (members if rank == members[-1] else None)
