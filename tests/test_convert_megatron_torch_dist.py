"""``convert --to megatron --ckpt-format torch_dist``: megatron-core's own ``dist_checkpointing.load`` reads it.

The source is the real ``megatron-torchdist-tp2`` fixture (Megatron-LM core_v0.16.1, tp=2,
plain Adam); the exports are at tp=1 dp=2, with the plain optimizer and with the
distributed optimizer, and megatron-core 0.16.1's GPTModel and optimizers load them on 2
gloo ranks. Weights, moments and the step equal the fixture's truth.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from shardpoint.errors import CheckpointError
from shardpoint.foreign import read_foreign
from shardpoint.foreign.megatron_torch_dist_export import export_megatron_torch_dist
from tests.distributed import launch
from tests.test_cli_commands import run_cli
from tests.test_foreign_import import FIXTURES, MOMENTS, params_of, truth

SOURCE = FIXTURES / "megatron-torchdist-tp2" / "ckpt"
STEP = "iter_0000002"


def convert(dst, *extra: str) -> dict:
    result = run_cli(
        "convert", "--from", "megatron", "--to", "megatron", SOURCE, dst,
        "--tp", "1", "--pp", "1", "--dp", "2", "--ckpt-format", "torch_dist", "--json", *extra,
    )  # fmt: skip
    assert result.rc == 0, result.err
    return result.json()


def test_megatron_core_loads_the_export_at_another_tp(tmp_path):
    pytest.importorskip("megatron.core")
    from tests import convert_megatron_torch_dist_worker as worker

    plain, distributed = tmp_path / "plain", tmp_path / "distopt"
    assert convert(plain)["ckpt_format"] == "torch_dist"  # the CLI once, the API once
    export_megatron_torch_dist(read_foreign(SOURCE), distributed, tp=1, pp=1, dp=2, distributed_optimizer=True)
    assert (plain / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert json.loads((plain / STEP / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    results = launch(worker.load_both, 2, str(plain / STEP), str(distributed / STEP), backend="gloo", timeout=240)
    want = truth("megatron-torchdist-tp2")
    for result in results:
        for form, loaded in result.items():
            assert (loaded["iteration"], loaded["tp"]) == (2, 1), form
            assert loaded["rng"][0]["random_rng_state"] is not None, form  # the source's tp rank 0 state
            assert set(loaded["steps"]) == {float(want["step"])}, (form, loaded["steps"])
            got = loaded["state"]
            for name in params_of(want):
                assert torch.equal(got[f"model.{name}"], want[name]), (form, name)
                for moment in MOMENTS:
                    assert torch.equal(got[f"optimizer.state.{name}.{moment}"], want[f"{name}.{moment}"]), (form, name)
    assert results[0]["distributed"]["content"]["distrib_optim_sharding_type"] == "fully_reshardable"


def test_the_export_reads_back_as_its_source_and_keeps_the_fixtures_keys(tmp_path):
    source = read_foreign(SOURCE)
    export_megatron_torch_dist(source, tmp_path, tp=2, pp=1)
    again = read_foreign(tmp_path)
    assert list(again.params) == list(source.params)
    for name, tensor in source.params.items():
        assert torch.equal(again.params[name], tensor), name
        for key in (*MOMENTS, "step"):
            assert torch.equal(again.optimizer[name][key], source.optimizer[name][key]), (name, key)
    written = pickle.loads((tmp_path / STEP / ".metadata").read_bytes()).state_dict_metadata
    real = pickle.loads((SOURCE / STEP / ".metadata").read_bytes()).state_dict_metadata
    assert set(written) == set(real)  # at the source's tp: the same tensors, objects and RNG shards
    for key, md in real.items():
        assert getattr(written[key], "size", None) == getattr(md, "size", None), key


def test_what_it_does_not_write_is_refused_before_anything_is_written(tmp_path):
    source = read_foreign(SOURCE)
    source.args = dict(source.args, bf16=True)
    with pytest.raises(CheckpointError, match="--distributed-optimizer"):
        export_megatron_torch_dist(source, tmp_path / "bf16", tp=1, pp=1)
    source.args = dict(source.args, bf16=False, num_experts=4)
    with pytest.raises(CheckpointError, match="--ckpt-format torch"):
        export_megatron_torch_dist(source, tmp_path / "moe", tp=1, pp=1)
    assert not (tmp_path / "bf16").exists() and not (tmp_path / "moe").exists()


@pytest.mark.skipif(
    not os.environ.get("SHARDPOINT_MEGATRON_FULL"), reason="set SHARDPOINT_MEGATRON_FULL=1 (about 1 min)"
)
@pytest.mark.parametrize(("tp", "pp", "distributed"), [(1, 2, False), (1, 2, True), (2, 1, True)])
def test_megatron_core_loads_the_export_at_other_layouts(tmp_path, tp, pp, distributed):
    """At pp=2 and at tp=2 too: every tensor megatron-core loads equals the fixture's at its global key and slice."""
    pytest.importorskip("megatron.core")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests import convert_megatron_torch_dist_worker as worker

    export_megatron_torch_dist(
        read_foreign(SOURCE), tmp_path / "out", tp=tp, pp=pp, dp=2 // (tp * pp), distributed_optimizer=distributed
    )
    dcp_to_torch_save(SOURCE / STEP, tmp_path / "source.pt")  # the fixture's global tensors, read by DCP alone
    source = torch.load(tmp_path / "source.pt", weights_only=False)
    results = launch(worker.load_at, 2, str(tmp_path / "out" / STEP), tp, pp, distributed, backend="gloo", timeout=300)
    seen = set()
    for result in results:
        assert result["iteration"] == 2 and result["rng"] is not None and set(result["steps"]) == {2.0}
        for key, where, tensor in result["state"]:
            key = key.replace("optimizer.state.param.", "")  # the distributed optimizer's fp32 copy of the weight
            assert torch.equal(tensor, source[key][where]), (key, where)
            seen.add(key)
    assert len([k for k in source if isinstance(source[k], torch.Tensor)]) == len(seen)
