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


def _pair(sender_class=ShardpointTransport, **receiver_options):
    """A sender (rank 0) and a receiver (rank 1) on one real gloo group, set up in threads as torchft's test does."""
    store = TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    with ThreadPoolExecutor(2) as pool:
        groups = list(pool.map(lambda r: _group(store, r, 2), range(2)))
    sender = sender_class(groups[0], timeout=SHORT, device=torch.device("cpu"))
    receiver = ShardpointTransport(groups[1], timeout=SHORT, device=torch.device("cpu"), **receiver_options)
    return sender, receiver, store


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 16, generator=g), "b": torch.arange(10)}, "step": 7, "name": "run"}


def _receive(sender, receiver, state):
    """Sender starts (in the background), receiver receives; returns (what arrived or the error, the send's error)."""
    sender.send_checkpoint([1], step=3, state_dict=state, timeout=SHORT)
    try:
        got = receiver.recv_checkpoint(0, "<n/a>", step=3, timeout=SHORT)
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
