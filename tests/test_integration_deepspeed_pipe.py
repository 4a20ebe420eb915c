"""A DeepSpeed pipeline engine (``PipelineModule``, 2 stages on 2 CPU ranks) through shardpoint, in one launch.

Engine mode: the tag's files (each stage's ``layer_<nn>-model_states.pt``, the model and
ZeRO-1 optimizer files) are byte-identical to DeepSpeed's own engine's, and a resume
from them continues exactly as the uninterrupted run (same weights, same losses).
Reshardable mode: a pipeline's layer files are named per stage, not globally, so the
mode refuses a ``PipelineEngine`` on save and on load, naming engine mode instead.
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
    dirs = [str(root / name) for name in ("stock", "ours", "refused")]
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


def test_pipeline_reshardable_mode_refuses_naming_engine_mode(pipeline):
    _, results = pipeline
    for result in results:
        assert len(result["refusals"]) == 2, result["refusals"]  # save and load, every rank
        for message in result["refusals"]:
            assert "pipeline stages" in message and "use(engine)" in message, message
    assert not (pipeline[0] / "refused").exists() or not any((pipeline[0] / "refused").iterdir())
