"""The ``shardpoint`` subcommands on real checkpoints, each run as its own process.

One module-scoped fixture trains the toy model on 8 gloo ranks (tp=2, pp=2, dp=2,
ZeRO optimizer) and saves iterations 1-3 in both formats; every test reads it or
works on a copy. Commands run in a separate process with stdout and stderr going to
files (not a terminal), and their exit codes are checked. Most are forked from a
server that has torch imported already (``run_cli``: a fresh process costs ~3 s of
imports on 2 cores); a few go through ``python -m shardpoint.cli`` (``run_module``)
to cover the real entry point.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint import offline
from tests import toy
from tests.distributed import _CTX, launch

CONFIG = {"num_layers": toy.LAYERS, "hidden_size": toy.HIDDEN}
TRACKER = "latest_checkpointed_iteration.txt"
CRASHED = 99  # exit code of a command that died with a traceback


# ----------------------------------------------------------------- running commands


@dataclass
class CliResult:
    rc: int
    out: str
    err: str

    def json(self) -> dict:
        return json.loads(self.out)

    def one_line_error(self) -> str:
        """The error of a failed command: exactly one line on stderr, no traceback."""
        lines = [line for line in self.err.splitlines() if not line.startswith(("INFO ", "WARNING "))]
        assert "Traceback" not in self.err, self.err
        assert len(lines) == 1 and lines[0].startswith("error: "), self.err
        return lines[0]


def _cli_child(argv: list[str], out_path: str, err_path: str) -> None:
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.environ.pop("COLUMNS", None)
    code = CRASHED
    try:
        from shardpoint import cli

        code = cli.main(argv)
    except SystemExit as exc:  # argparse: --help and usage errors
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:  # noqa: BLE001 - a crash must show as a traceback and exit CRASHED
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_cli(*args: object) -> CliResult:
    """``shardpoint ARGS`` in a new process forked from a pre-imported server."""
    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = _CTX.Process(target=_cli_child, args=(argv, out, err))
        proc.start()
        proc.join(120)
        return CliResult(proc.exitcode, Path(out).read_text(), Path(err).read_text())


def run_module(*args: object) -> CliResult:
    """``python -m shardpoint.cli ARGS``: the real entry point, in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run(
        [sys.executable, "-m", "shardpoint.cli", *map(str, args)], capture_output=True, text=True, env=env, timeout=120
    )
    return CliResult(done.returncode, done.stdout, done.stderr)


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its bytes: equal before and after means untouched."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ----------------------------------------------------------------- the checkpoints


def _train_and_save(rank: int, world: int, root: str) -> dict:
    topo = sp.Topology(2, 2, 2)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=True)
    savers = [sp.Checkpointer(f"{root}/{fmt}", topology=topo, format=fmt, config=CONFIG) for fmt in ("torch", "dist")]
    for step in range(1, 4):
        toy.train_step(state, step)
        for saver in savers:
            saver.save(step, state)
    for saver in savers:
        saver.close()
    return toy.snapshot(state)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("runs")
    snapshots = launch(_train_and_save, 8, str(root))
    return {"torch": root / "torch", "dist": root / "dist", "full": toy.assemble(snapshots)}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _assert_equal_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def _load_single_process(root: Path, *, zero: bool = True) -> tuple[sp.LoadResult, dict[str, torch.Tensor]]:
    topo = sp.Topology(1, 1, 1)
    state = toy.build(topo, zero=zero)
    ckpt = sp.Checkpointer(str(root), topology=topo, config=CONFIG)
    result = ckpt.load(state)
    ckpt.close()
    return result, toy.assemble([toy.snapshot(state)])


# ----------------------------------------------------------------- inspect


def test_inspect_lists_checkpoints_and_the_tracker(runs):
    listing = run_cli("inspect", runs["torch"], "--json")
    assert listing.rc == 0, listing.err
    report = listing.json()
    rows = report["checkpoints"]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(r["committed"] and r["format"] == "torch" for r in rows)
    assert [r["tracked"] for r in rows] == [False, False, True]
    assert rows[0]["topology"] == {"tp": 2, "pp": 2, "dp": 2} and rows[0]["bytes"] > 0
    assert report["tracker"]["names"] == "iter_0000003" and report["tracker"]["problem"] is None

    human = run_cli("inspect", runs["dist"])
    assert human.rc == 0, human.err
    line = next(ln for ln in human.out.splitlines() if ln.startswith("iter_0000003"))
    assert "dist" in line and "2/2/2" in line and "committed" in line and "<- tracker" in line
    assert "<- tracker" not in next(ln for ln in human.out.splitlines() if ln.startswith("iter_0000002"))


