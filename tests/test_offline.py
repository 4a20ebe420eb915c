"""Offline whole-checkpoint reading and writing (``shardpoint.offline``), in one process.

The multi-rank round trips (a real tp=2/pp=2 job's checkpoints re-split and loaded)
are in ``test_cli_commands.py``; these tests cover the rules themselves: split dims
given by hand for a tp=1 source, pipeline-stage placement, which checkpoint a path
means, and that a failed write leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint import offline
from shardpoint.errors import CheckpointError, CorruptCheckpointError, TopologyMismatchError

TRACKER = "latest_checkpointed_iteration.txt"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed.weight": (16, 4),
        "model.final_norm.weight": (4,),
        **{f"model.layers.{i}.fc1.weight": (8, 4) for i in range(4)},
        **{f"model.layers.{i}.fc2.weight": (4, 8) for i in range(4)},
        **{f"model.layers.{i}.norm.weight": (4,) for i in range(4)},
        "optimizer.state.layers.0.fc1.weight.exp_avg": (8, 4),
        "optimizer.state.embed.weight.exp_avg": (16, 4),
        "optimizer.state.embed.weight.step": (),
    }
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _common() -> dict:
    return {"extra": {"consumed_samples": 64}, "optimizer_param_groups": [{"lr": 0.1}]}


def _files(checkpoint: Path) -> dict[str, dict]:
    """Per mp_rank folder: the saved ``sharding`` entry of each key."""
    return {
        p.parent.name: torch.load(p, weights_only=True)["sharding"]
        for p in sorted(checkpoint.glob("mp_rank_*/model_optim_rng.pt"))
    }


def test_tp1_source_needs_split_dims_and_optimizer_state_follows_its_parameter(tmp_path):
    tensors = _tensors()
    offline.write_checkpoint(tmp_path / "tp1", 5, tensors, _common(), 1, 1, "torch")
    with pytest.raises(CheckpointError, match="--split-dim"):
        offline.convert(tmp_path / "tp1", tmp_path / "tp2", tp=2)

    overrides = {"*fc1.weight": 0, "layers.*.fc2.weight": 1, "model.embed.weight": 0}
    offline.convert(tmp_path / "tp1", tmp_path / "tp2", tp=2, split_overrides=overrides)
    files = _files(tmp_path / "tp2" / "iter_0000005")
    assert sorted(files) == ["mp_rank_00", "mp_rank_01"]
    rank1 = files["mp_rank_01"]
    assert rank1["model.layers.2.fc1.weight"] == {"global_shape": [8, 4], "global_offset": [4, 0]}
    assert rank1["model.layers.2.fc2.weight"] == {"global_shape": [4, 8], "global_offset": [0, 4]}
    assert rank1["model.layers.2.norm.weight"]["global_offset"] == [0]  # replicated
    assert rank1["optimizer.state.layers.0.fc1.weight.exp_avg"]["global_offset"] == [4, 0]
    assert rank1["optimizer.state.embed.weight.exp_avg"]["global_offset"] == [8, 0]

    back = offline.read_full(tmp_path / "tp2")
    assert back.metadata.topology == {"tp": 2, "pp": 1, "dp": 1} and back.metadata.iteration == 5
    assert back.split_dims["model.layers.1.fc2.weight"] == 1 and back.split_dims["model.final_norm.weight"] is None
    assert back.common["extra"] == {"consumed_samples": 64}
    for key, tensor in tensors.items():
        assert torch.equal(back.tensors[key], tensor), key


def test_pipeline_stages_by_layer_number_then_source_then_name(tmp_path):
    tensors = _tensors()
    offline.write_checkpoint(
        tmp_path / "pp2", 1, tensors, _common(), 1, 2, "torch", stages={"model.embed.weight": "both"}
    )  # a tied embedding
    files = _files(tmp_path / "pp2" / "iter_0000001")
    first, last = set(files["mp_rank_00_000"]), set(files["mp_rank_00_001"])
    assert {"model.layers.0.fc1.weight", "model.layers.1.norm.weight", "model.embed.weight"} <= first
    assert {"model.layers.2.fc1.weight", "model.layers.3.norm.weight", "model.final_norm.weight"} <= last
    assert "model.embed.weight" in last and "optimizer.state.embed.weight.exp_avg" in last  # follows its param
    assert "model.final_norm.weight" not in first and "model.layers.2.fc1.weight" not in first

    offline.convert(tmp_path / "pp2", tmp_path / "pp4", pp=4)
    files = _files(tmp_path / "pp4" / "iter_0000001")
    assert sorted(files) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_00_002", "mp_rank_00_003"]
    assert "model.embed.weight" in files["mp_rank_00_000"] and "model.embed.weight" in files["mp_rank_00_003"]
    assert "model.layers.2.fc2.weight" in files["mp_rank_00_002"]
    assert "model.final_norm.weight" in files["mp_rank_00_003"]

    with pytest.raises(TopologyMismatchError, match="number of layers"):
        offline.convert(tmp_path / "pp2", tmp_path / "pp3", pp=3)
    assert not (tmp_path / "pp3").exists()


def test_naming_rule_without_source_stages():
    assert offline.layer_of("model.decoder.layers.12.mlp.fc1.weight") == 12
    assert offline.layer_of("model.embed.weight") is None
    assert offline.stage_by_name("model.embedding.word_embeddings.weight") == "first"
    assert offline.stage_by_name("model.output_layer.weight") == "last"
    assert offline.param_key_of("optimizer.state.layers.0.fc1.weight.exp_avg") == "model.layers.0.fc1.weight"


def test_plain_module_saved_by_the_checkpointer_reads_back(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    ckpt = sp.Checkpointer(str(tmp_path / "run"), config={"width": 5})
    ckpt.save(7, sp.TrainState(model=model, extra={"consumed_samples": 7}))
    ckpt.close()
    tensors, common, meta, split_dims = offline.read_full(tmp_path / "run")
    assert meta.iteration == 7 and meta.format == "dist" and common["extra"] == {"consumed_samples": 7}
    assert tensors.keys() == {f"model.{k}" for k in model.state_dict()}
    for key, value in model.state_dict().items():
        assert torch.equal(tensors[f"model.{key}"], value)
    assert set(split_dims.values()) == {None}


def test_which_checkpoint_a_path_means(tmp_path):
    tensors, common = _tensors(), _common()
    for iteration in (1, 2):
        offline.write_checkpoint(tmp_path / "run", iteration, tensors, common)
    root = tmp_path / "run"
    (root / TRACKER).write_text("1")
    assert offline.resolve(root)[1].iteration == 1  # the tracker's, not the newest
    assert offline.resolve(root, 2)[0] == str(root / "iter_0000002")
    assert offline.resolve(root / "iter_0000002")[1].iteration == 2
    with pytest.raises(CheckpointError, match="applies to the directory above"):
        offline.resolve(root / "iter_0000002", 1)
    with pytest.raises(CheckpointError, match="does not exist; checkpoints under"):
        offline.resolve(root, 9)
    (root / TRACKER).write_text("8")
    with pytest.raises(CorruptCheckpointError, match="names iter_0000008, which does not exist"):
        offline.resolve(root)

    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        offline.resolve(tmp_path / "empty")
    (tmp_path / "only-partial" / "iter_0000003").mkdir(parents=True)
    with pytest.raises(CorruptCheckpointError, match="no committed checkpoint"):
        offline.resolve(tmp_path / "only-partial")


def test_failed_or_refused_writes_leave_nothing(tmp_path):
    tensors, common = _tensors(), _common()
    root = tmp_path / "run"
    offline.write_checkpoint(root, 1, tensors, common, format="torch")
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(CheckpointError, match="exists already"):
        offline.write_checkpoint(root, 1, tensors, common)

    def crash(phase: str, done: int, total: int) -> None:
        raise RuntimeError("disk pulled out")

    with pytest.raises(RuntimeError, match="disk pulled out"):
        offline.write_checkpoint(root, 2, tensors, common, format="torch", progress=crash)
    assert sorted(p.name for p in root.iterdir()) == before  # no iter_0000002, no temporary directory
    assert (root / TRACKER).read_text() == "1"


def test_release_holds_weights_only(tmp_path):
    offline.write_checkpoint(tmp_path / "out", None, _tensors(), _common(), release=True, config={"width": 4})
    assert (tmp_path / "out" / TRACKER).read_text() == "release"
    full = offline.read_full(tmp_path / "out")
    assert full.metadata.release and full.metadata.config == {"width": 4}
    assert all(key.startswith("model.") for key in full.tensors)
    assert "optimizer_param_groups" not in full.common and full.common["extra"] == {"consumed_samples": 64}


def test_sources_are_never_destinations_local_or_s3(tmp_path):
    checkpoint = tmp_path / "run" / "iter_0000003"
    checkpoint.mkdir(parents=True)
    (tmp_path / "alias").symlink_to(tmp_path / "run")
    for dst in (tmp_path / "run", tmp_path / "alias", checkpoint / "inner", f"{tmp_path}/run/"):
        with pytest.raises(CheckpointError, match="is the source's directory"):
            offline.refuse_writing_into_source(str(checkpoint), dst)
    offline.refuse_writing_into_source(str(checkpoint), tmp_path / "elsewhere")
    remote = "s3://bucket/runs/gpt/iter_0000003"
    for dst in ("s3://bucket/runs/gpt", "s3://bucket/runs/gpt/", f"{remote}/x"):
        with pytest.raises(CheckpointError, match="is the source's directory"):
            offline.refuse_writing_into_source(remote, dst)
    offline.refuse_writing_into_source(remote, "s3://bucket/runs/gpt-copy")
    offline.refuse_writing_into_source(remote, tmp_path / "runs" / "gpt")  # a local copy of a remote run


def test_local_path_is_deprecated_and_accepts_urls(tmp_path):
    with pytest.warns(DeprecationWarning, match="open_storage"):
        assert offline.local_path("s3://bucket/run/") == "s3://bucket/run"
    with pytest.warns(DeprecationWarning):
        assert offline.local_path(tmp_path / "x" / "..") == str(tmp_path)
