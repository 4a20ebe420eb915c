"""A DeepSpeed pipeline engine (``PipelineModule``, 2 stages on 2 CPU ranks) through shardpoint, in one launch.

Engine mode: the tag's files (each stage's ``layer_<nn>-model_states.pt``, the model and
ZeRO-1 optimizer files) are byte-identical to DeepSpeed's own engine's, and a resume
from them continues exactly as the uninterrupted run (same weights, same losses).
Reshardable mode: a ``PipelineModule`` names each layer by its global index, so a
checkpoint saved at pp=2 dp=1 (a tied layer on both stages) loads at pp=1 dp=2, trains on,
and loads back at pp=2 dp=1, with weights, fp32 masters, Adam moments and step counts equal
to what was saved, read with DeepSpeed's own getters. ``convert --to deepspeed --pp 2`` of the
pp=2 save writes a ``PipelineEngine``'s files, which DeepSpeed's own engine loads exactly.
"""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest
import torch

from tests.distributed import launch
from tests.integration_deepspeed_pipe import TAG, pipeline_both_modes
from tests.integration_deepspeed_worker import ENV

pytestmark = pytest.mark.skipif(find_spec("deepspeed") is None, reason="DeepSpeed is in the test extra")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    dirs = [str(root / name) for name in ("stock", "ours", "reshard")]
    return root, launch(pipeline_both_modes, 2, *dirs, env=ENV, backend="gloo", timeout=150)


def test_pipeline_engine_mode_files_are_deepspeeds_own(pipeline):
    root, results = pipeline
    stock, ours = results[0]["files"]
    assert any(name.startswith("layer_") for name in stock), sorted(stock)
    assert sorted(ours) == sorted([*stock, "shardpoint.json"])
    for name, data in stock.items():
        assert ours[name] == data, f"{name} differs from DeepSpeed's own engine's"
    assert (root / "ours" / "latest").read_text() == TAG
    assert not [p.name for p in (root / "ours").iterdir() if p.name.startswith(".shardpoint-")]


def test_pipeline_engine_mode_resumes_exactly(pipeline):
    _, results = pipeline
    for rank, result in enumerate(results):
        assert result["loaded"].keys() == result["saved"].keys()
        for key, value in result["saved"].items():
            assert torch.equal(result["loaded"][key], value), f"rank {rank}: {key}"
        assert result["after"] == result["expected"], f"rank {rank}: the resumed losses differ"
        assert result["client"]["iteration"] == 2


def _whole(snapshots: list[dict]) -> dict[str, torch.Tensor]:
    """Every key of the ranks' snapshots, each rank's copy of a replica (a tied layer) checked equal."""
    whole: dict[str, torch.Tensor] = {}
    for snap in snapshots:
        for key, value in {**snap["weights"], **snap["state"]}.items():
            if key in whole:
                assert torch.equal(whole[key], value), f"{key}: the stages' replicas differ"
            whole[key] = value
    return whole


def _assert_holds(snapshot: dict, whole: dict[str, torch.Tensor], what: str) -> None:
    mine = {**snapshot["weights"], **snapshot["state"]}
    assert mine, what
    for key, value in mine.items():
        assert torch.equal(value, whole[key]), f"{what}: {key} differs"


def test_pipeline_reshardable_mode_moves_between_pp2_dp1_and_pp1_dp2_exactly(pipeline):
    _, results = pipeline
    runs = [result["reshard"] for result in results]
    pp2 = _whole([run["pp2_saved"] for run in runs])
    assert any(key.startswith("tied_modules.io.") for key in pp2), sorted(pp2)
    assert {k.split(".")[0] for k in runs[0]["pp2_saved"]["weights"]} != {
        k.split(".")[0] for k in runs[1]["pp2_saved"]["weights"]
    }
    for rank, run in enumerate(runs):  # pp=1 dp=2: every rank holds every layer, whole
        assert set(run["pp1_loaded"]["weights"]) | set(run["pp1_loaded"]["state"]) == set(pp2)
        _assert_holds(run["pp1_loaded"], pp2, f"pp=2 -> pp=1, rank {rank}")
        assert (run["pp1_loaded"]["step"], run["pp1_loaded"]["global"]) == (2, 2)
        assert run["pp1_client"] == {"iteration": 2, "rank": 0}  # another layout: rank 0's, as DeepSpeed's file
    pp1 = _whole([run["pp1_saved"] for run in runs])
    for rank, run in enumerate(runs):  # and back: each stage its own layers
        _assert_holds(run["back_loaded"], pp1, f"pp=1 -> pp=2, rank {rank}")
        assert (run["back_loaded"]["step"], run["back_loaded"]["global"]) == (3, 3)
        assert set(run["back_loaded"]["weights"]) == set(run["pp2_saved"]["weights"])
    assert runs[1]["back_losses"] and all(loss == loss for loss in runs[1]["back_losses"])


def test_pipeline_tied_layer_bias_that_deepspeed_does_not_tie_is_refused_not_merged(pipeline):
    root, results = pipeline
    for result in results:
        message = result["reshard"]["untied_refusal"]
        assert message.startswith("ReplicaMismatchError") and "'model.tied_modules.io.bias'" in message, message
    assert not (root / "reshard" / "untied" / "latest").exists()


def test_pipeline_convert_to_deepspeed_loads_in_deepspeeds_own_pipeline_engine_exactly(pipeline):
    """``convert --to deepspeed --pp 2 --dp 1 --zero-stage 1`` of the pp=2 save: per-layer files, per-stage
    model and optimizer files, which DeepSpeed's own ``PipelineEngine`` (no shardpoint) loads exactly."""
    root, results = pipeline
    names = sorted(p.name for p in (root / "reshard" / "ds" / TAG).iterdir())
    assert [n for n in names if n.startswith("layer_")] == [f"layer_{i:02d}-model_states.pt" for i in range(5)]
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(names)
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"} <= set(names)
    for rank, result in enumerate(results):
        saved, loaded = result["reshard"]["pp2_saved"], result["reshard"]["converted_loaded"]
        assert loaded["weights"].keys() == saved["weights"].keys() and loaded["state"].keys() == saved["state"].keys()
        for key, value in {**saved["weights"], **saved["state"]}.items():
            got = loaded["weights"].get(key, loaded["state"].get(key))
            assert torch.equal(got, value), f"rank {rank}: {key} differs after DeepSpeed's load"
        assert (loaded["step"], loaded["global"]) == (2, 2)
        assert loaded["client"]["iteration"] == 2


def test_pipeline_convert_to_deepspeed_refuses_another_pp(pipeline, tmp_path):
    from shardpoint.errors import CheckpointError
    from shardpoint.foreign.deepspeed_export import export_deepspeed, from_reshardable

    root, _ = pipeline
    with pytest.raises(CheckpointError, match=r"saved at pp=1; .*saved stages only"):
        export_deepspeed(from_reshardable(str(root / "reshard" / "pp1")), tmp_path / "pp1", dp=1, pp=2)
    with pytest.raises(CheckpointError, match=r"does not run ZeRO-3"):
        export_deepspeed(from_reshardable(str(root / "reshard" / "pp2")), tmp_path / "pp2", dp=1, stage=3)
    assert not (tmp_path / "pp1").exists() and not (tmp_path / "pp2").exists()
