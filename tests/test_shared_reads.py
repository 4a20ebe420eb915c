"""Each stored byte is read once per load: data-parallel replicas split the reading and pass tensors on."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import shardpoint as sp
from shardpoint.catalog.metadata import CheckpointMetadata
from shardpoint.formats.shared_reads import plan_reads
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


@pytest.mark.parametrize("tp", [1, 2], ids=["dp4", "tp2-dp2"])
def test_every_stored_byte_is_read_once_from_local_disk(tmp_path, tp):
    """dp=4: replicas deal the files out; tp2·dp2 also shares the norms and biases every rank holds."""
    results = launch(_load_counting_reads, 4, str(tmp_path), tp, False)
    assert all(r["same"] for r in results)
    assert sum(r["bytes_read"] for r in results) == _stored_data_bytes(str(tmp_path))
    assert min(r["bytes_read"] for r in results) > 0  # every rank did part of the reading


def test_every_stored_byte_is_read_once_from_s3(s3_server, bucket):
    root = f"{bucket}/run"
    results = launch(_load_counting_reads, 4, root, 1, True, env=s3_server.env)
    assert all(r["same"] for r in results)
    assert sum(r["bytes_read"] for r in results) == _stored_data_bytes(root)


def test_each_file_goes_to_a_rank_needing_most_of_it_and_the_load_is_balanced():
    a, b, c, d = (MetadataIndex(k, torch.Size([0])) for k in "abcd")
    files = {a: "f1", b: "f2", c: "f3", d: "f4"}
    # ranks 0 and 1 are replicas (need a, b, c); rank 2 needs c and d only
    needs = [{a: 100, b: 60, c: 50}, {a: 100, b: 60, c: 50}, {c: 50, d: 30}]
    readers = plan_reads(needs, files)
    assert readers == {"f1": 0, "f2": 1, "f3": 2, "f4": 2}  # f3: a three-way tie goes to the least loaded
