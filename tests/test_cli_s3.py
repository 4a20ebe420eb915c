"""The ``shardpoint`` subcommands and the demo on ``s3://`` paths, against a real S3 server (moto_server).

Checkpoints are made in the test: three single-process ``dist`` saves of a small
``nn.Module`` and two ``torch``-format saves by two gloo ranks at tp=2, all written
straight to the server by the Checkpointer. Commands run in their own process with
the server's AWS variables in the environment, as a user's shell would set them;
most are forked from the pre-imported server of ``tests.distributed`` (fast), the
demo through ``python -m shardpoint.cli`` (the real entry point).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint import offline
from shardpoint.storage.s3 import s3_filesystem
from tests import toy
from tests.distributed import _CTX, launch
from tests.test_checkpointer import make_state, train
from tests.test_cli_commands import CliResult, _cli_child

TRACKER = "latest_checkpointed_iteration.txt"


# ----------------------------------------------------------------- running commands


def _s3_cli_child(env: dict[str, str], argv: list[str], out_path: str, err_path: str) -> None:
    os.environ.update(env)
    _cli_child(argv, out_path, err_path)


def run_cli(env: dict[str, str], *args: object) -> CliResult:
    """``shardpoint ARGS`` with the S3 server's variables, in a process forked from a pre-imported server."""
    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = _CTX.Process(target=_s3_cli_child, args=(dict(env), argv, out, err))
        proc.start()
        proc.join(120)
        return CliResult(proc.exitcode, Path(out).read_text(), Path(err).read_text())


def _key(url: str) -> str:
    """An ``s3://`` URL as s3fs names the object."""
    return url.removeprefix("s3://")


# ----------------------------------------------------------------- the checkpoints


def _save_tp2(rank: int, world: int, root: str) -> dict:
    topo = sp.Topology(2, 1, 1)
    toy.seed_rng(topo)
    state = toy.build(topo)
    ckpt = sp.Checkpointer(root, topology=topo, format="torch")
    for step in (1, 2):
        toy.train_step(state, step)
        ckpt.save(step, state)
    ckpt.close()
    return toy.snapshot(state)


def _save_dist(root: str, iterations: tuple[int, ...] = (1, 2, 3)) -> sp.TrainState:
    state = make_state()
    ckpt = sp.Checkpointer(root)
    for it in iterations:
        train(state, 1)
        ckpt.save(it, state)
    ckpt.close()
    return state


@pytest.fixture(scope="module")
def remote(s3_server) -> dict:
    bucket = s3_server.make_bucket("t-cli-s3-shared")
    snapshots = launch(_save_tp2, 2, f"{bucket}/tp2", env=s3_server.env)
    _save_dist(f"{bucket}/dist")
    return {"dist": f"{bucket}/dist", "tp2": f"{bucket}/tp2", "full": toy.assemble(snapshots)}


# ----------------------------------------------------------------- inspect and verify


def test_inspect_and_verify_on_s3(s3_server, remote):
    env = s3_server.env
    listing = run_cli(env, "inspect", remote["dist"], "--json")
    assert listing.rc == 0, listing.err
    report = listing.json()
    assert report["directory"] == remote["dist"]
    assert [(r["iteration"], r["committed"], r["tracked"]) for r in report["checkpoints"]] == [
        (1, True, False),
        (2, True, False),
        (3, True, True),
    ]
    assert report["tracker"] == {"file": TRACKER, "exists": True, "names": "iter_0000003", "problem": None}

    one = run_cli(env, "inspect", remote["tp2"], "--tensors", "--json")
    assert one.rc == 0, one.err
    described = one.json()
    assert described["directory"] == f"{remote['tp2']}/iter_0000002" and described["problems"] == []
    assert described["metadata"]["topology"] == {"tp": 2, "pp": 1, "dp": 1}
    assert described["state"]["iteration"] == 2
    fc1 = next(t for t in described["tensors"] if t["key"] == "model.layers.0.fc1.weight")
    assert fc1["shape"] == list(remote["full"]["model.layers.0.fc1.weight"].shape) and fc1["split_dims"] == [0]

    dist_tensors = run_cli(env, "inspect", remote["dist"], "--iteration", 2, "--tensors", "--json")
    assert dist_tensors.rc == 0, dist_tensors.err
    keys = {t["key"] for t in dist_tensors.json()["tensors"]}
    assert {"model.fc1.weight", "optimizer.state.fc1.weight.exp_avg"} <= keys

    for name in ("dist", "tp2"):
        checked = run_cli(env, "verify", remote[name], "--all", "--json")
        assert checked.rc == 0, checked.out + checked.err
        data = checked.json()
        assert data["ok"] and all(c["ok"] and c["unrecorded"] == [] for c in data["checkpoints"])
    human = run_cli(env, "verify", f"{remote['dist']}/iter_0000002")
    assert human.rc == 0 and "1 checkpoint(s) verified" in human.out, human.out + human.err


