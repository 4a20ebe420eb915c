"""``ShardpointTransport`` as torchft's own transport tests use it, then what it adds (issue 35 item 1).

torchft ships generic tests for any ``CheckpointTransport`` in its wheel
(``torchft/checkpointing/transport_test.py``: ``run_multi_recovery_test``, three ranks in
threads over a real gloo ``ProcessGroupGloo``: all and some ranks recovering, then a
receive that times out). They run here unchanged, as they run for ``PGTransport``.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import unittest
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft")
from torch.distributed import TCPStore
from torchft.checkpointing.transport_test import run_multi_recovery_test
from torchft.process_group import ProcessGroupGloo

import shardpoint as sp
from shardpoint.integrations.torchft import ShardpointTransport


def _group(store: TCPStore, rank: int, world: int) -> ProcessGroupGloo:
    pg = ProcessGroupGloo()
    pg.configure(store_addr=f"localhost:{store.port}/prefix", replica_id="0", rank=rank, world_size=world)
    return pg


class TorchftsOwnTests(unittest.TestCase):
    """torchft's ``PGTransportTest.test_pg_transport_gloo``, with ShardpointTransport in place of PGTransport."""

    def test_multi_recovery(self) -> None:
        store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
        device = torch.device("cpu")

        def init(rank: int, world: int) -> ShardpointTransport:
            return ShardpointTransport(_group(store, rank, world), timeout=timedelta(seconds=10), device=device)

        run_multi_recovery_test(self, init, device=device)

    def test_multi_recovery_in_place_and_in_small_chunks(self) -> None:
        from torchft.checkpointing.transport_test import make_state_dict

        store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
        device = torch.device("cpu")

        def init(rank: int, world: int) -> ShardpointTransport:
            pg = _group(store, rank, world)
            return ShardpointTransport(
                pg,
                timeout=timedelta(seconds=10),
                device=device,
                state_dict=lambda: make_state_dict(device),
                chunk_bytes=8,
            )

        run_multi_recovery_test(self, init, device=device)


# ---------------------------------------------------------------------------- what shardpoint adds
SHORT = timedelta(seconds=2)


def _pair(sender_class=ShardpointTransport, timeout=SHORT, sender_options=None, **receiver_options):
    """A sender (rank 0) and a receiver (rank 1) on one real gloo group, set up in threads as torchft's test does."""
    store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    with ThreadPoolExecutor(2) as pool:
        groups = list(pool.map(lambda r: _group(store, r, 2), range(2)))
    sender = sender_class(groups[0], timeout=timeout, device=torch.device("cpu"), **(sender_options or {}))
    receiver = ShardpointTransport(groups[1], timeout=timeout, device=torch.device("cpu"), **receiver_options)
    return sender, receiver, store


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 16, generator=g), "b": torch.arange(10)}, "step": 7, "name": "run"}


def _receive(sender, receiver, state, step=3, timeout=SHORT):
    """Sender starts (in the background), receiver receives; returns (what arrived or the error, the send's error)."""
    sender.send_checkpoint([1], step=3, state_dict=state, timeout=timeout)
    try:
        got = receiver.recv_checkpoint(0, "<n/a>", step=step, timeout=timeout)
    except sp.CheckpointError as exc:
        got = exc
    sender.disallow_checkpoint()  # never raises: a peer's failure must not stop the healthy rank
    return got, (sender.send_errors[0] if sender.send_errors else None)


class _DamagesInTransit(ShardpointTransport):
    """Checksums other bytes than it sends: what a flipped bit on the way looks like to the receiver."""

    def _checked(self, chunk):
        damaged = chunk.clone()
        damaged[-1] ^= 1
        return damaged


class _DiesAfterTheFirstTensor(ShardpointTransport):
    """Stops sending after its first tensor, as a healthy replica killed mid-transfer does."""

    def _send_tensor(self, tensor, key, dst_ranks, tag, timeout):
        if tag > 3:
            raise RuntimeError("killed")
        return super()._send_tensor(tensor, key, dst_ranks, tag, timeout)


