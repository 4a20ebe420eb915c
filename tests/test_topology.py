"""Megatron rank order, derived names, validation, and topologies built from process groups."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import shardpoint as sp
from tests.distributed import launch


def test_megatron_rank_order_tp_fastest_then_dp_then_pp():
    coords = [(t.tp_rank, t.dp_rank, t.pp_rank) for t in (sp.Topology(2, 2, 2, rank=r) for r in range(8))]
    assert coords == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    assert sp.Topology(2, 2, 2, rank=5).rank_of(tp=1, pp=1, dp=0) == 5


def test_names():
    assert sp.Topology(2, 1, 1, rank=1).mp_rank_name == "mp_rank_01"
    assert sp.Topology(4, 4, 1, rank=14).mp_rank_name == "mp_rank_02_003"


@pytest.mark.parametrize("sizes,rank", [((0, 1, 1), 0), ((2, 2, 1), 4), ((1, -1, 1), 0)])
def test_invalid_topologies(sizes, rank):
    with pytest.raises((ValueError, sp.TopologyMismatchError)):
        sp.Topology(*sizes, rank=rank)


def _check(rank: int, world: int):
    with pytest.raises(sp.TopologyMismatchError, match="process group has 4"):
        sp.Topology(2, 2, 2)
    # groups in a non-Megatron order: pp fastest; from_groups must follow the groups, not the formula
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    topo = sp.Topology.from_groups(tp_group=tp_groups[rank % 2], pp_group=pp_groups[rank // 2])
    return topo.tp_size, topo.pp_size, topo.dp_size, topo.tp_rank, topo.pp_rank, topo.mp_rank_name


def test_from_groups_and_world_size_check():
    results = launch(_check, 4)
    assert [r[:3] for r in results] == [(2, 2, 1)] * 4
    assert [r[3:5] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert results[3][5] == "mp_rank_01_001"


def _inferred(rank: int, world: int) -> list:
    import shardpoint as sp

    out = [sp.Topology().dp_size, sp.Topology(tp_size=2).dp_size, sp.Topology(pp_size=2, tp_size=1).dp_size]
    try:
        sp.Topology(tp_size=3)
    except sp.TopologyMismatchError as exc:
        out.append(str(exc))
    return out


def test_dp_size_is_inferred_from_the_world_as_megatron_computes_it():
    """Issue 57 item 5: on 2 ranks, Topology(tp_size=2) has dp 1, Topology() dp 2; a tp x pp not dividing is named."""
    from tests.distributed import launch

    for got in launch(_inferred, 2):
        assert got[:3] == [2, 1, 1]
        assert "does not divide the 2 ranks" in got[3] and "dp_size" in got[3]
