"""DTensor values (FSDP2 / PyTorch tensor parallel) are saved and resharded as they are."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardpoint as sp
from tests.distributed import launch


class DTensorNet(torch.nn.Module):
    def __init__(self, placement):
        super().__init__()
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        weight = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) * 0.5
        self.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [placement]))
        self.bias = torch.nn.Parameter(distribute_tensor(torch.linspace(0, 1, 6), mesh, [Replicate()]))


def _save(rank: int, world: int, root: str):
    model = DTensorNet(Shard(0))
    with torch.no_grad():
        model.weight.add_(1.0)
        model.bias.mul_(3.0)
    sp.Checkpointer(root, topology=sp.Topology(1, 1, world)).save(1, sp.TrainState(model))
    return model.weight.full_tensor(), model.bias.full_tensor()


def _load(rank: int, world: int, root: str, dim: int):
    model = DTensorNet(Shard(dim))
    sp.Checkpointer(root, topology=sp.Topology(1, 1, world)).load(sp.TrainState(model))
    return model.weight.full_tensor(), model.bias.full_tensor(), tuple(model.weight.to_local().shape)


def test_dtensor_round_trip_and_reshard(tmp_path):
    root = str(tmp_path / "run")
    weight, bias = launch(_save, 4, root)[0]
    assert torch.equal(weight[0], torch.arange(6) * 0.5 + 1)
    same = launch(_load, 4, root, 0)
    assert torch.equal(same[0][0], weight) and torch.equal(same[0][1], bias)
    for dim, local_shape in ((0, (4, 6)), (1, (8, 3))):
        resharded = launch(_load, 2, root, dim)
        for full_weight, full_bias, shape in resharded:
            assert torch.equal(full_weight, weight) and torch.equal(full_bias, bias)
            assert shape == local_shape