class _DamagesTheLastTensor(ShardpointTransport):
    """Damages only the chunk of its third tensor: the first two arrive whole, into the receiver's own."""

    def _send_tensor(self, tensor, key, dst_ranks, tag, timeout):
        self.damage = tag > 5
        return super()._send_tensor(tensor, key, dst_ranks, tag, timeout)

    def _checked(self, chunk):
        return _DamagesInTransit._checked(self, chunk) if self.damage else chunk


class _DiesBeforeTheLastTensor(ShardpointTransport):
    """Sends two tensors whole, then stops: killed midway."""

    def _send_tensor(self, tensor, key, dst_ranks, tag, timeout):
        if tag > 5:
            raise RuntimeError("killed")
        return super()._send_tensor(tensor, key, dst_ranks, tag, timeout)


def _three() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"model": {"a": torch.randn(256, generator=g), "w": torch.randn(64, 16, generator=g), "b": torch.arange(10)}}


@pytest.mark.parametrize("sender_class", [_DamagesTheLastTensor, _DiesBeforeTheLastTensor])
def test_a_failed_heal_leaves_the_recovering_ranks_state_exactly_as_it_was(sender_class):
    """Received in place, then refused: every byte of the rank's own tensors is back, in the same storage."""
    own = {
        "model": {
            "a": torch.full((256,), 5.0),
            "w": torch.full((16, 64), 7.0).t(),  # not contiguous: received beside it, then copied in
            "b": torch.full((10,), -1, dtype=torch.int64),
        }
    }
    before = {k: (t.clone(), t.data_ptr()) for k, t in own["model"].items()}
    sender, receiver, _store = _pair(sender_class, state_dict=lambda: own)
    got, _ = _receive(sender, receiver, _three())
    assert isinstance(
        got, sp.CorruptCheckpointError if sender_class is _DamagesTheLastTensor else sp.CheckpointTimeoutError
    )
    assert "['model']['b']" in str(got)
    for key, (value, pointer) in before.items():
        assert own["model"][key].data_ptr() == pointer and torch.equal(own["model"][key], value), key
    assert receiver.received == []  # no heal recorded: recovered_from does not say "replica group"


@pytest.mark.parametrize("refused", ["a damaged chunk", "another step"])
def test_a_refused_heal_lets_the_healthy_rank_finish_well_within_its_timeout(refused):
    """The receiver takes the rest of what was sent off the wire: the sender is never left blocked on it."""
    timeout = timedelta(seconds=15)
    sender_class = _DamagesInTransit if refused == "a damaged chunk" else ShardpointTransport
    sender, receiver, _store = _pair(sender_class, timeout=timeout, sender_options={"chunk_bytes": 64 << 10})
    state = {f"layer.{i}": torch.randn(1 << 18) for i in range(4)}  # 4 MiB in 64 chunks: more than a socket holds
    began = time.perf_counter()
    got, sent = _receive(sender, receiver, state, step=3 if refused == "a damaged chunk" else 4, timeout=timeout)
    served = time.perf_counter() - began  # until disallow_checkpoint returned on the healthy rank
    assert served < timeout.total_seconds() / 3, served  # not blocked until the timeout (15 s before)
    assert sent is None  # every send was received: nothing failed, nothing left posted for the next heal
    assert isinstance(got, sp.CheckpointError) and not isinstance(got, sp.CheckpointTimeoutError), got
    assert ("checksum" if refused == "a damaged chunk" else "step 3, not of step 4") in str(got)


def test_the_readmes_in_place_form_receives_in_place_what_torchfts_manager_sends():
    """torchft 0.2's Manager sends {"user": {"default": <its state_dict()>}, "torchft": {...}}.

    (``Manager._manager_state_dict`` in torchft 0.2.0; the README shows ``{"user": state_dict()}``.)
    """
    own = {"model": {"w": torch.zeros(64, 16), "b": torch.zeros(10, dtype=torch.int64)}}
    pointers = {k: t.data_ptr() for k, t in own["model"].items()}
    sender, receiver, _store = _pair(state_dict=lambda: {"user": own})  # the README's form
    sent_state = {"user": {"default": {"model": _state()["model"]}}, "torchft": {"step": 3, "batches_committed": 6}}
    got, sent = _receive(sender, receiver, sent_state)
    assert sent is None and got["torchft"] == {"step": 3, "batches_committed": 6}
    for key, tensor in _state()["model"].items():
        assert got["user"]["default"]["model"][key] is own["model"][key]
        assert own["model"][key].data_ptr() == pointers[key] and torch.equal(own["model"][key], tensor), key
    assert receiver.received[0]["in place"] == receiver.received[0]["bytes"]


