"""MoE export to Megatron-LM's legacy format at a chosen ep, read back bit-exact against the fixtures' truth.

The sources are the real Megatron-LM core_v0.16.1 MoE checkpoints of ``tests/fixtures/megatron-moe``
(4 experts, SequentialMLP, sigmoid router with expert bias, one shared expert), imported through
shardpoint's ``dist`` format. The export writes ``mp_rank_TT[_PPP]_EEE`` folders (experts under local
ids, the ChainedOptimizer's dense and expert optimizers); shardpoint's legacy reader reads them back and
every weight, buffer and Adam moment must equal ``truth.pt``. That Megatron-LM's own ``load_checkpoint``
loads these files is checked by ``scripts/fixtures/load_moe_export_in_megatron.py`` (needs Megatron-LM).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from shardpoint.errors import CheckpointError, CorruptCheckpointError, TopologyMismatchError
from shardpoint.foreign import import_checkpoint, read_foreign
from shardpoint.foreign._unpickle import load_foreign, save_foreign
from shardpoint.foreign.exporter import export_megatron, from_shardpoint
from tests.test_cli_commands import run_cli
from tests.test_foreign_import import MOMENTS, assert_equal, params_of
from tests.test_foreign_moe import EP1, EP2, MOE, truth

STEP = "iter_0000002"
LOCAL = re.compile(r"local_experts\.(\d+)\.")
FC1 = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight"


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """The ep=2 fixture imported into shardpoint's dist format (the usual export source)."""
    root = tmp_path_factory.mktemp("moe") / "dist"
    import_checkpoint(MOE / EP2 / "ckpt", root)
    return root


def load(root: Path, folder: str, name: str = "model_optim_rng.pt") -> dict:
    return load_foreign(root / STEP / folder / name)


def assert_truth(ckpt, t: dict[str, torch.Tensor]) -> None:
    """Every weight, buffer, moment and step of ``ckpt`` equals the truth, bit for bit."""
    assert list(ckpt.params) == params_of(t)  # GPTModel order, global expert ids
    for name in params_of(t):
        assert_equal(name, ckpt.params[name], t[name])
        if name in ckpt.buffers:
            assert not ckpt.optimizer[name]
            continue
        for moment in MOMENTS:
            assert_equal(f"{name}.{moment}", ckpt.optimizer[name].get(moment), t[f"{name}.{moment}"])
        assert int(ckpt.optimizer[name]["step"]) == 2


def groups_of(ckpt) -> list[tuple[bool, float, list[str]]]:
    return [(bool(g["is_expert_parallel"]), g["wd_mult"], g["param_names"]) for g in ckpt.param_groups]


@pytest.mark.parametrize(
    ("ep", "dp", "distopt"),
    [(2, 2, True), (2, 2, False), (1, 1, True), (1, 2, False), (4, 4, True), (4, 4, False)],
)
def test_export_at_each_ep_reads_back_to_the_truth(imported, tmp_path, ep, dp, distopt):
    src = from_shardpoint(str(imported))
    export_megatron(src, tmp_path, tp=1, pp=1, dp=dp, ep=ep, distributed_optimizer=distopt)
    folders = sorted(p.name for p in (tmp_path / STEP).iterdir())
    assert folders == (["mp_rank_00"] if ep == 1 else [f"mp_rank_00_{e:03d}" for e in range(ep)])
    back = read_foreign(tmp_path)
    assert back.ep == ep and back.buffers == src.buffers == [n for n in back.params if n.endswith("expert_bias")]
    assert_truth(back, truth())
    experts = [n for n in back.params if LOCAL.search(n)]
    dense = [n for g in src.param_groups if not g["is_expert_parallel"] for n in g["param_names"]]
    if ep == 1:  # one optimizer: the experts are ordinary parameters of the weight-decay group
        assert [g[:2] for g in groups_of(back)] == [(False, 1.0), (False, 0.0)]
        assert set(groups_of(back)[0][2]) == set(src.param_groups[0]["param_names"]) | set(experts)
    else:  # ChainedOptimizer: the dense optimizer's groups, then the expert optimizer's
        assert groups_of(back) == [(False, 1.0, dense[:12]), (False, 0.0, dense[12:]), (True, 1.0, experts)]


