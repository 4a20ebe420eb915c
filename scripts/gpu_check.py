"""One rank of the GPU check: save and load on this rank's device over the job's backend.

Run by ``scripts/gpu-check`` under torchrun. With CUDA it uses NCCL and ``cuda:LOCAL_RANK``
(the rules this project could only prove on CPU with the strict test backend); without,
gloo on CPU, so the script itself is tested on machines without a GPU.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardpoint as sp


def _model(device: torch.device, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(device)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device, steps: int = 2) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 64, device=device)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[key] = value.detach().cpu().clone()
    return out


def _fsdp2_round_trip(root: str, device: torch.device, async_save: bool) -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    model = fully_shard(_model(device, 0), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, device)
    topo = sp.Topology.from_mesh(mesh)
    with sp.Checkpointer(root, topology=topo, async_save=async_save) as ckpt:
        ckpt.save(2, sp.TrainState(model, opt))
    expected = _full(model)
    fresh = fully_shard(_model(device, 1), mesh=mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    result = sp.Checkpointer(root, topology=topo).load(sp.TrainState(fresh, fresh_opt))
    assert result is not None and result.iteration == 2
    got = _full(fresh)
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{key} differs after the round trip"


def _torch_format_round_trip(root: str, device: torch.device) -> None:
    model = _model(device, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, device)
    topo = sp.Topology(1, 1, dist.get_world_size())
    sp.Checkpointer(root, topology=topo, format="torch").save(2, sp.TrainState(model, opt))
    fresh = _model(device, 1)
    sp.Checkpointer(root, topology=topo).load(sp.TrainState(fresh, torch.optim.AdamW(fresh.parameters())))
    for key, value in _full(model).items():
        assert torch.equal(_full(fresh)[key], value), key


def _zero_torch_format_round_trip(root: str, device: torch.device) -> None:
    """ZeRO slices on the GPU: each dp rank writes its own file (no slice gathered onto one GPU)."""
    from shardpoint.demo.optim import DistributedAdamW

    world = dist.get_world_size()
    topo = sp.Topology(1, 1, world)
    model = _model(device, 0)
    opt = DistributedAdamW(model.parameters(), dp_group=topo.dp_group() if world > 1 else None, lr=1e-2)
    _train(model, opt, device)
    sp.Checkpointer(root, topology=topo, format="torch").save(2, sp.TrainState(model, opt))
    fresh = _model(device, 1)
    fresh_opt = DistributedAdamW(fresh.parameters(), dp_group=topo.dp_group() if world > 1 else None, lr=1e-2)
    sp.Checkpointer(root, topology=topo).load(sp.TrainState(fresh, fresh_opt))
    for p, q in zip(model.parameters(), fresh.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][name], fresh_opt.state[q][name]), name


def _staging_memory(root: str, device: torch.device) -> None:
    """The async snapshot of GPU tensors: one pinned slab, at most 1.1x the state on the host."""
    model = _model(device, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, device)
    state_bytes = sum(t.nbytes for t in model.state_dict().values())
    state_bytes += sum(t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    topo = sp.Topology(1, 1, dist.get_world_size())
    with sp.Checkpointer(root, topology=topo, async_save=True) as ckpt:
        ckpt.save(2, sp.TrainState(model, opt))
        ratio = ckpt.staging_bytes / state_bytes
    assert ratio <= 1.1, f"staging holds {ratio:.2f}x the state"
    if dist.get_rank() == 0:
        print(f"    staging host memory / state: {ratio:.3f}", flush=True)


def _shared_read_load(root: str, device: torch.device) -> None:
    """dp replicas load a dist checkpoint reading each stored byte once; on NCCL the chunks go device to device."""
    from shardpoint.catalog.metadata import CheckpointMetadata

    model = _model(device, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, device)
    topo = sp.Topology(1, 1, dist.get_world_size())
    sp.Checkpointer(root, topology=topo).save(2, sp.TrainState(model, opt))
    groups: set[str] = set()
    batch = dist.batch_isend_irecv

    def recording(ops):
        groups.update("trainer" if op.group is dist.group.WORLD else "control" for op in ops)
        groups.update(op.tensor.device.type for op in ops)
        return batch(ops)

    dist.batch_isend_irecv = recording
    try:
        fresh = _model(device, 1)
        result = sp.Checkpointer(root, topology=topo).load(sp.TrainState(fresh, torch.optim.AdamW(fresh.parameters())))
    finally:
        dist.batch_isend_irecv = batch
    for key, value in _full(model).items():
        assert torch.equal(_full(fresh)[key], value), key
    total = torch.tensor([result.bytes_read], device=device)
    dist.all_reduce(total)
    with open(os.path.join(root, "iter_0000002", "shardpoint.json")) as f:
        meta = CheckpointMetadata.from_json(f.read(), root)
    stored = sum(record.size for name, record in meta.files.items() if name.endswith(".distcp"))
    assert int(total) == stored, f"{int(total)} bytes read for {stored} stored"
    if dist.get_world_size() > 1:
        want = {"trainer", device.type} if device.type == "cuda" else {"control", "cpu"}
        assert groups == want, f"chunks travelled as {sorted(groups)}, expected {sorted(want)}"
    if dist.get_rank() == 0:
        print(f"    bytes read / stored: {int(total) / stored:.3f}; chunks: {sorted(groups)}", flush=True)


def main() -> int:
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    base = os.environ.get("GPU_CHECK_DIR") or tempfile.gettempdir()
    root = os.path.join(base, f"gpu-check-{dist.get_world_size()}")
    checks = {
        "fsdp2 dist sync": lambda: _fsdp2_round_trip(f"{root}/sync", device, False),
        "fsdp2 dist async": lambda: _fsdp2_round_trip(f"{root}/async", device, True),
        "torch format": lambda: _torch_format_round_trip(f"{root}/torch", device),
        "torch format, ZeRO slices": lambda: _zero_torch_format_round_trip(f"{root}/zero", device),
        "async staging memory": lambda: _staging_memory(f"{root}/staging", device),
        "dist load, each stored byte read once": lambda: _shared_read_load(f"{root}/shared", device),
    }
    failed = 0
    for name, check in checks.items():
        try:
            check()
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - every check reports, the exit code sums them up
            failed += 1
            status = f"FAILED: {type(exc).__name__}: {exc}"
        if dist.get_rank() == 0:
            print(f"[{dist.get_world_size()} ranks, {device.type}] {name}: {status}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
