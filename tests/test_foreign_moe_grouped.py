"""Megatron-LM MoE with grouped-GEMM experts (the legacy ``GroupedMLP``), ``torch_dist``, decoded bit-exact.

``moe-torchdist-ep2-grouped-distopt`` is the model of ``tests/test_foreign_moe.py`` (same seeds, tp=1,
ep=2, dp=2, distributed optimizer) with ``--moe-grouped-gemm --transformer-impl local``: each layer's
experts on an ep rank are one ``GroupedMLP`` holding ``weight1`` ``[64, 2*2*48]`` and ``weight2``
``[2*48, 64]``. It was written by Megatron-LM core_v0.16.1's own ``save_checkpoint``
(``scripts/fixtures/make_megatron_moe.py --grouped``: a CPU stand-in for the ``grouped_gemm`` CUDA
extension computes the forward; everything saved is megatron-core's own). Its weights sit under
SequentialMLP's ``torch_dist`` keys; its expert optimizer buckets hold ``weight2``/``weight1`` per layer,
which the reader maps back to the per-expert moments (``megatron_moe.group_experts``).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardpoint import offline
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.foreign import import_checkpoint, read_foreign
from shardpoint.foreign._unpickle import load_foreign
from shardpoint.foreign.exporter import export_megatron, from_shardpoint
from shardpoint.foreign.megatron_distopt import sharding_type
from shardpoint.foreign.megatron_moe import expert_module
from tests.test_foreign_import import MOMENTS, assert_equal, params_of
from tests.test_foreign_moe import EP2, LOCAL, MOE, STEP_DIR, _check, _load, copy_ckpt, truth, with_args
from tests.test_foreign_moe_export import assert_truth

GROUPED = "moe-torchdist-ep2-grouped-distopt"
EXPERT_BUCKET = (
    "chained_1.optimizer.distributed.dp_group_idx_{}.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"
)


def _metadata(fixture: str) -> dict:
    md = FileSystemReader(str(MOE / fixture / "ckpt" / STEP_DIR)).read_metadata().state_dict_metadata
    return {k: v for k, v in md.items() if isinstance(v, TensorStorageMetadata)}


def _read_dcp(fixture: str, keys: list[str]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    md = _metadata(fixture)
    state = {k: torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype) for k in keys}
    dcp.load(state, storage_reader=FileSystemReader(str(MOE / fixture / "ckpt" / STEP_DIR)))
    return state


def test_the_fixture_is_groupedmlp_with_the_sequentialmlp_fixtures_truth():
    args = load_foreign(MOE / GROUPED / "ckpt" / STEP_DIR / "common.pt")["args"]
    assert args.moe_grouped_gemm and args.transformer_impl == "local" and expert_module(args) == "GroupedMLP"
    reference, t = truth(EP2), truth(GROUPED)
    assert list(t) == list(reference) and all(torch.equal(t[k], reference[k]) for k in t)


def test_groupedmlp_weights_are_stored_under_sequentialmlp_keys_and_shapes():
    """Same keys and global shapes as SequentialMLP's checkpoint; only the DCP chunks differ (per ep rank)."""
    grouped, sequential = _metadata(GROUPED), _metadata(EP2)
    assert {k: tuple(v.size) for k, v in grouped.items()} == {k: tuple(v.size) for k, v in sequential.items()}
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert tuple(grouped[fc1].size) == (2, 4, 96, 64)
    assert {tuple(c.sizes) for c in grouped[fc1].chunks} == {(1, 2, 48, 64)}  # (layer, ep rank) x gate/up
    assert {tuple(c.sizes) for c in sequential[fc1].chunks} == {(1, 1, 48, 64)}  # (layer, expert) x gate/up
    keys = [fc1, "decoder.layers.mlp.experts.experts.linear_fc2.weight"]
    a, b = _read_dcp(GROUPED, keys), _read_dcp(EP2, keys)
    assert all(torch.equal(a[k], b[k]) for k in keys)


def test_the_expert_buckets_hold_the_same_values_in_groupedmlp_order():
    """The expert optimizer's buckets: same length and values as SequentialMLP's, another element order."""
    keys = [EXPERT_BUCKET.format(r) + ".exp_avg" for r in (0, 1)]
    a, b = _read_dcp(GROUPED, keys), _read_dcp(EP2, keys)
    for key in keys:
        assert a[key].shape == b[key].shape == (36864,) and not torch.equal(a[key], b[key])
        assert torch.equal(a[key].sort().values, b[key].sort().values)
    # the first param of ep rank 0's bucket is layer 1's weight2 [E_local*F, H] = [expert 0 fc2.T; expert 1 fc2.T]
    fc2 = truth(GROUPED)["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight.exp_avg"]
    assert torch.equal(a[keys[0]][: 48 * 64], fc2.t().reshape(-1))