def test_the_ep1_fixture_exports_at_ep2_and_the_ep2_one_at_ep1(tmp_path):
    for fixture, ep in ((EP1, 2), (EP2, 1)):
        export_megatron(read_foreign(MOE / fixture / "ckpt"), tmp_path / fixture, tp=1, pp=1, dp=2, ep=ep)
        assert_truth(read_foreign(tmp_path / fixture), truth(fixture))


def test_each_ep_folder_holds_the_dense_weights_and_its_experts_under_local_ids(imported, tmp_path):
    export_megatron(from_shardpoint(str(imported)), tmp_path, tp=1, pp=1, dp=2, ep=2, distributed_optimizer=True)
    t = truth()
    first, second = load(tmp_path, "mp_rank_00_000"), load(tmp_path, "mp_rank_00_001")
    for e, state in enumerate((first, second)):
        model = state["model"]
        assert {int(m.group(1)) for k in model if (m := LOCAL.search(k))} == {0, 1}  # local ids
        for local in (0, 1):
            assert torch.equal(model[FC1.format(local)], t[FC1.format(2 * e + local)])
        assert torch.equal(
            model["decoder.layers.0.mlp.router.expert_bias"], t["decoder.layers.0.mlp.router.expert_bias"]
        )
        assert torch.equal(model["decoder.layers.0.mlp.router.weight"], t["decoder.layers.0.mlp.router.weight"])
        assert "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2._extra_state" in model
        args = state["args"]
        assert (args.expert_model_parallel_size, args.num_experts, args.world_size, args.rank) == (2, 4, 2, e)
        assert args.ckpt_format == "torch" and args.use_distributed_optimizer
        dense, expert = state["optimizer"]  # ChainedOptimizer.state_dict(): one state dict per optimizer
        assert [g["is_expert_parallel"] for g in dense["optimizer"]["param_groups"]] == [False, False]
        assert [(g["is_expert_parallel"], g["step"]) for g in expert["optimizer"]["param_groups"]] == [(True, 2.0)]
    dense0, expert0 = load(tmp_path, "mp_rank_00_000", "distrib_optim.pt")
    dense1, expert1 = load(tmp_path, "mp_rank_00_001", "distrib_optim.pt")
    assert dense1 is None and dense0["buckets_coalesced"]  # only dense DP rank 0 (ep rank 0) saves the dense buffer
    numel = [next(iter(s[0].values()))["numel_unpadded"] for s in (expert0, expert1)]
    assert numel == [2 * 2 * (96 * 64 + 64 * 48)] * 2  # 2 layers x 2 local experts, 64-aligned, no gaps


def test_no_distributed_optimizer_writes_a_torch_state_per_optimizer(imported, tmp_path):
    export_megatron(from_shardpoint(str(imported)), tmp_path, tp=1, pp=1, dp=2, ep=2)
    t = truth()
    dense, expert = load(tmp_path, "mp_rank_00_001")["optimizer"]
    assert [len(g["params"]) for g in dense["param_groups"]] == [12, 5]
    assert [len(g["params"]) for g in expert["param_groups"]] == [8] and len(expert["state"]) == 8
    # expert optimizer index 0: layer 0's local expert 0 on ep rank 1 = global expert 2
    want = t["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight.exp_avg"]
    assert torch.equal(expert["state"][0]["exp_avg"], want)


def test_tp2_pp2_ep2_folders_round_trip(imported, tmp_path):
    export_megatron(from_shardpoint(str(imported)), tmp_path, tp=2, pp=2, dp=2, ep=2, distributed_optimizer=True)
    folders = sorted(p.name for p in (tmp_path / STEP).iterdir())
    assert folders == [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)]
    assert load(tmp_path, "mp_rank_01_001_001")["args"].rank == 1 + 2 * 1 + 1 * 2 * 2  # t + tp*e + p*tp*dp
    assert_truth(read_foreign(tmp_path), truth())


