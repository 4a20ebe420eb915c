"""Host staging: one reused slab, one copy per tensor, 0-d tensors in one batch, nothing cloned by writers.

And its mirror for loads: two pinned read buffers alternate, each reused only after its copies are done.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shardpoint as sp
from shardpoint.formats.dcp_read import ReadBuffers, StreamingReads
from shardpoint.lifecycle.staging import HostStaging
from shardpoint.parallel import devices
from shardpoint.state.train_state import collect
from tests import toy


class _CountCopies(TorchDispatchMode):
    """Copy calls, and the tensors they fill (a ``_foreach_copy_`` fills a list in one call)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies += 1
            self.calls += 1
        elif func is torch.ops.aten._foreach_copy_.default:
            self.copies += len(args[0])
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _trained(layers: int = 4) -> sp.TrainState:
    topo = sp.Topology(1, 1, 1)
    state = toy.build(topo, layers=layers)
    toy.train_step(state, 1)
    return state


def test_one_slab_holds_every_tensor_exactly_and_is_reused():
    state = _trained()
    flat = collect(state, iteration=1)
    staging = HostStaging()
    staged = staging.stage(flat, everything=True)
    assert staging.allocations == 1
    assert staging.nbytes <= 1.1 * flat.nbytes()
    for key, shard in staged.tensors.items():
        tensor = shard.tensor
        assert torch.equal(tensor, flat.tensors[key].tensor), key
        assert staging.owns(tensor) or tensor.numel() == 0, key
        # exactly its own bytes: DCP and torch.save write it as is (DCP clones larger storages)
        assert tensor.untyped_storage().nbytes() == tensor.nbytes, key
    toy.train_step(state, 2)
    again = staging.stage(collect(state, iteration=2), everything=True)
    assert staging.allocations == 1  # same structure: the same slab
    assert all(
        a.tensor.data_ptr() == b.tensor.data_ptr() for a, b in zip(staged.tensors.values(), again.tensors.values())
    )


def test_a_changed_structure_gets_a_new_layout():
    staging = HostStaging()
    staging.stage(collect(toy.build(sp.Topology(1, 1, 1)), iteration=0), everything=True)  # no optimizer state yet
    state = _trained()
    flat = collect(state, iteration=1)
    staged = staging.stage(flat, everything=True)
    assert staging.allocations == 2
    assert all(torch.equal(s.tensor, flat.tensors[k].tensor) for k, s in staged.tensors.items())


def test_zero_dim_tensors_move_in_one_copy():
    state = _trained(layers=8)
    flat = collect(state, iteration=1, include_rng=False)  # (the RNG states are deep-copied, not staged)
    scalars = [k for k, s in flat.tensors.items() if s.tensor.dim() == 0]
    assert len(scalars) > 10  # AdamW's step per parameter
    staging = HostStaging()
    with _CountCopies() as counter:
        staging.stage(flat, everything=True)
    others = len(flat.tensors) + len(flat.rank_local) - len(scalars)
    assert counter.copies == others + 1  # one per tensor, one for every step value together
    assert counter.calls == 2  # the tensors of one device in one call, the step values in another


def test_sync_saves_of_cpu_tensors_stage_nothing(tmp_path):
    state = _trained()
    ckpt = sp.Checkpointer(tmp_path)
    ckpt.save(1, state)
    assert ckpt._saver.staging.nbytes == 0  # read where they are; only device tensors need the host copy
    ckpt.close()


class _Event:
    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(self.name)


def test_read_buffers_alternate_and_wait_before_reuse(monkeypatch):
    """Loads into device targets: a buffer is overwritten only after the copies out of it finished.

    The device events are stand-ins (``devices.record_event``): CPU tensors have none.
    """
    waited: list[str] = []
    made = iter("abcdef")
    monkeypatch.setattr(devices, "record_event", lambda device: _Event(waited, next(made)))
    buffers = ReadBuffers(double=True)
    first = buffers.view
    buffers.copied_to(torch.device("cuda", 0))  # event a on buffer 0
    buffers.next()
    assert buffers.view.obj is not first.obj and waited == []  # buffer 1 is free: no wait
    buffers.copied_to(torch.device("cuda", 0))  # event b on buffer 1
    buffers.next()
    assert buffers.view.obj is first.obj and waited == ["a"]  # back to buffer 0: its copy must be done
    buffers.copied_to(torch.device("cuda", 0))  # c
    buffers.drain()
    assert sorted(waited) == ["a", "b", "c"]


def test_double_buffered_loads_are_exact(tmp_path, monkeypatch):
    state = _trained()
    sp.Checkpointer(tmp_path).save(1, state)
    monkeypatch.setattr(StreamingReads, "double_buffered", True)
    fresh = toy.build(sp.Topology(1, 1, 1), layers=4)
    sp.Checkpointer(tmp_path).load(fresh)
    for (key, want), got in zip(state.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(want, got), key
    want_opt, got_opt = toy.optimizer_state(state), toy.optimizer_state(fresh)
    assert all(torch.equal(v, got_opt[k][n]) for k, per in want_opt.items() for n, v in per.items())
