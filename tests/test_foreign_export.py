"""Export to Megatron-LM's legacy format at another layout, compared with files Megatron-LM wrote."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardpoint.errors import TopologyMismatchError
from shardpoint.foreign import import_checkpoint, read_foreign
from shardpoint.foreign._unpickle import load_foreign
from shardpoint.foreign.exporter import export_megatron, from_shardpoint
from tests.test_foreign_import import FIXTURES, MOMENTS, params_of, truth

STEP = "iter_0000002"


def rank_file(root: Path, folder: str, name: str = "model_optim_rng.pt") -> dict:
    return load_foreign(Path(root) / STEP / folder / name)


def assert_same(a, b, path="") -> None:
    """Deep equality: same keys in the same order, same types, bit-identical tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)[:5]} vs {list(b)[:5]}"
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, argparse.Namespace):
        assert isinstance(b, argparse.Namespace), path
        assert_same(vars(a), vars(b), path)
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


REAL_TP1 = FIXTURES / "megatron-legacy-tp1" / "ckpt"


@pytest.mark.parametrize("source", ["megatron-legacy-tp2", "megatron-torchdist-tp2"])
def test_tp2_to_tp1_equals_the_checkpoint_megatron_wrote_at_tp1(source, tmp_path):
    export_megatron(read_foreign(FIXTURES / source / "ckpt"), tmp_path, tp=1, pp=1)
    mine, real = rank_file(tmp_path, "mp_rank_00"), rank_file(REAL_TP1, "mp_rank_00")
    assert list(mine) == list(real)[: len(mine)]
    for key in ("args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler"):
        assert_same(mine[key], real[key], key)  # args: tp=1 and world size 1, still a Namespace
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_distributed_optimizer_tp2_dp2_to_tp1_keeps_every_moment(tmp_path):
    source = FIXTURES / "megatron-legacy-tp2-dp2-distopt" / "ckpt"
    import_checkpoint(source, tmp_path / "dist")  # through shardpoint's dist format
    export_megatron(from_shardpoint(str(tmp_path / "dist")), tmp_path / "tp1", tp=1, pp=1)
    mine, real = rank_file(tmp_path / "tp1", "mp_rank_00"), rank_file(REAL_TP1, "mp_rank_00")
    assert_same(mine["model"], real["model"], "model")
    assert_same(mine["optimizer"], real["optimizer"], "optimizer")  # 53 parameters x (step, exp_avg, exp_avg_sq)
    assert mine["args"].tensor_model_parallel_size == 1 and not mine["args"].use_distributed_optimizer


def test_tp1_to_tp2_dp2_distributed_optimizer_equals_megatrons_files(tmp_path):
    export_megatron(read_foreign(REAL_TP1), tmp_path, tp=2, pp=1, dp=2, distributed_optimizer=True)
    real_root = FIXTURES / "megatron-legacy-tp2-dp2-distopt" / "ckpt"
    for folder in ("mp_rank_00", "mp_rank_01"):
        assert_same(rank_file(tmp_path, folder, "distrib_optim.pt"), rank_file(real_root, folder, "distrib_optim.pt"))
        mine, real = rank_file(tmp_path, folder), rank_file(real_root, folder)
        assert_same(mine["model"], real["model"], "model")
        assert_same(mine["optimizer"], real["optimizer"], "optimizer")
        differing = {k for k in vars(real["args"]) if getattr(mine["args"], k) != getattr(real["args"], k)}
        assert differing == {"global_batch_size"}  # a training choice of that run, left as the source had it


@pytest.mark.parametrize("layout", [(2, 2, 1, False), (1, 4, 2, True), (4, 1, 1, False)])
def test_round_trips_through_another_layout_are_exact(layout, tmp_path):
    tp, pp, dp, distopt = layout
    export_megatron(
        read_foreign(FIXTURES / "megatron-legacy-tp2" / "ckpt"),
        tmp_path,
        tp=tp,
        pp=pp,
        dp=dp,
        distributed_optimizer=distopt,
    )
    folders = sorted(p.name for p in (tmp_path / STEP).iterdir())
    assert len(folders) == tp * pp and (pp == 1 or folders[-1] == f"mp_rank_{tp - 1:02d}_{pp - 1:03d}")
    if pp > 1:  # layer numbers restart on each stage, as Megatron writes them
        last = rank_file(tmp_path, folders[-1])["model"]
        assert "decoder.layers.0.mlp.linear_fc1.weight" in last and "output_layer.weight" in last
    back = read_foreign(tmp_path)
    t = truth("megatron-legacy-tp2")
    rows = 256 if tp == 4 else 128  # the vocabulary (128) padded to a multiple of 64 * tp
    assert back.params["embedding.word_embeddings.weight"].shape[0] == rows
    for name in params_of(t):
        got = {"": back.params[name], **{f".{m}": back.optimizer[name][m] for m in MOMENTS}}
        for suffix, value in got.items():
            assert torch.equal(value[: t[name + suffix].shape[0]], t[name + suffix]), name + suffix
            if value.shape[0] > 128 and "word_embeddings" in name:  # new padding rows: last row / zero moments
                fill = t[name][-1] if not suffix else torch.zeros(64)
                assert torch.equal(value[128:], fill.expand(rows - 128, 64)), name + suffix


def test_a_reshape_that_cannot_be_exact_names_the_tensor(tmp_path):
    with pytest.raises(TopologyMismatchError, match=r"linear_qkv\.weight.*query groups"):
        export_megatron(read_foreign(REAL_TP1), tmp_path, tp=8, pp=1)  # 4 query groups over 8 ranks
    with pytest.raises(TopologyMismatchError, match="layers do not divide"):
        export_megatron(read_foreign(REAL_TP1), tmp_path, tp=1, pp=3)
    assert not (tmp_path / STEP).exists()


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardpoint.cli", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def test_cli_imports_and_exports_with_real_subprocesses(tmp_path):
    imported = run_cli(
        "convert", "--from", "auto", FIXTURES / "megatron-legacy-tp2" / "ckpt", tmp_path / "dist", "--json"
    )
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout)["iteration"] == 2
    verified = run_cli("verify", tmp_path / "dist")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    exported = run_cli("convert", "--to", "megatron", tmp_path / "dist", tmp_path / "tp1", "--tp", 1, "--pp", 1)
    assert exported.returncode == 0, exported.stderr
    assert "wrote Megatron-LM checkpoint" in exported.stdout
    assert_same(rank_file(tmp_path / "tp1", "mp_rank_00")["model"], rank_file(REAL_TP1, "mp_rank_00")["model"])
    wrong = run_cli("convert", "--from", "deepspeed", FIXTURES / "megatron-legacy-tp1" / "ckpt", tmp_path / "x")
    assert wrong.returncode != 0 and "not deepspeed" in wrong.stderr


def test_export_never_rewinds_a_newer_run_in_the_target(tmp_path):
    from shardpoint.errors import CheckpointError

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("500")  # another run, further along
    with pytest.raises(CheckpointError, match="rewind"):
        export_megatron(read_foreign(FIXTURES / "megatron-legacy-tp2" / "ckpt"), tmp_path, tp=1, pp=1)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "500"
    assert not (tmp_path / STEP).exists()
