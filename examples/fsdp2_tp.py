"""FSDP2 over tensor parallel with shardpoint: torchrun --standalone --nproc-per-node 4 examples/fsdp2_tp.py RUN_DIR"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardpoint as sp

dist.init_process_group("gloo")  # "nccl" on GPUs, with init_device_mesh("cuda", ...)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

ckpt = sp.Checkpointer(sys.argv[1], topology=sp.Topology.from_mesh(mesh), save_interval=5, keep_last=2)
state = sp.TrainState(model, optimizer)
result = ckpt.load(state)  # None on a fresh start; loads whatever mesh it was saved at
for step in range((result.iteration if result else 0) + 1, 11):
    loss = model(torch.randn(4, 16)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ckpt.maybe_save(step, state)
ckpt.close()
dist.destroy_process_group()
