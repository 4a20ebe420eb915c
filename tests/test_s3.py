"""Checkpoints on object storage, against a real S3 server (moto_server) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint.storage.s3 import s3_filesystem
from tests import toy
from tests.distributed import launch
from tests.test_bench import run_bench_json
from tests.test_checkpointer import assert_same, make_state, train


def _save_sharded(rank: int, world: int, root: str, fmt: str):
    topo = sp.Topology(2, 1, 1)
    toy.seed_rng(topo)
    state = toy.build(topo)
    toy.train_step(state, 1)
    sp.Checkpointer(root, topology=topo, format=fmt).save(1, state)
    fresh = toy.build(topo)
    result = sp.Checkpointer(root, topology=topo).load(fresh)
    return {"saved": toy.snapshot(state), "loaded": toy.snapshot(fresh), "iteration": result.iteration}


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_round_trip_through_s3(s3_server, bucket, fmt):
    root = f"{bucket}/runs/gpt"
    results = launch(_save_sharded, 2, root, fmt, env=s3_server.env)
    for r in results:
        assert r["iteration"] == 1
        for key, (_, _, tensor) in r["saved"]["tensors"].items():
            assert torch.equal(r["loaded"]["tensors"][key][2], tensor), key
    fs = s3_filesystem()
    prefix = root.removeprefix("s3://")
    assert fs.cat_file(f"{prefix}/latest_checkpointed_iteration.txt") == b"1"
    marker = json.loads(fs.cat_file(f"{prefix}/iter_0000001/shardpoint.json"))
    assert marker["topology"] == {"tp": 2, "pp": 1, "dp": 1} and marker["format"] == fmt
    listed = subprocess.run(
        [
            str(Path(sys.executable).with_name("aws")),
            "s3",
            "ls",
            "--recursive",
            f"{root}/",
            "--endpoint-url",
            s3_server.endpoint,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in marker["files"]:
        assert f"iter_0000001/{name}" in listed
    assert "iter_0000001/shardpoint.json" in listed and "latest_checkpointed_iteration.txt" in listed
    if fmt == "dist":  # resharded: tp=2 on the store -> tp=1 here
        state = toy.build(sp.Topology(1, 1, 1))
        sp.Checkpointer(root).load(state)
        expected = toy.assemble([r["saved"] for r in results])
        got = toy.assemble([toy.snapshot(state)])
        for key in expected:
            assert torch.equal(got[key], expected[key]), key


def test_retention_and_integrity_on_s3(s3_server, bucket):
    root = f"{bucket}/run"
    state = make_state()
    ckpt = sp.Checkpointer(root, keep_last=2)
    for it in (1, 2, 3):
        train(state, 1)
        ckpt.save(it, state)
    ckpt.wait()
    fs = s3_filesystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root.removeprefix("s3://")))
    assert names == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    # a flipped byte in the store is found on load, and fallback takes the previous checkpoint
    victim = max(fs.find(f"{root.removeprefix('s3://')}/iter_0000003"), key=fs.size)
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(victim, bytes(data))
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch"):
        sp.Checkpointer(root).load(make_state(5))
    assert sp.Checkpointer(root).load(make_state(5), fallback=True).iteration == 2


def test_unmarked_prefix_is_never_loaded_and_cleaned(s3_server, bucket):
    root = f"{bucket}/run"
    state = make_state()
    sp.Checkpointer(root).save(1, state)
    fs = s3_filesystem()
    fs.pipe_file(f"{root.removeprefix('s3://')}/iter_0000002/.shardpoint-in-progress", b"{}")  # a save started it
    fs.pipe_file(f"{root.removeprefix('s3://')}/iter_0000002/__0_0.distcp", b"half written")
    ckpt = sp.Checkpointer(root)
    assert ckpt.load(make_state(4)).iteration == 1  # never loaded
    # a job that only loads leaves it (it could be another job's save in progress); a saving job cleans it
    assert fs.exists(f"{root.removeprefix('s3://')}/iter_0000002")
    ckpt.save(3, state)
    assert not fs.exists(f"{root.removeprefix('s3://')}/iter_0000002")


def test_server_down_mid_save_keeps_the_tracker(s3_server, bucket, monkeypatch):
    root = f"{bucket}/run"
    state = make_state()
    ckpt = sp.Checkpointer(root)
    ckpt.save(1, state)
    train(state)
    monkeypatch.setenv("SHARDPOINT_FAULT", "point=before-data,rank=0,action=stall,seconds=0.3")
    threading.Timer(0.1, s3_server.pause).start()  # the server dies while the save is under way
    try:
        with pytest.raises(sp.StorageError, match="failed after retries"):
            ckpt.save(2, state)
    finally:
        time.sleep(0.3)
        s3_server.resume()
    monkeypatch.delenv("SHARDPOINT_FAULT")
    fs = s3_filesystem()
    assert fs.cat_file(f"{root.removeprefix('s3://')}/latest_checkpointed_iteration.txt") == b"1"
    ckpt.save(2, state)  # the server is back: the next save succeeds
    fresh = make_state(3)
    assert sp.Checkpointer(root).load(fresh).iteration == 2
    assert_same(state, fresh)


def test_local_first_upload_interrupted_and_resumed(s3_server, bucket, tmp_path):
    remote = f"{bucket}/mirror"
    fs = s3_filesystem()
    tracker = f"{remote.removeprefix('s3://')}/latest_checkpointed_iteration.txt"
    state = make_state()
    ckpt = sp.Checkpointer(tmp_path / "local", upload_to=remote, keep_last=1)
    ckpt.save(1, state)
    ckpt.wait()
    assert fs.cat_file(tracker) == b"1"
    train(state)
    s3_server.pause()  # the upload of iteration 2 cannot finish
    try:
        ckpt.save(2, state)  # local commit; training is not blocked by the upload
        assert (tmp_path / "local" / "latest_checkpointed_iteration.txt").read_text() == "2"
        assert not ckpt.maybe_save(3, state)  # upload still running: nothing committed remotely
    finally:
        s3_server.resume()
    ckpt.close()  # the failed attempt is retried and the remote tracker moves
    assert fs.cat_file(tracker) == b"2"
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(remote.removeprefix("s3://")))
    assert names == ["iter_0000002", "latest_checkpointed_iteration.txt"]  # remote retention too
    fresh = make_state(6)
    assert sp.Checkpointer(remote).load(fresh).iteration == 2
    assert_same(state, fresh)


@pytest.mark.long  # the bench's rows are checked on disk in tests/test_bench.py, its S3 client in test_store_bench
def test_bench_reports_upload_and_download_against_the_server(s3_server, bucket):
    report = run_bench_json(f"{bucket}/bench", env={**os.environ, **s3_server.env})
    rows = {row["name"]: row for row in report["rows"]}
    for name in (
        "sequential write+fsync",
        "sequential read",
        "shardpoint save",
        "shardpoint load",
        "shardpoint load (resharded)",
    ):
        assert rows[name]["median_s"] > 0 and rows[name]["gb_per_s"] > 0
    assert "dcp save" not in rows  # the local-file baselines are not run against object storage
    assert not s3_filesystem().ls(bucket.removeprefix("s3://"))  # cleaned up


def test_a_dead_upload_is_cleaned_and_a_foreign_prefix_is_not(s3_server, bucket, tmp_path, monkeypatch):
    remote = f"{bucket}/mirror"
    fs = s3_filesystem()
    base = remote.removeprefix("s3://")
    fs.pipe_file(f"{base}/global_step7/mp_rank_00_model_states.pt", b"another tool's checkpoint")
    state = make_state()
    ckpt = sp.Checkpointer(tmp_path / "local", upload_to=remote)
    ckpt.mirror.max_attempts = 1
    monkeypatch.setenv("SHARDPOINT_FAULT", "point=during-upload,rank=0,action=raise")
    ckpt.save(1, state)
    with pytest.raises(sp.StorageError):
        ckpt.wait()  # the upload died after staging its prefix, before any data, and removed what it staged
    monkeypatch.delenv("SHARDPOINT_FAULT")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(base)) == ["global_step7"]
    ckpt.close()
    sp.Checkpointer(tmp_path / "local2", upload_to=remote).close()  # a new job's clean-up: the foreign prefix stays
    assert not fs.exists(f"{base}/iter_0000001")
    assert fs.cat_file(f"{base}/global_step7/mp_rank_00_model_states.pt") == b"another tool's checkpoint"


def test_crafted_pickle_through_the_s3_reader_never_runs(s3_server, bucket, tmp_path):
    import pickle

    import xxhash

    from tests.test_reliability import Exploit

    root = f"{bucket}/crafted"
    sp.Checkpointer(root).save(1, make_state())
    fs = s3_filesystem()
    prefix = f"{root.removeprefix('s3://')}/iter_0000001"
    evidence = tmp_path / "pwned"
    crafted = pickle.dumps(Exploit(str(evidence)))
    fs.pipe_file(f"{prefix}/.metadata", crafted)
    marker = json.loads(fs.cat_file(f"{prefix}/shardpoint.json"))  # the attacker makes the marker vouch for it
    marker["files"][".metadata"] = {"size": len(crafted), "xxh3_64": xxhash.xxh3_64(crafted).hexdigest()}
    for name in (".chunk_index", ".chunk_rows"):  # else the index, which records the real .metadata, refuses it first
        fs.rm_file(f"{prefix}/{name}")
        marker["files"].pop(name)
    fs.pipe_file(f"{prefix}/shardpoint.json", json.dumps(marker).encode())
    with pytest.raises(sp.UnsafeCheckpointError, match=r"\.metadata asks to load posix.system"):
        sp.Checkpointer(root).load(make_state())
    assert not evidence.exists()
