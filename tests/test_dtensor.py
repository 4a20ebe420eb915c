"""DTensor values (FSDP2 / PyTorch tensor parallel) are saved and resharded as they are."""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardpoint as sp
from tests import distributed

# DeviceMesh looks its process groups up by their C++ name, which torch 2.13 does not give a
# Python-defined ProcessGroup (the strict backend): these run on plain gloo
launch = functools.partial(distributed.launch, backend="gloo")


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


def _three_d(rank: int, world: int, root: str, save: bool):
    names = ("dp_replicate", "dp_shard", "tp")
    if not save:
        full = torch.zeros(12, 10), torch.zeros(10)
        model = _ThreeD(None, full)
        sp.Checkpointer(root).load(sp.TrainState(model))
        return model.weight.detach().clone(), model.bias.detach().clone()
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
    weight = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    model = _ThreeD(mesh, (weight, torch.linspace(0, 1, 10)))
    sp.Checkpointer(root, topology=sp.Topology(1, 1, world)).save(1, sp.TrainState(model))
    return model.weight.full_tensor(), model.bias.full_tensor()


class _ThreeD(torch.nn.Module):
    """HSDP over tensor parallel: replicate × shard(0) × shard(1) on a 3-D mesh; plain tensors without a mesh."""

    def __init__(self, mesh, full):
        super().__init__()
        weight, bias = full
        if mesh is not None:
            weight = distribute_tensor(weight, mesh, [Replicate(), Shard(0), Shard(1)])
            bias = distribute_tensor(bias, mesh, [Replicate(), Replicate(), Shard(0)])
        self.weight = torch.nn.Parameter(weight)
        self.bias = torch.nn.Parameter(bias)


def test_three_dimensional_mesh_saves_and_loads_in_one_process(tmp_path):
    root = str(tmp_path / "run")
    weight, bias = launch(_three_d, 8, root, True)[0]
    loaded_weight, loaded_bias = launch(_three_d, 1, root, False)[0]
    assert torch.equal(loaded_weight, weight) and torch.equal(loaded_bias, bias)
