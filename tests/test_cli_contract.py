"""What scripts may rely on from the ``shardpoint`` CLI (issue 57, item 6).

Exit codes 0 fine / 1 damage found / 2 usage error or a path that is not a checkpoint;
with ``--json`` errors are JSON on stdout too, and every JSON document carries
``schema_version``; ``--help``/``--version`` import no torch; ``prune --keep-every``
alone; ``inspect`` lists a truncated checkpoint as damaged; ``verify``/``diff``/``prune``
name another tool's checkpoint and the command that reads it. Commands run in this
process (``main``) on a one-process checkpoint, so each test takes well under a second.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardpoint as sp
from shardpoint.cli import main
from shardpoint.foreign.hf_files import write_hf_dir

FOREIGN = Path(__file__).parent / "fixtures" / "foreign"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A save directory with iterations 1, 2, 3 (the tracker names 3)."""
    model = torch.nn.Linear(8, 4)
    ckpt = sp.Checkpointer(tmp_path / "run", save_interval=1)
    for iteration in (1, 2, 3):
        ckpt.save(iteration, sp.TrainState(model=model))
    ckpt.close()
    return tmp_path / "run"


def _cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _data_file(checkpoint: Path) -> Path:
    return next(p for p in checkpoint.iterdir() if p.suffix == ".distcp")


def test_exit_codes_fine_damaged_and_not_a_checkpoint(run_dir, tmp_path, capsys):
    assert _cli(capsys, "verify", run_dir)[0] == 0
    assert _cli(capsys, "inspect", run_dir)[0] == 0
    data = _data_file(run_dir / "iter_0000003")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert _cli(capsys, "verify", run_dir)[0] == 1  # damage found
    for argv in (
        ("verify", tmp_path / "missing"),
        ("inspect", tmp_path / "missing"),
        ("diff", run_dir / "iter_0000001", tmp_path),
    ):
        code, _, err = _cli(capsys, *argv)
        assert code == 2, (argv, err)  # a path that is not a checkpoint: nothing damaged, the path is wrong
    (tmp_path / "file.txt").write_text("x")
    assert _cli(capsys, "verify", tmp_path / "file.txt")[0] == 2
    assert _cli(capsys, "verify", run_dir, "--iteration", 7)[0] == 2
    assert _cli(capsys, "verify", run_dir, "--no-such-flag")[0] == 2


def test_json_errors_are_json_on_stdout(tmp_path, capsys):
    code, out, err = _cli(capsys, "verify", tmp_path / "missing", "--json")
    doc = json.loads(out)
    assert code == 2 and doc["exit_code"] == 2 and doc["ok"] is False and doc["schema_version"] == 1
    assert doc["error"]["type"] == "NotACheckpointError" and "does not exist" in doc["error"]["message"]
    assert "does not exist" in err  # people still read stderr

    code, out, _ = _cli(capsys, "prune", tmp_path, "--keep-last", "0", "--json")
    assert code == 2 and json.loads(out)["error"]["message"] == "--keep-last must be at least 1, got 0"

    code, out, _ = _cli(capsys, "inspect", tmp_path, "--json", "--bogus")
    assert code == 2 and json.loads(out)["error"]["type"] == "UsageError"


def test_every_json_document_has_a_schema_version(run_dir, tmp_path, capsys):
    for argv in (
        ("inspect", run_dir),
        ("inspect", run_dir / "iter_0000002"),
        ("verify", run_dir),
        ("prune", run_dir, "--keep-last", 1, "--dry-run"),
        ("diff", run_dir / "iter_0000001", run_dir / "iter_0000002"),
    ):
        code, out, _ = _cli(capsys, *argv, "--json")
        assert code == 0 and json.loads(out)["schema_version"] == 1, argv