def test_verify_names_a_flipped_byte_in_an_object(s3_server, bucket):
    root = f"{bucket}/run"
    _save_dist(root, (1,))
    fs = s3_filesystem()
    victim = max(fs.find(_key(f"{root}/iter_0000001")), key=fs.size)
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(victim, bytes(data))
    fs.pipe_file(_key(f"{root}/iter_0000001/stray.bin"), b"x")
    name = victim.split("/iter_0000001/", 1)[1]

    result = run_cli(s3_server.env, "verify", root)
    assert result.rc == 1, result.out + result.err
    assert f"BAD iter_0000001/{name}: checksum mismatch" in result.out
    assert "UNRECORDED iter_0000001/stray.bin" in result.out
    report = run_cli(s3_server.env, "verify", root, "--json").json()
    (checkpoint,) = report["checkpoints"]
    assert not report["ok"] and checkpoint["problems"] == [
        {"file": name, "problem": "checksum mismatch (the contents changed after saving)"}
    ]
    assert checkpoint["unrecorded"] == ["stray.bin"]


# ----------------------------------------------------------------- prune


def test_prune_on_s3_keeps_the_tracker_target_and_partial_prefixes(s3_server, bucket):
    root = f"{bucket}/run"
    _save_dist(root, (1, 2, 3, 4))
    fs = s3_filesystem()
    fs.pipe_file(_key(f"{root}/{TRACKER}"), b"2")  # the tracker names an old one: it must survive
    fs.pipe_file(_key(f"{root}/iter_0000009/__0_0.distcp"), b"a save in progress")

    dry = run_cli(s3_server.env, "prune", root, "--keep-last", 1, "--dry-run", "--json")
    assert dry.rc == 0, dry.err
    plan = {r["name"]: (r["delete"], r["kept_by"]) for r in dry.json()["checkpoints"]}
    assert plan == {
        "iter_0000001": (True, None),
        "iter_0000002": (False, "tracker"),
        "iter_0000003": (True, None),
        "iter_0000004": (False, "retention"),
    }
    assert dry.json()["partial"] == ["iter_0000009"]
    assert len(fs.ls(_key(root))) == 6

    done = run_cli(s3_server.env, "prune", root, "--keep-last", 1)
    assert done.rc == 0, done.err
    assert "no writer lock" in done.err and "deleted 2 checkpoint(s)" in done.out
    assert "kept iter_0000009" in done.out
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(_key(root)))
    assert names == ["iter_0000002", "iter_0000004", "iter_0000009", TRACKER]
    assert run_cli(s3_server.env, "verify", root, "--iteration", 4, "-q").rc == 0


# ----------------------------------------------------------------- convert, diff, export