def test_reader_gives_every_weight_buffer_and_moment_of_the_truth():
    ckpt = read_foreign(MOE / GROUPED / "ckpt")
    t = truth(GROUPED)
    names = params_of(t)
    assert list(ckpt.params) == names and len(ckpt.buffers) == 2
    assert ckpt.ep == 2 and ckpt.extra["optimizer_layout"] == "dp_reshardable"
    assert_truth(ckpt, t)  # every weight, buffer, moment and step
    experts = [n for n in names if LOCAL.search(n)]
    groups = [(g.get("is_expert_parallel"), g["wd_mult"], g["param_names"]) for g in ckpt.param_groups]
    assert [g[:2] for g in groups] == [(False, 1.0), (False, 0.0), (True, 1.0)] and groups[2][2] == experts
    weights = read_foreign(MOE / GROUPED / "ckpt", optimizer=False)
    assert all(torch.equal(weights.params[n], t[n]) for n in names)


def test_the_import_loads_at_ep1_in_one_process(tmp_path):
    import_checkpoint(MOE / GROUPED / "ckpt", tmp_path / "run")
    t = truth(GROUPED)
    full = offline.read_full(tmp_path / "run")
    assert full.metadata.config["moe_grouped_gemm"] is True
    _check(_load(0, 1, str(tmp_path / "run"), 1, {n: t[n].shape for n in params_of(t)}), t, params_of(t))


def _same(a, b) -> bool:
    """Equal, recursively: tensors bit for bit, namespaces by their attributes."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return type(a) is type(b) and _same(vars(a), vars(b))
    return a == b


def test_the_export_writes_sequentialmlp_experts(tmp_path):
    """The export of the GroupedMLP import is file for file the export of the SequentialMLP import (args too)."""
    for fixture in (GROUPED, EP2):
        import_checkpoint(MOE / fixture / "ckpt", tmp_path / fixture / "run")
        src = from_shardpoint(str(tmp_path / fixture / "run"))
        export_megatron(src, tmp_path / fixture / "out", tp=1, pp=1, dp=2, ep=2, distributed_optimizer=True)
    state = load_foreign(tmp_path / GROUPED / "out" / STEP_DIR / "mp_rank_00_001" / "model_optim_rng.pt")
    assert state["args"].moe_grouped_gemm is False  # the written args say SequentialMLP
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight" in state["model"]
    assert not any(k.endswith(("weight1", "weight2")) for k in state["model"])
    for folder in ("mp_rank_00_000", "mp_rank_00_001"):
        for name in ("model_optim_rng.pt", "distrib_optim.pt"):
            a, b = (load_foreign(tmp_path / f / "out" / STEP_DIR / folder / name) for f in (GROUPED, EP2))
            assert _same(a, b), (folder, name)
    back = read_foreign(tmp_path / GROUPED / "out")
    t = truth(GROUPED)
    for name in params_of(t):
        assert_equal(name, back.params[name], t[name])
        for moment in () if name in back.buffers else MOMENTS:
            assert_equal(f"{name}.{moment}", back.optimizer[name][moment], t[f"{name}.{moment}"])


@pytest.mark.parametrize(
    ("fixture", "changes", "error", "message"),
    [
        (  # the args say GroupedMLP, the buckets are SequentialMLP's: the param check names the first misfit
            EP2,
            {"moe_grouped_gemm": True},
            CorruptCheckpointError,
            r"chained_1, ep rank 0.*layers\.0\.mlp\.experts\.weight1 .*is not that parameter's fp32 copy",
        ),
        (  # and the other way round
            GROUPED,
            {"moe_grouped_gemm": False},
            CorruptCheckpointError,
            r"chained_1, ep rank 0.*layers\.0\.mlp\.experts\.local_experts\.0\.linear_fc1\.weight .*is not that",
        ),
    ],
)
def test_buckets_of_the_other_expert_module_are_named(tmp_path, fixture, changes, error, message):
    root = with_args(copy_ckpt(tmp_path, fixture), **changes)
    with pytest.raises(error, match=message):
        read_foreign(root)
    t = truth(fixture)  # the weights are SequentialMLP's keys either way
    weights = read_foreign(root, optimizer=False)
    assert all(torch.equal(weights.params[n], t[n]) for n in params_of(t))


def test_te_grouped_experts_are_refused_by_name(tmp_path):
    root = with_args(copy_ckpt(tmp_path, GROUPED), transformer_impl="transformer_engine")
    for optimizer in (True, False):
        with pytest.raises(CheckpointError, match=r"TEGroupedMLP, whose layout is not derived"):
            read_foreign(root, optimizer=optimizer)


def test_groupedmlp_with_the_optimizer_in_model_space_is_refused_by_name():
    args = load_foreign(MOE / GROUPED / "ckpt" / STEP_DIR / "common.pt")["args"]
    args.expert_model_parallel_size = 1  # one optimizer (no chained_ prefix), in model space
    common = {"content_metadata": {"distrib_optim_sharding_type": "fully_reshardable"}}
    keys = ["optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    with pytest.raises(CheckpointError, match=r"GroupedMLP.*fully_reshardable.*--no-optimizer"):
        sharding_type("ckpt", common, args, keys)