def test_inspect_one_checkpoint_with_tensors(runs):
    result = run_cli("inspect", runs["dist"], "--iteration", 2, "--tensors", "--json")
    assert result.rc == 0, result.err
    report = result.json()
    assert report["metadata"]["iteration"] == 2 and report["metadata"]["config"] == CONFIG
    assert report["state"]["extra"] == {"consumed_samples": 16}
    assert report["state"]["scheduler"]["last_epoch"] == 2
    tensors = {t["key"]: t for t in report["tensors"]}
    assert len(tensors) == len(runs["full"])
    row = tensors["model.layers.0.fc2.weight"]  # row-parallel: split along dim 1 over tp=2
    assert (row["shape"], row["dtype"], row["bytes"], row["split_dims"], row["pieces"]) == (
        [8, 32],
        "float32",
        8 * 32 * 4,
        [1],
        2,
    )
    assert tensors["model.layers.0.norm.weight"]["pieces"] == 1  # replicated: saved once

    human = run_cli("inspect", runs["torch"] / "iter_0000003", "--tensors")
    assert human.rc == 0, human.err
    row = next(ln for ln in human.out.splitlines() if ln.startswith("model.layers.0.fc1.weight "))
    assert row.split()[1:] == ["32x8", "float32", "1.0", "KiB", "2", "pieces", "along", "dim", "0"]
    assert "consumed_samples" in human.out and "num_layers" in human.out


def test_inspect_explains_what_is_not_a_checkpoint(tmp_path, runs):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("hello")
    result = run_module("inspect", plain)
    assert result.rc == 2 and "is not a checkpoint" in result.one_line_error()

    partial = _copy(runs["dist"] / "iter_0000001", tmp_path / "iter_0000001")
    (partial / "shardpoint.json").unlink()
    result = run_cli("inspect", partial)
    assert result.rc == 1 and "not a committed checkpoint" in result.one_line_error()

    broken = _copy(runs["dist"] / "iter_0000002", tmp_path / "iter_0000002")
    (broken / "shardpoint.json").write_text('{"iteration": 2, ')
    result = run_cli("inspect", broken)
    assert result.rc == 1 and "not valid JSON" in result.one_line_error()

    result = run_cli("inspect", tmp_path / "missing")
    assert result.rc == 2 and "does not exist" in result.one_line_error()


# ----------------------------------------------------------------- verify


def test_verify_passes_intact_checkpoints(runs):
    result = run_cli("verify", runs["torch"], "--all", "--json")
    assert result.rc == 0, result.out + result.err
    report = result.json()
    assert report["ok"] and [c["name"] for c in report["checkpoints"]] == [
        "iter_0000001",
        "iter_0000002",
        "iter_0000003",
    ]
    # per model-parallel rank (tp2 pp2): the main file and one file per dp rank (dp2) of its own optimizer slices
    assert all(c["ok"] and c["files"] == 4 * (1 + 2) for c in report["checkpoints"])


def test_verify_names_every_damaged_file(tmp_path, runs):
    root = _copy(runs["dist"], tmp_path / "run")
    flipped = root / "iter_0000003" / "__3_0.distcp"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated = root / "iter_0000002" / "common.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    (root / "iter_0000001" / "rng" / "rank_00005.pt").unlink()
    (root / "iter_0000003" / "stray.bin").write_bytes(b"x")
    (root / "iter_0000004").mkdir()  # a save that never committed

    result = run_module("verify", root, "--all")
    assert result.rc == 1, result.out + result.err
    assert "BAD iter_0000003/__3_0.distcp: checksum mismatch" in result.out
    assert "BAD iter_0000002/common.pt: size 100 bytes" in result.out
    assert "BAD iter_0000001/rng/rank_00005.pt: missing" in result.out
    assert "UNRECORDED iter_0000003/stray.bin" in result.out
    assert "iter_0000004" in result.out and "not a committed checkpoint" in result.out

    (root / TRACKER).write_text("9")
    report = run_cli("verify", root, "--iteration", 3, "--json")
    assert report.rc == 1
    data = report.json()
    assert not data["ok"] and data["tracker"]["problem"] == "names iter_0000009, which does not exist"
    (checkpoint,) = data["checkpoints"]
    assert checkpoint["problems"] == [
        {"file": "__3_0.distcp", "problem": "checksum mismatch (the contents changed after saving)"}
    ]
    assert checkpoint["unrecorded"] == ["stray.bin"]


