"""torchtitan: a checkpoint's data loader bytes never run code when loaded.

torchtitan's ``ParallelAwareDataloader.load_state_dict`` calls ``pickle.loads`` on the
stored ``dataloader.dp_rank_N`` bytes, so the manager checks them with shardpoint's
restricted unpickler before handing anything over.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from shardpoint.errors import UnsafeCheckpointError
from shardpoint.integrations.torchtitan import ShardpointCheckpointManager
from tests.integration_titan_job import build, train


class Exploit:
    """A pickle that runs code when loaded: it creates the file ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def ours():
    return ShardpointCheckpointManager.Config(enable=True, interval=2)


def _save_with_loader_state(folder: str, loader_state) -> None:
    job = build(ours(), folder)
    rank_key = job.dataloader._rank_id
    job.dataloader.state_dict = lambda: {rank_key: pickle.dumps(loader_state), "world_size": 1}
    train(job, 2)
    job.checkpointer.close()


def test_a_crafted_data_loader_state_is_refused_and_runs_nothing(tmp_path):
    sentinel = tmp_path / "code-ran"
    _save_with_loader_state(str(tmp_path / "run"), {"_num_yielded": 1, "payload": Exploit(str(sentinel))})
    job = build(ours(), str(tmp_path / "run"))
    with pytest.raises(UnsafeCheckpointError, match=r"dataloader\.dp_rank_0.*builtins\.exec"):
        job.checkpointer.load()
    job.checkpointer.close()
    assert not sentinel.exists(), "loading the checkpoint ran code from it"


def test_a_real_data_loader_state_with_tensors_still_resumes(tmp_path):
    """What a StatefulDataLoader legitimately holds (dicts, ints, a generator-state tensor) loads as saved."""
    state = {"_num_yielded": 3, "_sampler_iter_state": {"generator": torch.arange(8, dtype=torch.uint8)}}
    _save_with_loader_state(str(tmp_path / "run"), state)
    job = build(ours(), str(tmp_path / "run"))
    received = {}
    job.dataloader.load_state_dict = lambda sd: received.update(pickle.loads(sd[job.dataloader._rank_id]))
    assert job.checkpointer.load()
    job.checkpointer.close()
    assert received["_num_yielded"] == 3
    assert torch.equal(received["_sampler_iter_state"]["generator"], torch.arange(8, dtype=torch.uint8))
    assert not os.path.exists(tmp_path / "code-ran")
