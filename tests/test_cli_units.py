"""Pieces of the subcommands that need no checkpoint on disk: comparisons, export checks, errors."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from shardpoint import cli
from shardpoint.commands import _hf
from shardpoint.commands.convert import parse_split_dim
from shardpoint.commands.diff import compare
from shardpoint.commands.export import model_tensors, write_safetensors


def test_compare_reports_keys_shapes_and_differences():
    a = {"x": torch.tensor([1.0, math.nan, 3.0]), "y": torch.zeros(2), "only_a": torch.ones(1)}
    b = {"x": torch.tensor([1.0, math.nan, 3.25]), "y": torch.zeros(3), "only_b": torch.ones(1)}
    report = compare(a, b)
    assert report["only_in_a"] == ["only_a"] and report["only_in_b"] == ["only_b"]
    changed = {c["key"]: c for c in report["changed"]}
    assert changed["x"]["max_abs_diff"] == 0.25  # NaN == NaN; the 3.0 -> 3.25 change is found
    assert changed["y"]["reason"] == "(2,) float32 -> (3,) float32"
    assert [c["key"] for c in compare(a, b, atol=0.25)["changed"]] == ["y"]
    nan_one_side = compare({"z": torch.tensor([math.nan])}, {"z": torch.tensor([0.0])}, atol=1e9)
    assert [c["key"] for c in nan_one_side["changed"]] == ["z"]
    with pytest.raises(ValueError):
        compare(a, b, atol=-1)


def test_export_casts_floats_only_and_validates_safetensors_names(tmp_path):
    tensors = {
        "model.w": torch.ones(2, dtype=torch.float32),
        "model.n": torch.arange(3),
        "optimizer.state.w.m": torch.ones(2),
    }
    cast = model_tensors(tensors, torch.bfloat16, "here")
    assert cast.keys() == {"model.w", "model.n"}
    assert cast["model.w"].dtype == torch.bfloat16 and cast["model.n"].dtype == torch.int64

    with pytest.raises(ValueError, match="reserved"):
        write_safetensors({"model.__metadata__": torch.ones(1)}, str(tmp_path / "a.safetensors"), {})
    with pytest.raises(ValueError, match="strings to strings"):
        write_safetensors({"model.w": torch.ones(1)}, str(tmp_path / "b.safetensors"), {"step": 3})
    assert not list(tmp_path.iterdir())  # nothing written, not even a temporary file
    path = write_safetensors({"model.w": torch.ones(1)}, str(tmp_path) + "/", {"k": "v"})
    assert path == str(tmp_path / "model.safetensors")


def test_split_dim_option_parsing():
    assert parse_split_dim("*fc1.weight=0") == ("*fc1.weight", 0)
    assert parse_split_dim("*norm*=none") == ("*norm*", None)
    for bad in ("nodim", "=1", "x=-1", "x=a"):
        with pytest.raises(Exception, match="PATTERN=DIM|DIM must"):
            parse_split_dim(bad)


def test_missing_hf_bridge_is_one_sentence(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, _hf.MODULE, None)  # import now fails as if the module were absent
    code = cli.main(["export", str(tmp_path), "--to", "hf", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: Hugging Face conversion is not available") and "\n" not in err
    # --from-hf is now --from hf (shardpoint.foreign.hf_import): a directory without config.json is named
    code = cli.main(["convert", "--from-hf", str(tmp_path), str(tmp_path / "out")])
    assert code == 1 and "config.json is missing" in capsys.readouterr().err
