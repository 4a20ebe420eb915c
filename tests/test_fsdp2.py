"""PyTorch-native parallelism: FSDP2 (``fully_shard``) and DTensor tensor parallel, with ordinary optimizers.

The model is parallelised only with PyTorch's APIs (no ``sharded_state_dict``):
``parallelize_module`` (ColwiseParallel / RowwiseParallel) on a ``tp`` mesh dimension
and ``fully_shard`` on ``dp``, so a 2-D mesh gives ``_StridedShard`` placements.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardpoint as sp
from tests import distributed

# DeviceMesh looks its process groups up by their C++ name, which torch 2.13 does not give a
# Python-defined ProcessGroup (the strict backend): these run on plain gloo
launch = functools.partial(distributed.launch, backend="gloo")

DIM, HIDDEN, GLOBAL_BATCH = 16, 64, 8
STEPS_BEFORE, STEPS_AFTER = 3, 2
SAVE_MESH = {"dp": 2, "tp": 2}
TARGETS = [{"dp": 4}, {"tp": 4}, {"dp": 2, "tp": 2}, {}]


class Net(torch.nn.Module):
    def __init__(self, out: int = DIM):
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Linear(DIM, HIDDEN)
        self.w2 = torch.nn.Linear(HIDDEN, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def build(mesh_sizes: dict[str, int], out: int = DIM, parallel: bool = True):
    """A Net parallelised over ``mesh_sizes`` (``{}``: an ordinary module in one process), and AdamW."""
    model = Net(out)
    dp, tp = mesh_sizes.get("dp", 1), mesh_sizes.get("tp", 1)
    if mesh_sizes:
        names = tuple(n for n in ("dp", "tp") if n in mesh_sizes)
        mesh = init_device_mesh("cpu", tuple(mesh_sizes[n] for n in names), mesh_dim_names=names)
        if tp > 1 and parallel:
            parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        if dp > 1:
            fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    topo = sp.Topology.from_mesh(mesh) if mesh_sizes else sp.Topology(1, 1, 1)
    assert (topo.tp_size, topo.dp_size) == (tp, dp)
    return model, opt, topo


def train(model, opt, topo: sp.Topology, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, DIM, generator=g)
        per_rank = GLOBAL_BATCH // topo.dp_size
        rows = slice(topo.dp_rank * per_rank, (topo.dp_rank + 1) * per_rank)
        out = model(x[rows])
        loss = torch.nn.functional.mse_loss(out, target[rows, : out.shape[-1]])
        opt.zero_grad()
        loss.backward()
        opt.step()


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state at full size (``full_tensor()`` of DTensors)."""

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p)
        for state_name, value in opt.state.get(p, {}).items():
            out[f"{name}.{state_name}"] = full(value)
    return out


def _save(rank, world, root, mesh_sizes, async_save):
    model, opt, topo = build(mesh_sizes)
    train(model, opt, topo, range(1, STEPS_BEFORE + 1))
    ckpt = sp.Checkpointer(root, topology=topo, async_save=async_save)
    ckpt.save(STEPS_BEFORE, sp.TrainState(model, opt))
    ckpt.close()
    saved = full_state(model, opt)
    train(model, opt, topo, range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER + 1))
    return saved, full_state(model, opt)


def _load(rank, world, root, mesh_sizes):
    model, opt, topo = build(mesh_sizes)
    result = sp.Checkpointer(root, topology=topo).load(sp.TrainState(model, opt))
    loaded = full_state(model, opt)
    train(model, opt, topo, range(result.iteration + 1, result.iteration + STEPS_AFTER + 1))
    return loaded, full_state(model, opt)


def _world(mesh_sizes: dict[str, int]) -> int:
    return mesh_sizes.get("dp", 1) * mesh_sizes.get("tp", 1)


def _assert_same(expected, got, exact: bool = True):
    assert expected.keys() == got.keys()
    assert any(k.endswith("exp_avg_sq") for k in got) and any(k.endswith("step") for k in got)
    for key in expected:
        if exact:
            assert torch.equal(expected[key], got[key]), key
        else:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def saved_2d(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp2") / "run")
    results = launch(_save, _world(SAVE_MESH), root, SAVE_MESH, False)
    return root, results[0]


@pytest.mark.parametrize("target", TARGETS, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()) or "plain")
def test_2d_fsdp2_tp_checkpoint_loads_at_any_mesh(saved_2d, target):
    root, (saved, uninterrupted) = saved_2d
    loaded, continued = launch(_load, _world(target), root, target)[0]
    _assert_same(saved, loaded)
    _assert_same(uninterrupted, continued, exact=False)


