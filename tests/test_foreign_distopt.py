"""Megatron-LM ``torch_dist`` with the distributed optimizer: bucket space decoded exactly, or refused by name.

``llama-torchdist-tp2-dp2-distopt`` was written by Megatron-LM's own ``save_checkpoint``
in its default ``dp_reshardable`` layout (tests/fixtures/megatron-llama/README.md);
``llama-truth.pt`` holds the live job's full tensors and Adam moments.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import shardpoint as sp
from shardpoint import offline
from shardpoint.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from shardpoint.foreign import import_checkpoint, read_foreign
from shardpoint.foreign._unpickle import load_dcp_metadata_foreign, load_foreign, save_foreign
from shardpoint.foreign.structure import split_dim
from tests.distributed import launch
from tests.test_cli_commands import run_cli
from tests.test_foreign_import import MOMENTS, assert_equal, build_model, params_of
from tests.test_foreign_safety import Evil

LLAMA = Path(__file__).parent / "fixtures" / "megatron-llama"
DISTOPT = LLAMA / "llama-torchdist-tp2-dp2-distopt" / "ckpt"
STEP_DIR = "iter_0000002"
LOCAL_SPEC = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}
LOCAL_SPEC["pre_mlp_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight"


def truth() -> dict[str, torch.Tensor]:
    return torch.load(LLAMA / "llama-truth.pt", weights_only=True)


def copy_ckpt(tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(DISTOPT, dst)
    for path in dst.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dst


def assert_truth(ckpt) -> None:
    t = truth()
    assert sorted(ckpt.params) == sorted(params_of(t))
    for name in params_of(t):
        assert_equal(name, ckpt.params[name], t[name])
        for moment in MOMENTS:
            assert_equal(f"{name}.{moment}", ckpt.optimizer[name].get(moment), t[f"{name}.{moment}"])
        assert int(ckpt.optimizer[name]["step"]) == int(t["step"])
        assert "master_param" not in ckpt.optimizer[name]  # fp32 weights: the optimizer's copy is the weight


def test_dp_reshardable_buckets_decode_to_the_truth_and_import_exactly(tmp_path):
    ckpt = read_foreign(DISTOPT)
    assert (ckpt.format, ckpt.optimizer_sharding, ckpt.extra["optimizer_layout"]) == (
        "torch_dist",
        "distributed-optimizer",
        "dp_reshardable",
    )
    assert_truth(ckpt)
    assert [len(g["param_names"]) for g in ckpt.param_groups] == [10, 5]  # weight decay / none (norms)
    import_checkpoint(DISTOPT, tmp_path / "imported")
    full = offline.read_full(tmp_path / "imported")  # checksums verified
    t = truth()
    for name in params_of(t):
        assert_equal(name, full.tensors[f"model.{name}"], t[name])
        for moment in MOMENTS:
            assert_equal(moment, full.tensors[f"optimizer.state.{name}.{moment}"], t[f"{name}.{moment}"])
    assert full.metadata.iteration == 2 and full.metadata.consumed_samples == 4


def _load_at_tp2(rank: int, world: int, root: str, names: list[str], shapes: dict) -> dict:
    topo = sp.Topology(tp_size=2, pp_size=1, dp_size=1, rank=rank)
    local = {}
    for name in names:
        dim = split_dim(name)
        shape = list(shapes[name])
        if dim is not None:
            shape[dim] //= 2
        local[name] = tuple(shape)
    model = build_model(local)
    params = dict(model.named_parameters())

    def sharded_state_dict() -> dict:
        return {n: p if split_dim(n) is None else sp.shard_along(p, split_dim(n), rank, 2) for n, p in params.items()}

    model.sharded_state_dict = sharded_state_dict
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    result = sp.Checkpointer(root, topology=topo).load(sp.TrainState(model=model, optimizer=optimizer, extra={}))
    return {
        "iteration": result.iteration,
        "tensors": {n: (p.detach().clone(), {k: optimizer.state[p][k] for k in MOMENTS}) for n, p in params.items()},
    }


def test_the_import_loads_at_tp1_and_at_tp2(tmp_path):
    import_checkpoint(DISTOPT, tmp_path / "run")
    t = truth()
    names = params_of(t)
    model = build_model({n: t[n].shape for n in names})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    state = sp.TrainState(model=model, optimizer=optimizer, extra={})
    assert sp.Checkpointer(tmp_path / "run", topology=sp.Topology(1, 1, 1, rank=0)).load(state).iteration == 2
    for name, p in model.named_parameters():
        assert torch.equal(p, t[name]) and all(torch.equal(optimizer.state[p][m], t[f"{name}.{m}"]) for m in MOMENTS)
    shapes = {n: tuple(t[n].shape) for n in names}
    for rank, got in enumerate(launch(_load_at_tp2, 2, str(tmp_path / "run"), names, shapes)):
        assert got["iteration"] == 2
        for name, (param, moments) in got["tensors"].items():
            dim = split_dim(name)
            for key, value in {"": param, **{f".{m}": moments[m] for m in MOMENTS}}.items():
                full = t[name + key]
                assert torch.equal(value, full if dim is None else torch.chunk(full, 2, dim=dim)[rank]), (rank, name)


def _write_fully_reshardable(tmp_path: Path) -> Path:
    """The fixture's model, with its optimizer saved as ``fully_reshardable`` (model space), from the truth.

    No fixture was written with ``--dist-ckpt-optim-fully-reshardable``; this follows
    megatron-core 0.16.1 ``DistributedOptimizer.sharded_param_state_fully_reshardable``:
    per model key ``optimizer.state.<param|exp_avg|exp_avg_sq>.<key>`` shaped (stacked,
    sharded) like the weight, and the hyperparameters with the step in ``common.pt``'s
    ``optimizer.optimizer.param_groups``.
    """
    real = DISTOPT / STEP_DIR
    metadata = load_dcp_metadata_foreign((real / ".metadata").read_bytes(), str(real / ".metadata"))

    class Reader(dcp.FileSystemReader):  # Megatron's .metadata through the allow-list, as the importer reads it
        def read_metadata(self, *args, **kwargs):
            return metadata

    model_keys = {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in model_keys.items() if "optimizer" not in k}
    dcp.load(state, storage_reader=Reader(str(real)), no_dist=True)
    t = truth()
    for key in list(state):
        for name, source in (("param", ""), ("exp_avg", ".exp_avg"), ("exp_avg_sq", ".exp_avg_sq")):
            if key.startswith("decoder.layers."):
                rest = key.removeprefix("decoder.layers.")
                legacy = {v: k for k, v in LOCAL_SPEC.items()}.get(rest, rest)
                value = torch.stack([t[f"decoder.layers.{i}.{legacy}{source}"] for i in range(2)])
            else:
                value = t[key + source]
            state[f"optimizer.state.{name}.{key}"] = value.clone()
    out = tmp_path / "fully" / STEP_DIR
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    common = load_foreign(real / "common.pt")
    hyper = read_foreign(DISTOPT).param_groups
    groups = [{k: v for k, v in g.items() if k != "param_names"} | {"step": 2.0} for g in hyper]
    common["optimizer"] = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}
    common["content_metadata"]["distrib_optim_sharding_type"] = "fully_reshardable"
    save_foreign(common, out / "common.pt")
    shutil.copy(real / "metadata.json", out / "metadata.json")
    (out.parent / "latest_checkpointed_iteration.txt").write_text("2")
    return out.parent


def test_fully_reshardable_model_space_reads_to_the_truth(tmp_path):
    root = _write_fully_reshardable(tmp_path)
    ckpt = read_foreign(root)
    assert ckpt.extra["optimizer_layout"] == "fully_reshardable"
    assert_truth(ckpt)


def test_a_bucket_layout_that_does_not_fit_is_named_and_no_optimizer_still_imports(tmp_path):
    root = copy_ckpt(tmp_path)
    common_path = root / STEP_DIR / "common.pt"
    common = load_foreign(common_path)
    common["args"].swiglu = False  # fc1's TP pieces are then read as plain chunks, not [gate_r; up_r]
    common_path.unlink()
    save_foreign(common, common_path)
    with pytest.raises(CorruptCheckpointError, match=r"linear_fc1\.weight.*not that parameter's fp32 copy"):
        read_foreign(root)
    common = load_foreign(DISTOPT / STEP_DIR / "common.pt")
    common["optimizer"]["param_state_sharding_type"] = "fully_sharded_model_space"
    common["args"].num_experts = 8
    common["args"].expert_tensor_parallel_size = 4  # etp > 1 other than tp=2: its bucket layout is not derived
    common_path.unlink()
    save_foreign(common, common_path)
    with pytest.raises(CheckpointError, match=r"'fully_sharded_model_space'.*--no-optimizer"):
        read_foreign(root)
    common["optimizer"]["param_state_sharding_type"] = "dp_reshardable"
    common_path.unlink()
    save_foreign(common, common_path)
    with pytest.raises(CheckpointError, match=r"mixture of experts"):
        read_foreign(root)
    refused = run_cli("convert", "--from", "megatron", root, tmp_path / "x")
    assert refused.rc == 1 and "mixture of experts" in refused.err and not (tmp_path / "x").exists()
    imported = run_cli("convert", "--from", "megatron", root, tmp_path / "weights", "--no-optimizer", "--json")
    assert imported.rc == 0, imported.err
    full = offline.read_full(imported.json()["destination"])
    t = truth()
    assert not any(k.startswith("optimizer.state.") for k in full.tensors)
    for name in params_of(t):
        assert_equal(name, full.tensors[f"model.{name}"], t[name])


def test_a_crafted_pickle_in_common_pt_is_refused_and_runs_nothing(tmp_path):
    root = copy_ckpt(tmp_path)
    marker = tmp_path / "pwned"
    path = root / STEP_DIR / "common.pt"
    state = load_foreign(path)
    state["optimizer"]["param_state_sharding_type"] = Evil(marker)
    path.unlink()
    save_foreign(state, path)
    with pytest.raises(UnsafeCheckpointError, match=r"(posix|os)\.system") as info:
        read_foreign(root)
    assert "common.pt" in str(info.value) and not marker.exists()
    with pytest.raises(UnsafeCheckpointError):
        read_foreign(root, optimizer=False)  # common.pt holds the args: never read past it
    assert not marker.exists()


def test_inspect_describes_the_distributed_optimizer_checkpoint():
    report = run_cli("inspect", DISTOPT, "--tensors", "--json")
    assert report.rc == 0, report.err
    got = report.json()
    assert (got["format"], got["tp"], got["dp"], got["optimizer_sharding"], got["optimizer_layout"]) == (
        "torch_dist",
        2,
        2,
        "distributed-optimizer",
        "dp_reshardable",
    )
    assert got["optimizer_problem"] is None and got["with_optimizer_state"] == got["parameters"] == 15
    assert all(row["optimizer_state"] == ["exp_avg", "exp_avg_sq", "step"] for row in got["tensors"])
    text = " ".join(run_cli("inspect", DISTOPT).out.split())
    assert "distributed optimizer, dp_reshardable layout (bucket space), decoded per parameter" in text


def test_inspect_names_an_optimizer_it_cannot_decode_and_still_describes_the_weights(tmp_path):
    root = copy_ckpt(tmp_path)
    path = root / STEP_DIR / "common.pt"
    common = load_foreign(path)
    common["args"].virtual_pipeline_model_parallel_size = 2
    path.unlink()
    save_foreign(common, path)
    result = run_cli("inspect", root, "--json")
    assert result.rc == 1
    report = json.loads(result.out)
    assert "virtual pipeline stages" in report["optimizer_problem"] and report["parameters"] == 15