# ----------------------------------------------------------------- prune


def test_prune_dry_run_then_prune_keeps_the_tracker_target(tmp_path, runs):
    root = _copy(runs["torch"], tmp_path / "run")
    (root / TRACKER).write_text("1")  # the tracker points at the oldest: it must survive
    _copy(root / "iter_0000002", root / "release")
    (root / ".shardpoint-tmp-iter_0000004-0badc0de").mkdir()
    before = tree_digest(root)

    dry = run_cli("prune", root, "--keep-last", 1, "--dry-run", "--json")
    assert dry.rc == 0, dry.err
    plan = {r["name"]: (r["delete"], r["kept_by"]) for r in dry.json()["checkpoints"]}
    assert plan == {
        "iter_0000001": (False, "tracker"),
        "iter_0000002": (True, None),
        "iter_0000003": (False, "retention"),
    }
    assert dry.json()["leftovers"] == [".shardpoint-tmp-iter_0000004-0badc0de"]
    assert tree_digest(root) == before and (root / ".shardpoint-tmp-iter_0000004-0badc0de").is_dir()

    done = run_cli("prune", root, "--keep-last", 1)
    assert done.rc == 0, done.err
    assert "deleted 1 checkpoint(s)" in done.out
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".shardpoint.lock")) == [
        "iter_0000001",
        "iter_0000003",
        TRACKER,
        "release",
    ]
    assert (root / TRACKER).read_text() == "1"


# ----------------------------------------------------------------- diff


def test_diff_across_formats_and_a_changed_tensor(tmp_path, runs):
    same = run_cli("diff", runs["torch"], runs["dist"])
    assert same.rc == 0, same.out + same.err
    assert f"{len(runs['full'])} tensors identical" in same.out

    full = offline.read_full(runs["dist"])
    full.tensors["model.layers.1.fc1.bias"][3] += 0.5
    del full.tensors["optimizer.state.layers.2.norm.weight.exp_avg"]
    offline.write_checkpoint(
        tmp_path / "changed", 3, full.tensors, full.common, 2, 2, "dist", split_dims=full.split_dims
    )
    result = run_cli("diff", runs["torch"], tmp_path / "changed", "--json")
    assert result.rc == 1
    report = result.json()
    assert not report["identical"]
    assert [(c["key"], c["max_abs_diff"]) for c in report["changed"]] == [("model.layers.1.fc1.bias", 0.5)]
    assert report["only_in_a"] == ["optimizer.state.layers.2.norm.weight.exp_avg"] and report["only_in_b"] == []
    assert run_cli("diff", runs["torch"], tmp_path / "changed", "--atol", 0.5, "-q").rc == 1  # key still missing


# ----------------------------------------------------------------- convert


def test_convert_torch_tp2_pp2_to_tp1_loads_with_identical_tensors(tmp_path, runs):
    before = tree_digest(runs["torch"])
    result = run_cli("convert", runs["torch"], tmp_path / "tp1", "--tp", 1, "--pp", 1)
    assert result.rc == 0, result.err
    assert "RNG states were not converted" in result.err
    assert sorted(p.name for p in (tmp_path / "tp1" / "iter_0000003").iterdir()) == ["mp_rank_00", "shardpoint.json"]
    loaded, full = _load_single_process(tmp_path / "tp1")
    assert loaded.iteration == 3 and loaded.extra == {"consumed_samples": 24}
    _assert_equal_tensors(full, runs["full"])
    assert tree_digest(runs["torch"]) == before


