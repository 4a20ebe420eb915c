"""NCCL's rules, kept on CPU: shardpoint's traffic never touches the trainer's default group.

The multi-rank tests run with the strict backend as the default group
(:mod:`tests.strict_backend`); these tests add what it cannot see by itself: that a
step which does not save makes *no* call there at all, that rank 0 working alone
survives a default group with a short timeout, and the device-side rules that need
a GPU to break for real (RNG per device, every device synchronised), through the code
paths with stand-ins for the devices.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.parallel import comm, devices
from shardpoint.state import rng
from tests import strict_backend, toy
from tests.distributed import launch


def _default_group_calls_of_a_run(rank: int, world: int, root: str, fmt: str, async_save: bool):
    topo = sp.Topology(2, 1, 2)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=True)
    ckpt = sp.Checkpointer(
        root, topology=topo, format=fmt, async_save=async_save, save_interval=2, save_interval_minutes=60, keep_last=1
    )
    calls = 0
    for step in range(1, 7):
        toy.train_step(state, step)  # the trainer's own collectives (allowed, not counted)
        before = strict_backend.calls()
        ckpt.maybe_save(step, state)  # polls the pending async commit and the time-based decision
        calls += strict_backend.calls() - before
    before = strict_backend.calls()
    ckpt.close()
    loaded = toy.build(topo, zero=True)
    result = sp.Checkpointer(root, topology=topo, format=fmt).load(loaded)
    calls += strict_backend.calls() - before
    return {"calls": calls, "iteration": result.iteration, "backend": dist.get_backend()}


def test_saves_polls_and_loads_make_no_call_on_the_default_group(tmp_path):
    """dist+async (pending commits polled every step) and torch with ZeRO state gathered over dp."""
    for fmt, async_save in (("dist", True), ("torch", False)):
        results = launch(_default_group_calls_of_a_run, 4, str(tmp_path / fmt), fmt, async_save)
        assert {r["backend"] for r in results} == {"strict"}
        assert [r["iteration"] for r in results] == [6] * 4
        assert [r["calls"] for r in results] == [0] * 4, fmt


def _trainer_groups_are_mirrored(rank: int, world: int, root: str):
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the trainer's (default backend)
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    topo = sp.Topology.from_groups(tp_group=tp_groups[rank // 2], dp_group=dp_groups[rank % 2])
    state = toy.build(topo, zero=True)
    toy.train_step(state, 1)
    before = strict_backend.calls()
    sp.Checkpointer(root, topology=topo, format="torch").save(1, state)
    calls = strict_backend.calls() - before
    mirror = topo.dp_group()
    return {"calls": calls, "backend": dist.get_backend(mirror), "members": dist.get_process_group_ranks(mirror)}


def test_trainer_dp_group_is_mirrored_on_gloo(tmp_path):
    results = launch(_trainer_groups_are_mirrored, 4, str(tmp_path))
    assert [r["calls"] for r in results] == [0] * 4
    assert {r["backend"] for r in results} == {"gloo"}
    assert [sorted(r["members"]) for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _largest_object_payloads(rank: int, world: int, root: str):
    """Saves a ZeRO state with 1 MiB optimizer slices per rank in the torch format, recording object sizes."""
    sizes: list[int] = []
    for name in ("gather_object", "all_gather_object", "broadcast_object_list"):
        original = getattr(dist, name)

        def recording(first, *args, _original=original, **kwargs):
            sizes.append(len(pickle.dumps(first)))
            return _original(first, *args, **kwargs)

        setattr(dist, name, recording)

    class RecordingPickle:  # shardpoint's own object collectives (parallel/comm.py) pickle through this
        HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
        loads = staticmethod(pickle.loads)

        @staticmethod
        def dumps(obj, protocol=None):
            data = pickle.dumps(obj, protocol)
            sizes.append(len(data))
            return data

    comm.pickle = RecordingPickle
    topo = sp.Topology(1, 1, world)
    state = toy.build(topo, zero=True, hidden=256)
    toy.train_step(state, 1)
    saved = toy.optimizer_state(state)
    slice_bytes = sum(t.nbytes for per in saved.values() for t in per.values() if t.dim())
    sp.Checkpointer(root, topology=topo, format="torch").save(1, state)
    loaded = toy.build(topo, zero=True, hidden=256)
    sp.Checkpointer(root, topology=topo, format="torch").load(loaded)
    got = toy.optimizer_state(loaded)
    same = all(torch.equal(t, got[key][n]) for key, per in saved.items() for n, t in per.items())
    return {"largest": max(sizes), "slice_bytes": slice_bytes, "same": same}


def test_torch_format_moves_no_optimizer_slice_through_object_collectives(tmp_path):
    """Finding 1: each dp rank writes its own slice; only small objects cross ranks."""
    results = launch(_largest_object_payloads, 2, str(tmp_path))
    assert all(r["slice_bytes"] > 1 << 20 and r["same"] for r in results)
    assert max(r["largest"] for r in results) < 64 * 1024, results
    folder = tmp_path / "iter_0000001" / "mp_rank_00"
    assert sorted(p.name for p in folder.iterdir()) == ["dp_rank_0000.pt", "dp_rank_0001.pt", "model_optim_rng.pt"]


def _rank0_works_alone(rank: int, world: int, root: str):
    topo = sp.Topology(1, 1, world)
    toy.seed_rng(topo)
    state = toy.build(topo)
    ckpt = sp.Checkpointer(root, topology=topo, keep_last=1)
    for step in (1, 2, 3):  # each save waits for the previous one's deletion, stalled on rank 0
        toy.train_step(state, step)
        ckpt.save(step, state)
    ckpt.close()
    return sp.Checkpointer(root, topology=topo).load(toy.build(topo)).iteration


def test_rank0_alone_outlasts_a_short_default_group_timeout(tmp_path):
    """Rank 0 deletes for 8 s while the others wait; the default group would give up after 4 s."""
    env = {
        "SP_TEST_BACKEND": "gloo",  # the timeout alone, apart from the strict checks
        "SP_TEST_TIMEOUT": "4",
        "SHARDPOINT_FAULT": "point=mid-retention,rank=0,action=stall,seconds=8",
    }
    assert launch(_rank0_works_alone, 2, str(tmp_path), env=env) == [3, 3]


def test_one_process_needs_no_control_group():
    assert comm.control_group() is None
    assert comm.all_gather(5) == [5]


class _Devices:
    """A stand-in for ``torch.cuda`` with a chosen number of visible devices (CPU generators)."""

    def __init__(self, count: int, current: int):
        self.generators = [torch.Generator().manual_seed(100 + i) for i in range(count)]
        self.current = current

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return self.current

    def get_rng_state(self) -> torch.Tensor:
        return self.generators[self.current].get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generators[self.current].set_state(state)


def test_cuda_rng_is_the_current_devices_and_resumes_with_fewer_visible():
    """Saved on local rank 1 of 8 visible GPUs, resumed where only its own GPU is visible (cuda:0)."""
    at_save = _Devices(count=8, current=1)
    state = rng.capture(cuda=at_save)
    assert isinstance(state["cuda"], torch.Tensor)  # one state, not one per visible device
    expected = torch.randn(4, generator=at_save.generators[1])
    at_resume = _Devices(count=1, current=0)
    rng.restore(state, cuda=at_resume)
    assert torch.equal(torch.randn(4, generator=at_resume.generators[0]), expected)


def test_older_per_device_rng_states_restore_the_current_devices_entry():
    old = [torch.Generator().manual_seed(7 + i).get_state() for i in range(4)]
    state = rng.capture(cuda=_Devices(count=1, current=0))
    state["cuda"] = old
    at_resume = _Devices(count=4, current=2)
    rng.restore(state, cuda=at_resume)
    assert torch.equal(at_resume.generators[2].get_state(), old[2])
    assert not torch.equal(at_resume.generators[1].get_state(), old[1])  # the other devices are not touched


def test_snapshot_synchronises_every_device_its_tensors_live_on():
    tensors = [torch.zeros(1), torch.zeros(1, device="meta"), torch.zeros(2, device="meta")]
    assert devices.devices_of(tensors) == [torch.device("meta")]
    assert devices.synchronize([torch.zeros(1)]) == []  # CPU only: nothing to wait for
