"""A replica group under torchft fails mid-run and heals from the healthy one through ShardpointTransport.

Modelled on torchft's own ``manager_integ_test.test_ddp_recovery`` (its wheel's test needs
``parameterized``, which torchft does not install): two replica groups of one rank, in
threads, a real lighthouse (``LighthouseServer`` from the torchft wheel), a real
``Manager`` and gloo process group each, torchft's ``DistributedDataParallel`` and
``OptimizerWrapper``. Replica 1 raises at step 2, starts again from a model initialised
with another seed, and must get the healthy replica's state over the transport: at the
end both replicas hold the same weights and Adam state, bit for bit, and the transport
records the heal (its step, sender and bytes). The transport is set up as the README
shows (``state_dict=lambda: {"user": state_dict()}``) while torchft 0.2's Manager sends
``{"user": {"default": ...}}``: the weights must still arrive in place, into the
replacement's own parameters (the same storage before and after).
"""

from __future__ import annotations

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

from shardpoint.integrations.torchft import ShardpointTransport

STEPS = 5
_SEED_LOCK = threading.Lock()


class _Failure(Exception):
    pass


TRANSPORTS: list[ShardpointTransport] = []
IN_PLACE: list[dict[str, bool]] = []  # per heal: each weight, whether it arrived in the model's own storage


def _watch_in_place(transport: ShardpointTransport, model: nn.Module) -> None:
    """Record, for what the Manager receives, whether each weight is the model's own storage."""
    receive = transport.recv_checkpoint

    def recv_checkpoint(*args, **kwargs):
        before = {k: v.data_ptr() for k, v in model.state_dict().items()}
        state = receive(*args, **kwargs)
        got = state["user"]["default"]["model"]  # as torchft 0.2's Manager builds it
        IN_PLACE.append({k: got[k].data_ptr() == p == model.state_dict()[k].data_ptr() for k, p in before.items()})
        return state

    transport.recv_checkpoint = recv_checkpoint


def _replica(replica_id: int, lighthouse: str, fail_at: int | None, seed: int) -> dict:
    with _SEED_LOCK:  # the threads share torch's generator
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4))
    optimizer = torch.optim.Adam(model.parameters())
    manager, transport, _store = replica_manager(replica_id, lighthouse, model, optimizer, timeout=20)
    TRANSPORTS.append(transport)
    _watch_in_place(transport, model)
    try:
        ddp = DistributedDataParallel(manager, model)
        wrapped = OptimizerWrapper(manager, optimizer)
        while manager.current_step() < STEPS:
            step = manager.current_step()
            g = torch.Generator().manual_seed(step)  # every replica sees the same batch at a step
            inputs, labels = torch.rand(2, 3, generator=g), torch.randint(4, (2,), generator=g)
            wrapped.zero_grad()
            nn.functional.cross_entropy(ddp(inputs), labels).backward()
            wrapped.step()
            if fail_at is not None and manager.current_step() == fail_at:
                raise _Failure(f"replica {replica_id} fails at step {fail_at}")
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}
    finally:
        manager.shutdown(wait=False)


def _run_replica(replica_id: int, lighthouse: str, fail_at: int | None) -> dict:
    try:
        return _replica(replica_id, lighthouse, fail_at, seed=0)
    except _Failure:
        return _replica(replica_id, lighthouse, None, seed=1234)  # the replacement: another initialisation


def test_a_failed_replica_heals_from_the_healthy_one_bit_for_bit():
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    TRANSPORTS.clear()
    IN_PLACE.clear()
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_run_replica, r, lighthouse.address(), 2 if r == 1 else None) for r in range(2)]
            healthy, healed = (f.result(timeout=120) for f in futures)
    finally:
        lighthouse.shutdown()
    heals = [heal for t in TRANSPORTS for heal in t.received]
    assert heals and heals[0]["from rank"] == 0 and heals[0]["bytes"] > 0, heals  # the state came over the wire
    assert IN_PLACE and all(all(weights.values()) for weights in IN_PLACE), IN_PLACE  # into the model's own storage
    flat_a, flat_b = _flatten(healthy), _flatten(healed)
    assert flat_a.keys() == flat_b.keys()
    for key, value in flat_a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, flat_b[key]), key
        else:
            assert value == flat_b[key], key


def _flatten(state: dict) -> dict:
    from torch.utils._pytree import keystr, tree_flatten_with_path

    return {keystr(path): value for path, value in tree_flatten_with_path(state)[0]}


def test_a_replica_group_killed_with_sigkill_is_replaced_and_ends_as_an_uninterrupted_run(tmp_path):
    """examples/torchft_ddp.py: two processes, replica 1 SIGKILLed at step 5, a replacement from another seed."""
    import json
    import os
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "torchft_ddp.py")
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, example, "--steps", "10", "--kill-at", "4", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["same"] is True  # both replicas end bit for bit as the run without a failure
    assert result["killed at step"] >= 4 and result["healed"][0]["from rank"] == 0
    assert result["healed"][0]["bytes"] > 0