def test_from_shardpoint_keeps_the_buffers_in_model_order(imported):
    ckpt = from_shardpoint(str(imported))
    names = list(ckpt.params)
    assert ckpt.ep == 2 and ckpt.buffers == [
        "decoder.layers.0.mlp.router.expert_bias",
        "decoder.layers.1.mlp.router.expert_bias",
    ]
    assert (
        names.index("decoder.layers.0.mlp.router.expert_bias") == names.index("decoder.layers.0.mlp.router.weight") + 1
    )


@pytest.mark.parametrize(
    ("kwargs", "changes", "error", "message"),
    [
        ({}, {}, CheckpointError, r"mixture-of-experts models \(num_experts=4\) needs.*--ep"),
        ({"ep": 3, "dp": 3}, {}, TopologyMismatchError, r"num_experts=4 does not divide into ep=3"),
        ({"ep": 2, "dp": 1}, {}, TopologyMismatchError, r"ep=2 does not divide dp=1"),
        (  # the legacy GroupedMLP is written as SequentialMLP (tests/test_foreign_moe_grouped.py); TE's is refused
            {"ep": 2, "dp": 2},
            {"moe_grouped_gemm": True, "transformer_impl": "transformer_engine"},
            CheckpointError,
            r"Transformer Engine grouped-GEMM experts.*TEGroupedMLP",
        ),
        ({"ep": 2, "dp": 2}, {"expert_tensor_parallel_size": 2}, CheckpointError, r"expert tensor parallelism"),
        ({"ep": 2, "dp": 2}, {"num_experts": None}, CheckpointError, r"ep=2 asked for, but the model has no experts"),
    ],
)
def test_what_cannot_be_written_is_refused_by_name(imported, tmp_path, kwargs, changes, error, message):
    ckpt = from_shardpoint(str(imported))
    ckpt.args = dict(ckpt.args) | changes
    with pytest.raises(error, match=message):
        export_megatron(ckpt, tmp_path / "out", tp=1, pp=1, **kwargs)
    assert not (tmp_path / "out").exists()


def test_the_reader_refuses_ep_folders_that_disagree(imported, tmp_path):
    export_megatron(from_shardpoint(str(imported)), tmp_path, tp=1, pp=1, dp=2, ep=2)
    path = tmp_path / STEP / "mp_rank_00_001" / "model_optim_rng.pt"
    state = load_foreign(path)
    state["model"]["decoder.layers.0.mlp.router.weight"] = state["model"]["decoder.layers.0.mlp.router.weight"] + 1
    path.unlink()
    save_foreign(state, path)
    with pytest.raises(CorruptCheckpointError, match=r"router\.weight differs between expert-parallel ranks 0 and 1"):
        read_foreign(tmp_path)
    (tmp_path / STEP / "mp_rank_00_001").rename(tmp_path / STEP / "mp_rank_00_000_001")
    with pytest.raises(CheckpointError, match=r"names its ranks mp_rank_TT_EEE .*the args and the folders disagree"):
        read_foreign(tmp_path)
    (tmp_path / STEP / "mp_rank_00_000_001").rename(tmp_path / "elsewhere")
    with pytest.raises(CorruptCheckpointError, match=r"num_experts=4, but the model holds routed experts \[0, 1\]"):
        read_foreign(tmp_path)


def test_the_cli_exports_at_an_ep(imported, tmp_path):
    done = run_cli(
        "convert", "--to", "megatron", imported, tmp_path / "out", "--tp", 1, "--pp", 1, "--dp", 4, "--ep", 4
    )
    assert done.rc == 0, done.err
    assert "ep=4, 4 rank folders" in done.out
    assert_truth(read_foreign(tmp_path / "out"), truth())
    missing = run_cli("convert", "--to", "megatron", imported, tmp_path / "x", "--tp", 1, "--pp", 1)
    assert missing.rc != 0 and "--ep" in missing.err
    stray = run_cli("convert", imported, tmp_path / "y", "--ep", 2)
    assert stray.rc != 0 and "--ep" in stray.err