def test_help_and_version_do_not_import_torch():
    probe = (
        "import sys, time; t = time.perf_counter(); from shardpoint.cli import main\n"
        "for argv in (['--version'], ['--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(time.perf_counter() - t, file=sys.stderr)"
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "shardpoint" in done.stdout and "verify" in done.stdout and "exit codes:" in done.stdout
    print(f"--version and --help: {time.perf_counter() - started:.2f} s in a fresh interpreter")


def test_prune_keep_every_alone(run_dir, capsys):
    code, out, _ = _cli(capsys, "prune", run_dir, "--keep-every", 2, "--json")
    report = json.loads(out)
    assert code == 0
    assert [r["name"] for r in report["checkpoints"] if r["delete"]] == ["iter_0000001"]  # 2 kept, 3 tracked
    assert sorted(p.name for p in run_dir.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    code, _, err = _cli(capsys, "prune", run_dir)
    assert code == 2 and "--keep-last" in err and "keep_last" not in err


def test_inspect_lists_a_truncated_checkpoint_as_damaged(run_dir, capsys):
    data = _data_file(run_dir / "iter_0000002")
    with open(data, "r+b") as f:
        f.truncate(10)
    code, out, _ = _cli(capsys, "inspect", run_dir, "--json")
    rows = {r["name"]: r for r in json.loads(out)["checkpoints"]}
    assert code == 1
    assert rows["iter_0000002"]["damaged"] and data.name in rows["iter_0000002"]["damaged"][0]
    assert not rows["iter_0000001"]["damaged"] and not rows["iter_0000003"]["damaged"]
    code, out, _ = _cli(capsys, "inspect", run_dir)
    assert code == 1 and "DAMAGED" in out and "truncated" in out


@pytest.mark.parametrize(
    ("fixture", "tool"),
    [("megatron-legacy-tp1", "--from megatron"), ("deepspeed-zero1-dp2", "--from deepspeed"), ("hf", "--from hf")],
)
def test_other_tools_checkpoints_are_named_with_what_to_run(fixture, tool, run_dir, tmp_path, capsys):
    if fixture == "hf":
        path = tmp_path / "hf"
        path.mkdir()
        (path / "config.json").write_text('{"model_type": "gpt2"}')
        save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    else:  # a copy: prune may take its writer lock there, which other tests reading the fixture must not see
        path = tmp_path / fixture
        shutil.copytree(FOREIGN / fixture / "ckpt", path)
    before = sorted(p.name for p in path.rglob("*"))
    for argv in (("verify", path), ("diff", path, run_dir), ("prune", path, "--keep-last", 1)):
        code, _, err = _cli(capsys, *argv)
        assert code == 2, (argv, err)
        assert f"convert {tool} {path}" in err and "PARTIAL" not in err and "tracker" not in err, err
    assert sorted(p.name for p in path.rglob("*")) == before  # nothing pruned


def test_help_texts_show_no_rst_markup(capsys):
    for command in ("demo", "inspect", "verify", "convert", "export", "prune", "diff", "bench"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        out = capsys.readouterr().out
        assert exit_info.value.code == 0 and out
        for markup in ("``", ":mod:`", ":class:`", ":func:`", ":meth:`"):
            assert markup not in out, (command, markup)


def test_demo_without_matplotlib_skips_the_plot_and_names_the_extra(tmp_path, monkeypatch, caplog):
    from shardpoint.demo.report import plot_losses

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the demo extra were not installed
    plot_losses([], {1: 1.0, 2: 0.5}, str(tmp_path / "loss.png"))
    assert not (tmp_path / "loss.png").exists()
    assert "pip install 'shardpoint[demo]'" in caplog.text


def test_exported_safetensors_get_the_permissions_the_umask_gives(run_dir, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        out = tmp_path / "out" / "model.safetensors"
        assert _cli(capsys, "export", run_dir, "--to", "safetensors", out)[0] == 0
        hf = tmp_path / "hf"
        write_hf_dir(hf, {"config": 1}, {"w": torch.zeros(2)})
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # safetensors alone writes 0600
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in hf.iterdir())


@pytest.mark.parametrize(("integration", "framework"), [("transformers", "transformers"), ("torchtitan", "torchtitan")])
def test_an_integration_without_its_framework_names_its_extra(integration, framework, monkeypatch):
    import importlib

    monkeypatch.delitem(sys.modules, f"shardpoint.integrations.{integration}", raising=False)
    for name in [framework, *(m for m in sys.modules if m.startswith(framework + "."))]:
        monkeypatch.setitem(sys.modules, name, None)  # as if the framework were not installed (submodules too)
    with pytest.raises(ModuleNotFoundError, match=rf"pip install 'shardpoint\[{integration}\]'") as info:
        importlib.import_module(f"shardpoint.integrations.{integration}")
    assert isinstance(info.value, sp.CheckpointError) and info.value.name == framework
