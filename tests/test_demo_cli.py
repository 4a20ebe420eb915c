"""``shardpoint demo`` end to end, with few iterations: train, SIGTERM, resume, reshard, report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardpoint.cli import main
from shardpoint.demo.procs import run_function


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


def test_demo_refuses_an_out_directory_it_did_not_create(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "precious.txt").write_text("keep me")
    code = main(["demo", "--iters", "6", "--dir", str(tmp_path / "demo"), "--out", str(tmp_path), "--quiet"])
    assert code == 1
    assert "not created by `shardpoint demo`; pass another --out" in capsys.readouterr().err
    assert (tmp_path / "logs" / "precious.txt").read_text() == "keep me"
    assert not (tmp_path / "demo").exists()  # nothing is created before every place was checked


def _write_env(rank: int, world: int, name: str, out: str) -> None:
    Path(out).write_text(os.environ.get(name, "<unset>"))


def test_ranks_see_the_launchers_environment_as_it_is_when_they_start(tmp_path, monkeypatch):
    out = tmp_path / "seen"
    run_function(_write_env, 1, "SHARDPOINT_TEST_ENV", str(out))  # the forkserver exists from here on
    monkeypatch.setenv("SHARDPOINT_TEST_ENV", "set later")  # as AWS_* for an s3:// --dir might be
    run_function(_write_env, 1, "SHARDPOINT_TEST_ENV", str(out))
    assert out.read_text() == "set later"
