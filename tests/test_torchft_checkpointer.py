"""torchft and a Checkpointer together (issue 35 item 2): healed from a peer, else the local tier, else persistent.

Two replica groups of one rank each, in threads, with a real lighthouse, ``Manager`` and
gloo groups; each group has its own Checkpointer (persistent directory, and a local tier
in a directory of its own). Every group sees the same batch at a step, so all runs end
on the same weights whoever took part.

1. Replica 1 fails at step 5; its replacement resumes from its local tier (step 4) and
   the Manager heals it from replica 0, which is ahead: ``recovered_from`` says
   "replica group", and both end equal.
2. Both groups stop at step 7 and start again: each resumes from its own local tier
   (step 6, newer than the persistent step 4), no heal.
3. The local tiers are gone (new machines): each resumes from its persistent store
   (step 8), and ends as a run that never failed nor stopped.
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("torchft")
from examples.torchft_ddp import replica_manager
from torch import nn
from torchft.coordination import LighthouseServer
from torchft.ddp import DistributedDataParallel
from torchft.optim import OptimizerWrapper

import shardpoint as sp
from shardpoint.integrations.torchft import recovered_from, resume

_SEED_LOCK = threading.Lock()


class _Failure(Exception):
    pass


def _group(root, replica_id: int, lighthouse: str, steps: int, fail_at: int | None, seed: int) -> dict:
    with _SEED_LOCK:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4))
    optimizer = torch.optim.Adam(model.parameters())
    state = sp.TrainState(model, optimizer)
    ckpt = sp.Checkpointer(
        str(root / f"persistent{replica_id}"),
        local_dir=str(root / f"local{replica_id}"),
        save_interval=4,
        local_interval=2,
        keep_last=0,
    )
    manager, transport, _store = replica_manager(replica_id, lighthouse, model, optimizer, timeout=20)
    try:
        result = resume(manager, ckpt, state)
        ddp = DistributedDataParallel(manager, model)
        wrapped = OptimizerWrapper(manager, optimizer)
        source = None
        while manager.current_step() < steps:
            g = torch.Generator().manual_seed(manager.current_step())
            inputs, labels = torch.rand(2, 3, generator=g), torch.randint(4, (2,), generator=g)
            wrapped.zero_grad()
            nn.functional.cross_entropy(ddp(inputs), labels).backward()
            wrapped.step()
            source = source or recovered_from(result, transport)  # after the first step: healed or not
            state.extra["batches_committed"] = manager.batches_committed()
            ckpt.maybe_save(manager.current_step(), state)
            if fail_at is not None and manager.current_step() >= fail_at:
                raise _Failure(f"replica {replica_id} fails at step {fail_at}")
        return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "source": source}
    finally:
        manager.shutdown(wait=False)
        ckpt.close()


def _run(root, steps: int, fail_replica_1_at: int | None = None) -> list[dict]:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)

    def replica(r: int) -> dict:
        fail_at = fail_replica_1_at if r == 1 else None
        try:
            return _group(root, r, lighthouse.address(), steps, fail_at, seed=0)
        except _Failure:
            return _group(root, r, lighthouse.address(), steps, None, seed=1234)  # the replacement

    try:
        with ThreadPoolExecutor(2) as pool:
            return [f.result(timeout=120) for f in [pool.submit(replica, r) for r in range(2)]]
    finally:
        lighthouse.shutdown()


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_healed_from_a_peer_else_the_local_tier_else_the_persistent_store(tmp_path):
    first = _run(tmp_path, 7, fail_replica_1_at=5)  # local copies at 2, 4, 6; persistent at 4
    assert first[0]["source"] == ("none", "a fresh start")
    assert first[1]["source"][0] == "replica group"  # behind the healthy group: healed over the transport
    assert _equal(first[0]["state"], first[1]["state"])

    again = _run(tmp_path, 10)  # every group restarts from its step 6: nobody is ahead; persistent at 8
    assert [r["source"][0] for r in again] == ["local", "local"]
    assert _equal(again[0]["state"], again[1]["state"])

    for r in range(2):
        shutil.rmtree(tmp_path / f"local{r}")  # new machines: no local copies
    last = _run(tmp_path, 12)
    assert [r["source"][0] for r in last] == ["persistent", "persistent"]
    assert _equal(last[0]["state"], last[1]["state"])
    uninterrupted = _run(tmp_path / "clean", 12)
    assert _equal(last[0]["state"], uninterrupted[0]["state"])  # as if nothing had failed or stopped
