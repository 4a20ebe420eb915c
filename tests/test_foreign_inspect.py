"""``shardpoint inspect`` on Megatron-LM and DeepSpeed checkpoints, run as real processes, reading in place."""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.foreign import import_checkpoint
from tests.test_cli_commands import run_cli, tree_digest
from tests.test_foreign_import import FIXTURES, params_of, truth

# fixture, the path given, (tool, format, tp, pp, dp, optimizer sharding)
CASES = [
    ("megatron-legacy-tp2-dp2-distopt", "ckpt", ("megatron", "torch", 2, 1, 2, "distributed-optimizer")),
    ("megatron-torchdist-tp2", "ckpt/iter_0000002", ("megatron", "torch_dist", 2, 1, 1, None)),
    ("deepspeed-zero1-dp2", "ckpt", ("deepspeed", "deepspeed", 1, 1, 2, "zero-1")),
    ("deepspeed-pipe2", "ckpt/global_step2", ("deepspeed", "deepspeed", 1, 2, 1, "zero-1")),
]


@pytest.mark.parametrize(("fixture", "given", "facts"), CASES, ids=[c[0] for c in CASES])
def test_inspect_json_describes_the_checkpoint_and_every_global_tensor(fixture, given, facts):
    before = tree_digest(FIXTURES / fixture)
    result = run_cli("inspect", FIXTURES / fixture / given, "--tensors", "--json")
    assert result.rc == 0, result.err
    report = result.json()
    got = tuple(report[k] for k in ("tool", "format", "tp", "pp", "dp", "optimizer_sharding"))
    assert got == facts and report["foreign"] and report["iteration"] == 2
    t = truth(fixture)
    assert {r["key"]: r["shape"] for r in report["tensors"]} == {n: list(t[n].shape) for n in params_of(t)}
    assert all(r["optimizer_state"] == ["exp_avg", "exp_avg_sq", "step"] for r in report["tensors"])
    assert report["with_optimizer_state"] == report["parameters"] == len(params_of(t))
    assert tree_digest(FIXTURES / fixture) == before  # read in place, nothing written


def test_inspect_human_output():
    result = run_cli("inspect", FIXTURES / "megatron-legacy-tp2-dp2-distopt" / "ckpt", "--tensors")
    assert result.rc == 0, result.err
    lines = result.out.splitlines()
    for row in ("checkpoint of", "format", "iteration", "layout at save", "optimizer sharding"):
        assert any(line.startswith(row + " ") for line in lines), f"no {row!r} row in\n{result.out}"
    text = " ".join(result.out.split())
    assert "Megatron-LM, read in place" in text and "tp=2 pp=1 dp=2" in text
    assert "optimizer sharding distributed optimizer" in text and "num_layers 4" in text
    qkv = next(line for line in lines if line.startswith("decoder.layers.3.self_attention.linear_qkv.weight "))
    assert qkv.split()[1:5] == ["192x64", "float32", "48.0", "KiB"] and "dim 0" in qkv
    assert "shardpoint convert --from megatron" in text


def test_shardpoints_own_checkpoints_are_still_described_as_such(tmp_path):
    imported = import_checkpoint(FIXTURES / "megatron-legacy-tp1" / "ckpt", tmp_path / "imported")
    report = run_cli("inspect", imported, "--json")
    assert report.rc == 0 and "metadata" in report.json() and "foreign" not in report.json()
    model = torch.nn.Linear(4, 4)  # shardpoint's torch format is laid out like Megatron's: not mistaken for it
    ckpt = sp.Checkpointer(tmp_path / "torch", format="torch")
    ckpt.save(1, sp.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters())))
    ckpt.close()
    (tmp_path / "torch" / "iter_0000001" / "shardpoint.json").unlink()
    partial = run_cli("inspect", tmp_path / "torch" / "iter_0000001")
    assert partial.rc == 1 and "not a committed checkpoint" in partial.one_line_error()
