"""Expert parallelism: Megatron's expert rank order, and experts that reshard to any ep / etp / tp / dp, exactly.

A small mixture-of-experts model holds both expert conventions: layer 0 one key per
expert (Megatron's SequentialMLP, global expert ``ep_rank × E_local + i``), layer 1
stacked ``[E, ...]`` tensors (torchtitan's GroupedExperts), beside tensor-parallel dense
weights and a replicated router. Saved with AdamW at 4 ranks (ep=4, and ep=2 × tp=2),
it loads at 2 ranks (ep=2; ep=1 × etp=2; ep=2 × etp=1 with tp=2) and in one process
with every parameter and Adam moment bit-identical; the ``torch`` format's ep=4 save
loads at ep=2 (dp 4 -> 2) as well.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.state.train_state import collect
from tests import toy
from tests.distributed import launch

EXPERTS, HIDDEN, FFN = 8, 4, 8
SAVE_LAYOUTS = {"ep4": dict(tp_size=1, dp_size=4, ep_size=4), "ep2-tp2": dict(tp_size=2, dp_size=2, ep_size=2)}
LOAD_LAYOUTS = {
    "ep2": dict(tp_size=1, dp_size=2, ep_size=2),
    "ep1-etp2": dict(tp_size=2, dp_size=1, ep_size=1),
    "ep2-etp1-tp2": dict(tp_size=2, dp_size=1, ep_size=2, etp_size=1),
}


class MoE(torch.nn.Module):
    """Dense weights split over tp, a replicated router, and two expert layers (one per convention)."""

    def __init__(self, topo: sp.Topology, seed: int = 0):
        super().__init__()
        self.topo, self.seed = topo, seed
        local = sp.divide(EXPERTS, topo.ep_size, "experts")
        self.local = local
        tp, etp = topo.tp_size, topo.etp_size
        self.boxes: dict[str, tuple[tuple[int, ...], list[tuple[int, int, int]]]] = {}  # key: (full shape, splits)
        self.boxes["attn.qkv.weight"] = ((3 * HIDDEN, HIDDEN), [(0, topo.tp_rank, tp)])
        self.boxes["attn.proj.weight"] = ((HIDDEN, 3 * HIDDEN), [(1, topo.tp_rank, tp)])
        self.boxes["router.weight"] = ((EXPERTS, HIDDEN), [])
        for i in range(local):
            g = sp.global_expert(i, local, topo)
            self.boxes[f"layers.0.experts.{g}.fc1.weight"] = ((FFN, HIDDEN), [(0, topo.etp_rank, etp)])
            self.boxes[f"layers.0.experts.{g}.fc2.weight"] = ((HIDDEN, FFN), [(1, topo.etp_rank, etp)])
            self.boxes[f"layers.0.experts.{g}.fc2.bias"] = ((HIDDEN,), [])
        ep = (0, topo.ep_rank, topo.ep_size)
        self.boxes["layers.1.experts.w1"] = ((EXPERTS, FFN, HIDDEN), [ep, (1, topo.etp_rank, etp)])
        self.boxes["layers.1.experts.w2"] = ((EXPERTS, HIDDEN, FFN), [ep, (2, topo.etp_rank, etp)])
        self.boxes["layers.1.experts.b2"] = ((EXPERTS, HIDDEN), [ep])
        self.params = torch.nn.ParameterDict()
        for key, (shape, splits) in self.boxes.items():
            local_part = toy.full_init(key + "x" * seed, shape)
            for dim, rank, parts in splits:
                size = sp.divide(shape[dim], parts, key)
                local_part = local_part.narrow(dim, size * rank, size)
            self.params[key.replace(".", "__")] = torch.nn.Parameter(local_part.clone())

    def sharded_state_dict(self) -> dict:
        topo, out = self.topo, {}
        for key in self.boxes:
            p = self.params[key.replace(".", "__")]
            if key.startswith("attn.qkv"):
                out[key] = sp.column_parallel(p, topo)
            elif key.startswith("attn.proj"):
                out[key] = sp.row_parallel(p, topo)
            elif key.endswith("fc1.weight"):
                out[key] = sp.expert_column_parallel(p, topo)
            elif key.endswith("fc2.weight"):
                out[key] = sp.expert_row_parallel(p, topo)
            elif key.endswith("w1"):
                out[key] = sp.grouped_experts(p, topo, etp_dim=1)
            elif key.endswith("w2"):
                out[key] = sp.grouped_experts(p, topo, etp_dim=2)
            elif key.endswith("b2"):
                out[key] = sp.grouped_experts(p, topo)
            else:
                out[key] = p  # router, per-expert fc2 bias: whole on every rank that holds them
        return out


def _state(topo: sp.Topology, seed: int = 0, step: bool = False) -> sp.TrainState:
    model = MoE(topo, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    if step:  # gradients from each element's own value: the same run at any layout
        for p in model.parameters():
            p.grad = torch.sin(p.detach() * 3)
        opt.step()
    return sp.TrainState(model, opt)


def _pieces(state: sp.TrainState) -> dict:
    flat = collect(state, iteration=0, include_rng=False)
    return {
        "tensors": {k: (s.global_shape, s.global_offset, s.tensor.detach().clone()) for k, s in flat.tensors.items()}
    }


def _save(rank: int, world: int, root: str):
    saved = {}
    for name, sizes in SAVE_LAYOUTS.items():
        topo = sp.Topology(**sizes)
        state = _state(topo, step=True)
        sp.Checkpointer(f"{root}/{name}", topology=topo).save(1, state)
        saved[name] = _pieces(state)
        if name == "ep4":  # the torch format too: experts differ over dp, so each dp rank writes its own
            sp.Checkpointer(f"{root}/torch-{name}", topology=topo, format="torch").save(1, state)
    return saved


def _load(rank: int, world: int, root: str):
    loaded = {}
    for saved in SAVE_LAYOUTS:
        for name, sizes in LOAD_LAYOUTS.items():
            topo = sp.Topology(**sizes)
            state = _state(topo, seed=1)
            sp.Checkpointer(f"{root}/{saved}", topology=topo).load(state)
            loaded[saved, name] = _pieces(state)
    topo = sp.Topology(**LOAD_LAYOUTS["ep2"])  # the torch format keeps tp and pp; dp (and so ep) may change
    state = _state(topo, seed=1)
    sp.Checkpointer(f"{root}/torch-ep4", topology=topo).load(state)
    loaded["torch-ep4", "ep2"] = _pieces(state)
    return loaded


def _assert_same(expected: dict, got: dict, what: str) -> None:
    assert expected.keys() == got.keys(), what
    assert any(k.endswith("layers.1.experts.w1.exp_avg_sq") for k in got), what
    for key in expected:
        assert torch.equal(expected[key], got[key]), (what, key)


def test_experts_reshard_to_other_ep_etp_tp_and_one_process_bit_exact(tmp_path):
    saved = launch(_save, 4, str(tmp_path))
    loaded = launch(_load, 2, str(tmp_path))
    for name in SAVE_LAYOUTS:
        expected = toy.assemble([r[name] for r in saved])
        assert len([k for k in expected if k.startswith("model.layers.0.experts.")]) == 3 * EXPERTS
        for layout in LOAD_LAYOUTS:
            _assert_same(expected, toy.assemble([r[name, layout] for r in loaded]), f"{name} -> {layout}")
        single = _state(sp.Topology(), seed=1)
        sp.Checkpointer(str(tmp_path / name), topology=sp.Topology()).load(single)
        _assert_same(expected, toy.assemble([_pieces(single)]), f"{name} -> one process")
    expected = toy.assemble([r["ep4"] for r in saved])
    _assert_same(expected, toy.assemble([r["torch-ep4", "ep2"] for r in loaded]), "torch format ep4 -> ep2")


def test_expert_coordinates_follow_megatron_order():
    # Megatron's expert generator, order tp-ep-dp-pp: etp fastest, then ep, then the experts' dp
    coords = [(t.etp_rank, t.ep_rank, t.edp_rank) for t in (sp.Topology(2, 1, 4, rank=r, ep_size=2) for r in range(8))]
    assert coords == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    # etp=1 < tp=2: tp ranks of a dp rank hold different experts
    etp1 = [(t.ep_rank, t.edp_rank) for t in (sp.Topology(2, 2, 2, rank=r, ep_size=2, etp_size=1) for r in range(8))]
    assert etp1 == [(0, 0), (1, 0), (0, 1), (1, 1)] * 2
    topo = sp.Topology(1, 1, 4, rank=3, ep_size=4)
    assert (topo.edp_size, sp.global_expert(1, 2, topo)) == (1, 7)
    assert topo.describe() == {"tp": 1, "pp": 1, "dp": 4, "ep": 4, "etp": 1}
    assert sp.Topology(2, 1, 2).describe() == {"tp": 2, "pp": 1, "dp": 2}  # unchanged without experts
    with pytest.raises(sp.TopologyMismatchError, match="etp=2 x ep=4 does not divide"):
        sp.Topology(2, 1, 2, ep_size=4, rank=0)


def _from_mesh(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    topo = sp.Topology.from_mesh(mesh)
    group = topo.dp_group()
    return {
        "sizes": (topo.tp_size, topo.dp_size, topo.ep_size, topo.etp_size, topo.edp_size),
        "coords": (topo.tp_rank, topo.dp_rank, topo.ep_rank, topo.edp_rank),
        "dp_members": sorted(dist.get_process_group_ranks(group)),
        "formula": sp.Topology(2, 1, 4, rank=rank, ep_size=2).ep_rank,
    }


def test_from_mesh_with_an_ep_dimension():
    results = launch(_from_mesh, 8, backend="gloo")  # DeviceMesh needs named C++ groups (see test_dtensor)
    assert {r["sizes"] for r in results} == {(2, 4, 2, 2, 2)}
    for rank, r in enumerate(results):
        assert r["coords"] == (rank % 2, rank // 2, (rank // 2) % 2, rank // 4), (rank, r)
        assert r["dp_members"] == [rank % 2 + 2 * i for i in range(4)], (rank, r)
        assert r["coords"][2] == r["formula"]  # the mesh's ep is Megatron's for this (tp-fastest) layout