def test_convert_round_trip_torch_dist_torch_is_lossless(tmp_path, runs):
    before = tree_digest(runs["torch"])
    to_dist = run_cli("convert", runs["torch"], tmp_path / "dist", "--format", "dist", "--layout", "neox", "--json")
    assert to_dist.rc == 0, to_dist.err
    assert to_dist.json()["destination"] == str(tmp_path / "dist" / "global_step3")
    assert (tmp_path / "dist" / "latest").read_text() == "global_step3"
    back = run_cli("convert", tmp_path / "dist", tmp_path / "torch", "--format", "torch", "--layout", "megatron")
    assert back.rc == 0, back.err
    assert tree_digest(runs["torch"]) == before

    original, final = runs["torch"] / "iter_0000003", tmp_path / "torch" / "iter_0000003"
    for folder in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        want = torch.load(original / folder / "model_optim_rng.pt", weights_only=True)
        got = torch.load(final / folder / "model_optim_rng.pt", weights_only=True)
        assert got["sharding"] == want["sharding"], folder  # same keys on the same stages, same tp boxes
        assert got["model"].keys() == want["model"].keys()
        for key in want["model"]:
            assert torch.equal(got["model"][key], want["model"][key]), (folder, key)
    _assert_equal_tensors(offline.read_full(final).tensors, runs["full"])
    assert run_cli("diff", runs["torch"], tmp_path / "torch", "-q").rc == 0


def test_convert_refuses_its_source_and_damaged_input(tmp_path, runs):
    result = run_cli("convert", runs["torch"], runs["torch"], "--tp", 1, "--pp", 1)
    assert result.rc == 1 and "is the source's directory" in result.one_line_error()

    damaged = _copy(runs["torch"], tmp_path / "damaged")
    victim = damaged / "iter_0000003" / "mp_rank_01_001" / "dp_rank_0001.pt"
    victim.write_bytes(victim.read_bytes()[:-10])
    result = run_cli("convert", damaged, tmp_path / "out", "--tp", 1, "--pp", 1)
    assert result.rc == 1
    assert "mp_rank_01_001/dp_rank_0001.pt: size" in result.one_line_error()
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------- export


def test_export_safetensors_holds_the_full_model(tmp_path, runs):
    from safetensors import safe_open
    from safetensors.torch import load_file

    result = run_cli("export", runs["torch"], "--to", "safetensors", tmp_path / "model.safetensors")
    assert result.rc == 0, result.err
    exported = load_file(tmp_path / "model.safetensors")
    want = {k.removeprefix("model."): t for k, t in runs["full"].items() if k.startswith("model.")}
    _assert_equal_tensors(exported, want)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata()["shardpoint.iteration"] == "3"
        assert json.loads(f.metadata()["shardpoint.config"]) == CONFIG


def test_export_release_loads_in_finetune_mode(tmp_path, runs):
    result = run_cli("export", runs["dist"], "--to", "release", tmp_path / "release-run", "--dtype", "fp32")
    assert result.rc == 0, result.err
    assert (tmp_path / "release-run" / TRACKER).read_text() == "release"
    loaded, full = _load_single_process(tmp_path / "release-run", zero=False)
    assert loaded.release and loaded.finetune and loaded.iteration == 0
    model = {k: t for k, t in full.items() if k.startswith("model.")}
    _assert_equal_tensors(model, {k: t for k, t in runs["full"].items() if k.startswith("model.")})


# ----------------------------------------------------------------- usage


def test_every_subcommand_has_help():
    for name in ("inspect", "verify", "convert", "export", "prune", "diff"):
        result = run_cli(name, "--help")
        assert result.rc == 0 and result.out.startswith(f"usage: shardpoint {name}"), (name, result.err)
        assert "--json" in result.out and "examples:" in result.out


def test_usage_errors_exit_2(runs):
    assert run_cli("prune", runs["torch"], "--keep-last", 0, "--dry-run").rc == 2
    assert run_cli("convert", runs["torch"], "/tmp/x", "--split-dim", "no-equals-sign").rc == 2
    assert run_cli("verify", runs["torch"], "--all", "--iteration", 1).rc == 2
    assert run_cli("export", runs["torch"], "/tmp/x").rc == 2  # --to is required