def test_one_process_checkpoint_loads_into_the_2d_mesh(tmp_path):
    root = str(tmp_path / "run")
    ((saved, uninterrupted),) = launch(_save, 1, root, {}, False)
    for loaded, continued in launch(_load, _world(SAVE_MESH), root, SAVE_MESH):
        _assert_same(saved, loaded)
        _assert_same(uninterrupted, continued, exact=False)


def test_async_save_of_dtensor_state(tmp_path):
    root = str(tmp_path / "run")
    ((saved, _),) = launch(_save, 4, root, SAVE_MESH, True)[:1]
    loaded, _ = launch(_load, 1, root, {})[0]
    _assert_same(saved, loaded)


def _save_uneven(rank, world, root, mesh_sizes, out):
    model, opt, topo = build(mesh_sizes, out=out)
    train(model, opt, topo, range(1, 3))
    local_rows = model.w2.weight.to_local().shape[0] if isinstance(model.w2.weight, DTensor) else None
    sp.Checkpointer(root, topology=topo).save(2, sp.TrainState(model, opt))
    return full_state(model, opt), local_rows


def _load_uneven(rank, world, root, mesh_sizes, out):
    model, opt, topo = build(mesh_sizes, out=out)
    sp.Checkpointer(root, topology=topo).load(sp.TrainState(model, opt))
    return full_state(model, opt)


@pytest.mark.parametrize("out", [10, 2], ids=["10-over-4", "empty-local-shard"])
def test_uneven_fsdp2_shards_save_and_reshard(tmp_path, out):
    root = str(tmp_path / "run")
    results = launch(_save_uneven, 4, root, {"dp": 4}, out)
    saved = results[0][0]
    local_rows = [rows for _, rows in results]
    assert sum(local_rows) == out and local_rows != [out // 4] * 4
    if out == 2:
        assert 0 in local_rows
    for mesh_sizes in ({"dp": 2}, {}):
        for got in launch(_load_uneven, _world(mesh_sizes), root, mesh_sizes, out):
            _assert_same(saved, got)


def test_plain_dcp_reads_the_2d_checkpoint(saved_2d):
    import torch.distributed.checkpoint as dcp

    root, (saved, _) = saved_2d
    directory = f"{root}/iter_{STEPS_BEFORE:07d}"
    reader = dcp.FileSystemReader(directory)
    meta = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert torch.equal(state["model.w1.weight"], saved["w1.weight"])
    assert torch.equal(state["optimizer.state.w2.weight.exp_avg"], saved["w2.weight.exp_avg"])


def _loader(rank: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(rank * 1000, rank * 1000 + 64))  # each rank its own shard of the data
    return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(rank))


def _loader_resume(rank, world, root, fmt):
    model, opt, topo = build({"dp": world})
    train(model, opt, topo, range(1, 3))
    saved = full_state(model, opt)
    loader = _loader(rank)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    sp.Checkpointer(root, topology=topo, format=fmt).save(3, sp.TrainState(model, opt, stateful={"loader": loader}))
    expected = [next(batches).tolist() for _ in range(2)]
    fresh = _loader(rank)
    model, opt, topo = build({"dp": world})
    sp.Checkpointer(root, topology=topo).load(sp.TrainState(model, opt, stateful={"loader": fresh}))
    _assert_same(saved, full_state(model, opt))  # FSDP2 shards of every dp rank, in both formats
    return expected, [batch.tolist() for _, batch in zip(range(2), fresh)]


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_stateful_data_loader_resumes_at_the_same_position(tmp_path, fmt):
    results = launch(_loader_resume, 2, str(tmp_path / "run"), fmt)
    for expected, resumed in results:
        assert resumed == expected
    assert results[0][0] != results[1][0]  # per rank: each rank's own position and data


def _unnamed_mesh_round_trip(rank, world, root):
    mesh = init_device_mesh("cpu", (world,))  # no mesh_dim_names, as FSDP2's examples build it
    model = fully_shard(Net(), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    topo = sp.Topology.from_mesh(mesh)
    train(model, opt, topo, range(1, 3))
    sp.Checkpointer(root, topology=topo).save(2, sp.TrainState(model, opt))
    fresh = fully_shard(Net(), mesh=mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    sp.Checkpointer(root, topology=topo).load(sp.TrainState(fresh, fresh_opt))
    return (topo.tp_size, topo.pp_size, topo.dp_size), full_state(model, opt), full_state(fresh, fresh_opt)


def test_an_unnamed_1d_mesh_is_data_parallel(tmp_path):
    for sizes, saved, loaded in launch(_unnamed_mesh_round_trip, 2, str(tmp_path)):
        assert sizes == (1, 1, 2)
        _assert_same(saved, loaded)