def test_convert_from_s3_then_diff_against_the_local_copy(s3_server, remote, bucket, tmp_path):
    env = s3_server.env
    local = run_cli(env, "convert", remote["tp2"], tmp_path / "tp1", "--format", "dist", "--tp", 1, "--json")
    assert local.rc == 0, local.err
    assert local.json()["source"] == remote["tp2"]
    assert local.json()["destination"] == str(tmp_path / "tp1" / "iter_0000002")
    assert (tmp_path / "tp1" / TRACKER).read_text() == "2"
    copied = offline.read_full(tmp_path / "tp1").tensors
    for key, tensor in remote["full"].items():
        assert torch.equal(copied[key], tensor), key

    same = run_cli(env, "diff", remote["tp2"], tmp_path / "tp1", "--json")
    assert same.rc == 0, same.out + same.err
    assert same.json()["identical"] and same.json()["a"] == f"{remote['tp2']}/iter_0000002"

    # s3 -> s3: written in place, committed by the marker, then the tracker
    up = run_cli(env, "convert", remote["tp2"], f"{bucket}/copy", "--format", "dist", "--layout", "neox")
    assert up.rc == 0, up.err
    assert "no writer lock" in up.err
    fs = s3_filesystem()
    assert fs.cat_file(_key(f"{bucket}/copy/latest")) == b"global_step2"
    assert fs.exists(_key(f"{bucket}/copy/global_step2/shardpoint.json"))
    assert not [p for p in fs.ls(_key(f"{bucket}/copy")) if ".shardpoint-tmp-" in p]
    assert run_cli(env, "verify", f"{bucket}/copy", "-q").rc == 0
    assert run_cli(env, "diff", f"{bucket}/copy", tmp_path / "tp1", "-q").rc == 0
    refused = run_cli(env, "convert", remote["tp2"], f"{remote['tp2']}/", "--tp", 1)
    assert refused.rc == 1 and "is the source's directory" in refused.one_line_error()


def test_export_from_s3(s3_server, remote, tmp_path):
    from safetensors.torch import load_file

    result = run_cli(s3_server.env, "export", remote["tp2"], "--to", "safetensors", tmp_path / "m.safetensors")
    assert result.rc == 0, result.err
    exported = load_file(tmp_path / "m.safetensors")
    want = {k.removeprefix("model."): t for k, t in remote["full"].items() if k.startswith("model.")}
    assert exported.keys() == want.keys() and all(torch.equal(exported[k], want[k]) for k in want)
    refused = run_cli(s3_server.env, "export", remote["tp2"], "--to", "safetensors", "s3://elsewhere/m.safetensors")
    assert refused.rc == 2 and "must be a local path" in refused.err


# ----------------------------------------------------------------- the demo


def test_demo_saves_to_s3_and_keeps_local_files_local(s3_server, bucket, tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "COLUMNS"}, **s3_server.env}
    root = f"{bucket}/demo"
    argv = ["demo", "--iters", "6", "--save-interval", "6", "--dir", root, "--out", str(tmp_path / "out"), "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "shardpoint.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["problems"] == [] and summary["plot"] == str(tmp_path / "out" / "loss.png")
    assert [p["name"] for p in summary["phases"]] == ["reference", "train (SIGTERM)", "resume", "reshard"]
    fs = s3_filesystem()
    assert fs.cat_file(_key(f"{root}/run/{TRACKER}")) == b"6"
    assert fs.exists(_key(f"{root}/run/iter_0000006/shardpoint.json"))
    assert fs.exists(_key(f"{root}/.shardpoint-demo"))
    assert (tmp_path / "out" / "loss.png").stat().st_size > 10_000
    assert sorted(p.name for p in (tmp_path / "out" / "logs").iterdir()) == ["reference", "reshard", "resume", "train"]
    assert not fs.exists(_key(f"{root}/logs")) and not fs.exists(_key(f"{root}/loss.png"))


def test_demo_refuses_a_prefix_it_did_not_create(s3_server, bucket, tmp_path):
    fs = s3_filesystem()
    fs.pipe_file(_key(f"{bucket}/precious/iter_0000001/shardpoint.json"), b"{}")
    result = run_cli(s3_server.env, "demo", "--iters", 6, "--dir", f"{bucket}/precious", "--out", tmp_path, "--quiet")
    assert result.rc == 1
    assert f"{bucket}/precious exists and was not created by `shardpoint demo`" in result.err
    assert fs.cat_file(_key(f"{bucket}/precious/iter_0000001/shardpoint.json")) == b"{}"
