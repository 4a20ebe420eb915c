"""``shardpoint demo`` end to end, with few iterations: train, SIGTERM, resume, reshard, report."""

from __future__ import annotations

import json

import pytest

from shardpoint.cli import main


def test_demo_runs_end_to_end(tmp_path, capsys):
    directory = tmp_path / "demo"
    code = main(["demo", "--iters", "6", "--save-interval", "2", "--dir", str(directory), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0, summary["problems"]
    assert summary["problems"] == []
    names = [p["name"] for p in summary["phases"]]
    assert names == ["reference", "train (SIGTERM)", "resume", "reshard"]
    _, train, resume, reshard = summary["phases"]
    assert train["exit_codes"] == [0, 0, 0, 0]
    assert train["comparison"] == resume["comparison"] == "bit-identical"
    assert reshard["layout"] == [1, 2, 2] and max(map(int, reshard["losses"])) == 6
    stopped = max(map(int, train["losses"]))
    assert min(map(int, resume["losses"])) == stopped + 1
    assert min(map(int, reshard["losses"])) == max(map(int, resume["losses"])) + 1
    assert all(p["bytes_written"] > 0 and p["save_seconds"] > 0 for p in summary["phases"])
    assert (directory / "loss.png").stat().st_size > 10_000
    assert (directory / "run" / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_demo_refuses_a_directory_it_did_not_create(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert main(["demo", "--iters", "6", "--dir", str(tmp_path), "--quiet"]) == 1
    assert "not created by `shardpoint demo`" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_demo_help_lists_its_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--tp", "--pp", "--dp", "--iters", "--save-interval", "--dir", "--quiet", "--reshard"):
        assert flag in out
