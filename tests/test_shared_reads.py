"""Each stored byte is read once per load: data-parallel replicas split the reading and pass tensors on."""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.catalog.metadata import CheckpointMetadata
from shardpoint.formats.shared_reads import assign
from shardpoint.storage.base import open_storage
from tests import toy
from tests.distributed import launch


def _load_counting_reads(rank: int, world: int, root: str, tp: int, async_save: bool):
    topo = sp.Topology(tp, 1, world // tp)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=False)
    toy.train_step(state, 1)
    ckpt = sp.Checkpointer(root, topology=topo, async_save=async_save)
    ckpt.save(1, state)
    ckpt.close()
    fresh = toy.build(topo, zero=False)
    result = sp.Checkpointer(root, topology=topo).load(fresh)
    saved, loaded = toy.snapshot(state)["tensors"], toy.snapshot(fresh)["tensors"]
    same = saved.keys() == loaded.keys() and all(torch.equal(saved[k][2], loaded[k][2]) for k in saved)
    return {
        "bytes_read": result.bytes_read,
        "same": same and toy.optimizer_state(fresh).keys() == toy.optimizer_state(state).keys(),
    }


def _stored_data_bytes(root: str) -> int:
    storage = open_storage(root)
    meta = CheckpointMetadata.from_json(
        storage.read_bytes(storage.join(root, "iter_0000001", "shardpoint.json")).decode(), root
    )
    return sum(record.size for name, record in meta.files.items() if name.endswith(".distcp"))


def test_every_stored_byte_is_read_once_from_local_disk(tmp_path):
    results = launch(_load_counting_reads, 4, str(tmp_path), 1, False)
    assert all(r["same"] for r in results)
    assert sum(r["bytes_read"] for r in results) == _stored_data_bytes(str(tmp_path))
    assert min(r["bytes_read"] for r in results) > 0  # every replica did part of the reading


def test_tensor_parallel_replicas_split_their_reads_too(tmp_path):
    """tp2·dp2: each tp rank's two replicas split its reads. Files holding both tp ranks' items
    (and the tensors every rank holds) are still read once per tp rank: below 2x, not yet 1x."""
    results = launch(_load_counting_reads, 4, str(tmp_path), 2, False)
    assert all(r["same"] for r in results)
    assert sum(r["bytes_read"] for r in results) < 1.5 * _stored_data_bytes(str(tmp_path))


def test_every_stored_byte_is_read_once_from_s3(s3_server, bucket):
    root = f"{bucket}/run"
    results = launch(_load_counting_reads, 4, root, 1, True, env=s3_server.env)
    assert all(r["same"] for r in results)
    assert sum(r["bytes_read"] for r in results) == _stored_data_bytes(root)


def test_reads_are_dealt_out_by_file_biggest_first():
    key_files = {"a": {"f1": 100}, "b": {"f2": 60}, "c": {"f3": 50}, "d": {"f1": 10, "f4": 5}}
    owners = assign(key_files, [0, 2])
    assert owners == {"a": 0, "b": 2, "c": 2, "d": 0}  # f1 (110) to 0, f2 (60) to 2, f3 to 2 (60 < 110), f4 to 0
