"""Megatron-LM MoE ``torch_dist`` checkpoints: imported exactly, loaded at another ep, or refused by name.

``tests/fixtures/megatron-moe`` holds two checkpoints of one MoE GPT (4 experts, top-2,
SequentialMLP, sigmoid router with expert bias, one shared expert), written by Megatron-LM
core_v0.16.1's own ``save_checkpoint`` with the distributed optimizer: at ep=2 (a
ChainedOptimizer, ``chained_0.`` dense / ``chained_1.`` experts) and at ep=1 dp=2 (one
optimizer). ``truth.pt`` holds the live job's full tensors and Adam moments under GPTModel
names with global expert ids. The import reads both to that truth, and the result loads
into a model declared with shardpoint's expert helpers at another ep, bit for bit.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint import offline
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.foreign import import_checkpoint, read_foreign
from shardpoint.foreign._unpickle import load_foreign, save_foreign
from shardpoint.foreign.exporter import export_megatron, from_shardpoint
from tests.distributed import launch
from tests.test_cli_commands import run_cli
from tests.test_foreign_import import MOMENTS, assert_equal, build_model, params_of

MOE = Path(__file__).parent / "fixtures" / "megatron-moe"
EP2, EP1 = "moe-torchdist-ep2-distopt", "moe-torchdist-ep1-dp2-distopt"
STEP_DIR = "iter_0000002"
EXPERTS = 4
LOCAL = re.compile(r"local_experts\.(\d+)\.")


def truth(fixture: str = EP2) -> dict[str, torch.Tensor]:
    return torch.load(MOE / fixture / "truth.pt", weights_only=True)


def is_bias_buffer(name: str) -> bool:
    return name.endswith("mlp.router.expert_bias")


def copy_ckpt(tmp_path: Path, fixture: str = EP2) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(MOE / fixture / "ckpt", dst)
    for path in dst.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dst


def with_args(root: Path, **changes) -> Path:
    """The copied checkpoint with its ``common.pt`` args changed."""
    path = root / STEP_DIR / "common.pt"
    common = load_foreign(path)
    for key, value in changes.items():
        setattr(common["args"], key, value)
    path.unlink()
    save_foreign(common, path)
    return root


@pytest.mark.parametrize("fixture", [EP2, EP1])
def test_reader_gives_every_weight_buffer_and_moment_of_the_truth(fixture):
    ckpt = read_foreign(MOE / fixture / "ckpt")
    t = truth(fixture)
    names = params_of(t)
    assert list(ckpt.params) == names  # GPTModel order: router, experts by global id, shared experts
    assert ckpt.buffers == [n for n in names if is_bias_buffer(n)] and len(ckpt.buffers) == 2
    assert ckpt.ep == {EP2: 2, EP1: 1}[fixture] and ckpt.extra["optimizer_layout"] == "dp_reshardable"
    for name in names:
        assert_equal(name, ckpt.params[name], t[name])
        if name in ckpt.buffers:
            assert ckpt.optimizer[name] == {}  # a buffer: no moments, no step
            continue
        for moment in MOMENTS:
            assert_equal(f"{name}.{moment}", ckpt.optimizer[name].get(moment), t[f"{name}.{moment}"])
        assert int(ckpt.optimizer[name]["step"]) == int(t["step"]) == 2
    experts = [n for n in names if LOCAL.search(n)]
    assert len(experts) == 2 * EXPERTS * 2
    groups = [(g.get("is_expert_parallel"), g["wd_mult"], g["param_names"]) for g in ckpt.param_groups]
    if fixture == EP2:  # the dense optimizer's two groups, then the expert optimizer's
        assert [g[:2] for g in groups] == [(False, 1.0), (False, 0.0), (True, 1.0)]
        assert groups[2][2] == experts and not set(experts) & set(groups[0][2] + groups[1][2])
    else:
        assert [g[:2] for g in groups] == [(False, 1.0), (False, 0.0)] and set(experts) <= set(groups[0][2])
    grouped = [n for g in groups for n in g[2]]
    assert sorted(grouped) == sorted(n for n in names if n not in ckpt.buffers)  # each once, buffers in none


def test_weights_only_reads_the_same_weights():
    ckpt = read_foreign(MOE / EP2 / "ckpt", optimizer=False)
    t = truth()
    assert list(ckpt.params) == params_of(t)
    assert all(torch.equal(ckpt.params[n], t[n]) for n in params_of(t))
    assert not any(ckpt.optimizer.values())


def test_both_fixtures_import_to_the_same_checkpoint_of_the_truth(tmp_path):
    t = truth()
    for fixture in (EP2, EP1):
        import_checkpoint(MOE / fixture / "ckpt", tmp_path / fixture)
        full = offline.read_full(tmp_path / fixture)  # checksums verified
        assert full.metadata.iteration == 2 and full.metadata.format == "dist"
        for name in params_of(t):
            assert_equal(name, full.tensors[f"model.{name}"], t[name])
            for moment in MOMENTS:
                key = f"optimizer.state.{name}.{moment}"
                assert (key in full.tensors) != is_bias_buffer(name), key
                if not is_bias_buffer(name):
                    assert_equal(key, full.tensors[key], t[f"{name}.{moment}"])
        foreign = full.common["foreign"]
        assert foreign["ep"] == {EP2: 2, EP1: 1}[fixture] and len(foreign["buffers"]) == 2
        assert full.metadata.config["num_experts"] == EXPERTS


class MoEGPT(torch.nn.Module):
    """The fixture's GPTModel at ``topo``: this rank's experts as ``local_experts.<local index>``, as in Megatron.

    ``sharded_state_dict`` names each expert by its global id (:func:`shardpoint.global_expert`);
    the router's ``expert_bias`` is a buffer.
    """

    def __init__(self, shapes: dict[str, torch.Size], topo: sp.Topology):
        super().__init__()
        self.topo, self.local = topo, sp.divide(EXPERTS, topo.ep_size, "experts")
        held = {}
        for name, shape in shapes.items():
            match = LOCAL.search(name)
            if match is None:
                held[name] = shape
            elif int(match.group(1)) // self.local == topo.ep_rank:  # this ep rank's experts, local index
                held[name.replace(match.group(0), f"local_experts.{int(match.group(1)) % self.local}.")] = shape
        self.body = build_model({n: s for n, s in held.items() if not is_bias_buffer(n)})
        for name in (n for n in held if is_bias_buffer(n)):
            path, _, leaf = name.rpartition(".")
            self.body.get_submodule(path).register_buffer(leaf, torch.zeros(held[name]))

    def sharded_state_dict(self) -> dict:
        out = {}
        for name, tensor in self.body.state_dict(keep_vars=True).items():
            match = LOCAL.search(name)
            if match is None:
                out[name] = tensor
                continue
            g = sp.global_expert(int(match.group(1)), self.local, self.topo)
            key = name.replace(match.group(0), f"local_experts.{g}.")
            split = sp.expert_column_parallel if "linear_fc1" in name else sp.expert_row_parallel
            out[key] = split(tensor, self.topo)
        return out


def _load(rank: int, world: int, root: str, ep: int, shapes: dict) -> dict:
    topo = sp.Topology(tp_size=1, dp_size=world, ep_size=ep, rank=rank)
    model = MoEGPT(shapes, topo)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    result = sp.Checkpointer(root, topology=topo).load(sp.TrainState(model=model, optimizer=optimizer, extra={}))
    loaded = {}
    for key, value in model.sharded_state_dict().items():
        tensor = value.tensor if hasattr(value, "tensor") else value
        param = next((p for p in model.parameters() if p.data_ptr() == tensor.data_ptr()), None)
        state = optimizer.state[param] if param is not None else {}
        loaded[key] = (tensor.detach().clone(), {k: v.clone() for k, v in state.items()})
    return {"iteration": result.iteration, "loaded": loaded}


def _check(got: dict, t: dict[str, torch.Tensor], expect: list[str]) -> None:
    assert got["iteration"] == 2
    assert sorted(got["loaded"]) == sorted(expect)
    for name, (value, state) in got["loaded"].items():
        assert torch.equal(value, t[name]), name
        if is_bias_buffer(name):
            assert state == {}, name
            continue
        for moment in MOMENTS:
            assert torch.equal(state[moment], t[f"{name}.{moment}"]), (name, moment)
        assert int(state["step"]) == 2


def _held(names: list[str], ep: int, ep_rank: int) -> list[str]:
    per_rank = EXPERTS // ep
    return [n for n in names if not (m := LOCAL.search(n)) or int(m.group(1)) // per_rank == ep_rank]


def test_the_ep2_import_loads_at_ep1_in_one_process(tmp_path):
    import_checkpoint(MOE / EP2 / "ckpt", tmp_path / "run")
    t = truth()
    shapes = {n: t[n].shape for n in params_of(t)}
    _check(_load(0, 1, str(tmp_path / "run"), 1, shapes), t, params_of(t))


@pytest.mark.parametrize("fixture", [EP2, EP1])
def test_the_import_loads_at_ep2_on_two_ranks(fixture, tmp_path):
    import_checkpoint(MOE / fixture / "ckpt", tmp_path / "run")
    t = truth(fixture)
    names = params_of(t)
    results = launch(_load, 2, str(tmp_path / "run"), 2, {n: t[n].shape for n in names})
    for ep_rank, got in enumerate(results):  # tp=1, dp=2, ep=2: rank r is ep rank r
        _check(got, t, _held(names, 2, ep_rank))


def test_the_cli_converts_a_moe_checkpoint(tmp_path):
    done = run_cli("convert", "--from", "megatron", MOE / EP2 / "ckpt", tmp_path / "run", "--json")
    assert done.rc == 0, done.err
    full = offline.read_full(done.json()["destination"])
    t = truth()
    assert all(torch.equal(full.tensors[f"model.{n}"], t[n]) for n in params_of(t))


@pytest.mark.parametrize(
    ("changes", "message", "weights_import"),
    [
        (  # the legacy GroupedMLP is read (tests/test_foreign_moe_grouped.py); Transformer Engine's is not
            {"moe_grouped_gemm": True, "transformer_impl": "transformer_engine"},
            r"Transformer Engine grouped-GEMM experts \(--moe-grouped-gemm.*TEGroupedMLP",
            False,
        ),
        ({"moe_layer_freq": [1, 0]}, r"MoE layers mixed with dense layers", False),
        ({"expert_tensor_parallel_size": 2}, r"expert tensor parallelism other than tp.*tp=1.*--no-optimizer", True),
        (  # ep with pipeline stages is derived (tests/test_foreign_moe_layouts.py): these buckets do not fit it
            {"pipeline_model_parallel_size": 2},
            r"distributed-optimizer groups \[0\], but tp=1 x pp=2 needs one per model-parallel rank",
            True,
        ),
        ({"expert_model_parallel_size": 1}, r"'chained_0\..*chained optimizer.*--no-optimizer", True),
    ],
)
def test_unsupported_moe_layouts_are_refused_by_name(tmp_path, changes, message, weights_import):
    root = with_args(copy_ckpt(tmp_path), **changes)
    with pytest.raises(CheckpointError, match=message):
        read_foreign(root)
    if weights_import:  # the weights are global in torch_dist: --no-optimizer still imports them
        ckpt = read_foreign(root, optimizer=False)
        t = truth()
        assert all(torch.equal(ckpt.params[n], t[n]) for n in params_of(t))
    else:
        with pytest.raises(CheckpointError, match=message):
            read_foreign(root, optimizer=False)


def test_weights_that_disagree_with_the_args_are_named(tmp_path):
    root = with_args(copy_ckpt(tmp_path), num_experts=2)
    with pytest.raises(CorruptCheckpointError, match=r"experts\.experts\.linear_fc1\.weight.*num_experts=2"):
        read_foreign(root, optimizer=False)


def test_legacy_moe_that_disagrees_with_its_args_and_export_without_ep_are_refused_by_name(tmp_path):
    """Legacy MoE folders are read (tests/test_foreign_moe_export.py); args naming experts the weights lack,
    a folder name the args do not allow, and an export that does not say its ep are refused, each named."""
    legacy = tmp_path / "legacy"
    shutil.copytree(Path(__file__).parent / "fixtures" / "foreign" / "megatron-legacy-tp1" / "ckpt", legacy)
    rank_file = legacy / STEP_DIR / "mp_rank_00" / "model_optim_rng.pt"
    rank_file.chmod(0o644)
    state = load_foreign(rank_file)
    state["args"].num_experts = 4
    rank_file.unlink()
    save_foreign(state, rank_file)
    with pytest.raises(CheckpointError, match=r"num_experts=4, but the model holds routed experts \[\]"):
        read_foreign(legacy)
    (legacy / STEP_DIR / "mp_rank_00").rename(legacy / STEP_DIR / "mp_rank_00_000_001")
    with pytest.raises(CheckpointError, match=r"folder name does not fit the args.*mp_rank_TT_PPP_EEE"):
        read_foreign(legacy)
    import_checkpoint(MOE / EP2 / "ckpt", tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"\(num_experts=4\) needs the expert-parallel size.*--ep N"):
        export_megatron(from_shardpoint(str(tmp_path / "run")), tmp_path / "out", tp=1, pp=1)
    assert not (tmp_path / "out").exists()