def test_a_chunk_damaged_in_transit_is_named_and_never_returned():
    sender, receiver, _store = _pair(_DamagesInTransit)
    got, _ = _receive(sender, receiver, _state())
    assert isinstance(got, sp.CorruptCheckpointError), got
    assert "rank 0" in str(got) and "['model']['w']" in str(got) and "checksum" in str(got)


def test_a_sender_that_dies_midway_is_named_within_the_timeout():
    sender, receiver, _store = _pair(_DiesAfterTheFirstTensor)
    got, sent = _receive(sender, receiver, _state())
    assert isinstance(got, sp.CheckpointTimeoutError), got
    assert got.missing == [0] and "from rank 0" in str(got) and "['model']['b']" in str(got)
    assert isinstance(sent, sp.CheckpointError) and "killed" in str(sent)  # kept and logged on the sender


def test_a_crafted_description_is_refused_and_runs_nothing(tmp_path):
    sender, receiver, _store = _pair()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    data = pickle.dumps({"step": 3, "treespec": "x", "leaves": [Payload()]})
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    works = [sender._pg.send([torch.tensor([len(data)])], 1, tag=1), sender._pg.send([raw], 1, tag=2)]
    with pytest.raises(sp.UnsafeCheckpointError):
        receiver.recv_checkpoint(0, "<n/a>", step=3, timeout=SHORT)
    for work in works:
        work.wait(SHORT)
    assert not marker.exists()


def test_received_in_place_into_the_recovering_ranks_own_tensors():
    own = {"model": {"w": torch.zeros(64, 16), "b": torch.zeros(10, dtype=torch.int64)}, "step": 0, "name": ""}
    pointers = {k: t.data_ptr() for k, t in own["model"].items()}
    sender, receiver, _store = _pair(state_dict=lambda: own)
    got, sent = _receive(sender, receiver, _state())
    assert sent is None and got["step"] == 7 and got["name"] == "run"
    for key, tensor in _state()["model"].items():
        assert got["model"][key] is own["model"][key] and own["model"][key].data_ptr() == pointers[key]
        assert torch.equal(own["model"][key], tensor)


def test_the_sender_returns_before_the_receiver_has_even_started():
    """The healthy rank goes on training: send_checkpoint only starts the transfer."""
    sender, receiver, _store = _pair()
    started = threading.Event()
    got = {}

    def recover():
        started.wait(5)
        got["state"] = receiver.recv_checkpoint(0, "<n/a>", step=3, timeout=SHORT)

    thread = threading.Thread(target=recover)
    thread.start()
    big = {"w": torch.randn(1 << 20)}  # 4 MiB: more than a socket buffer holds
    sender.send_checkpoint([1], step=3, state_dict=big, timeout=SHORT)
    started.set()  # a blocking send would still be waiting for this receiver: it has not posted a receive yet
    sender.disallow_checkpoint()
    thread.join()
    assert torch.equal(got["state"]["w"], big["w"])


def test_a_recovering_rank_that_dies_midway_never_stops_the_healthy_one():
    """torchft calls disallow_checkpoint inside should_commit: a peer's failure must not raise there."""
    sender, receiver, _store = _pair()
    state = {"a": torch.randn(1 << 20), "b": torch.randn(1 << 20)}  # 4 MiB each: more than a socket holds
    sender.send_checkpoint([1], step=3, state_dict=state, timeout=SHORT)
    receiver._recv_header(0, SHORT)  # the recovering rank reads what is coming, then dies
    sender.disallow_checkpoint()  # returns: the healthy rank commits its step and trains on
    (error,) = sender.send_errors
    assert isinstance(error, sp.CheckpointTimeoutError) and error.missing == [1] and "['a']" in str(error)
