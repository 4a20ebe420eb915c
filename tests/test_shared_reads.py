"""Each stored byte is read once per load: data-parallel replicas split the reading and pass tensors on."""

from __future__ import annotations

import pytest
import torch

import shardpoint as sp
from shardpoint.catalog.metadata import CheckpointMetadata
from shardpoint.formats import shared_reads
from shardpoint.formats.read_plan import Needs, plan_reads, plan_sharing
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
    a, b, c, d = range(4)  # stored items, by position (formats.load_parts)
    files = ["f1", "f2", "f3", "f4"]
    # ranks 0 and 1 are replicas (need a, b, c); rank 2 needs c and d only
    needs = [{a: (100, True), b: (60, True), c: (50, True)}, {a: (100, True), b: (60, True), c: (50, True)}]
    needs.append({c: (50, True), d: (30, True)})
    readers = plan_reads(Needs.from_dicts(needs), files)
    assert readers == {"f1": 0, "f2": 1, "f3": 2, "f4": 2}  # f3: a three-way tie goes to the least loaded


def _reshard_with_budget(rank: int, world: int, root: str, budget: int | None):
    """Saved at tp=2·dp=2, loaded at tp=4: each rank needs half of two stored column chunks."""
    from shardpoint.formats import shared_reads

    if budget is not None:
        shared_reads.EXCHANGE_BUFFER_BYTES = budget
    topo = sp.Topology(4, 1, 1)
    state = toy.build(topo, zero=False)
    result = sp.Checkpointer(root, topology=topo).load(state)
    return {"bytes_read": result.bytes_read, "loaded": toy.snapshot(state)}


def _save_tp2_dp2(rank: int, world: int, root: str):
    topo = sp.Topology(2, 1, 2)
    toy.seed_rng(topo)
    state = toy.build(topo, zero=False)
    toy.train_step(state, 1)
    sp.Checkpointer(root, topology=topo).save(1, state)
    return toy.snapshot(state)


def test_the_exchange_buffer_is_bounded_and_a_load_past_the_bound_is_still_exact(tmp_path):
    """With no room for buffers, the ranks read what they need only in part themselves: exact, more reads."""
    saved = toy.assemble(launch(_save_tp2_dp2, 4, str(tmp_path)))
    stored = _stored_data_bytes(str(tmp_path))
    reads = {}
    for budget in (None, 0):
        loaded = launch(_reshard_with_budget, 4, str(tmp_path), budget)
        got = toy.assemble([r["loaded"] for r in loaded])
        assert got.keys() == saved.keys()
        for key in saved:
            assert torch.equal(got[key], saved[key]), (budget, key)
        reads[budget] = sum(r["bytes_read"] for r in loaded)
    assert reads[None] == stored  # within the default bound every stored byte is read once
    assert reads[0] > stored  # past it, partial needers read for themselves


def test_sharing_gives_no_rank_more_buffers_than_the_bound():
    a, b, c = range(3)
    files = ["f1", "f2", "f3"]
    sizes = {a: 100, b: 100, c: 100}
    # (stored bytes, exactly a target of the rank): rank 0 holds a, b and c whole; ranks 1 and 2 need parts
    needs = [{a: (100, True), b: (100, True), c: (100, True)}, {a: (100, False), b: (100, False)}, {b: (100, False)}]
    needs.append({c: (100, True)})
    needs = Needs.from_dicts(needs)
    assert plan_reads(needs, files) == {"f1": 0, "f2": 1, "f3": 3}
    # room enough: rank 1 reads b for ranks 0 and 2 (a buffer for it: b is not its target)
    assert plan_sharing(needs, files, sizes, 1000) == {a: [1], b: [0, 2], c: [0]}
    # room for one buffer: rank 1 receives a into one, so it cannot also hold b; every needer reads b itself
    assert plan_sharing(needs, files, sizes, 100) == {a: [1], b: [], c: [0]}
    # no room: only exact targets still travel (they cost no buffer)
    assert plan_sharing(needs, files, sizes, 0) == {a: [], b: [], c: [0]}


def _load_over_route(rank: int, world: int, root: str, route: str, tp: int):
    """Load what ``_save_tp2_dp2`` wrote at tp=``tp`` (dp = 4 / tp), recording the group of every chunk sent."""
    import torch.distributed as dist

    from shardpoint.formats.dist import DistFormat

    DistFormat.exchange_route = route
    groups: list[str] = []
    batch = dist.batch_isend_irecv

    def recording(ops):
        groups.extend("trainer" if op.group is dist.group.WORLD else "control" for op in ops)
        return batch(ops)

    dist.batch_isend_irecv = recording
    topo = sp.Topology(tp, 1, world // tp)
    state = toy.build(topo, zero=False)
    result = sp.Checkpointer(root, topology=topo).load(state)
    return {"bytes_read": result.bytes_read, "loaded": toy.snapshot(state), "groups": groups}


@pytest.mark.parametrize("tp", [2, 4], ids=["replicas-whole-targets", "reshard-partial-receives"])
@pytest.mark.parametrize("route", ["auto", "trainer"])
def test_chunks_travel_on_the_route_chosen_and_land_exactly(tmp_path, tp, route):
    """The device route (NCCL on GPUs) run on a gloo trainer group: same reads, same values, other group.

    ``auto`` with CPU targets keeps the control group; ``trainer`` posts the same
    transfers on the default group, after the all-reduce every rank joins.
    """
    saved = toy.assemble(launch(_save_tp2_dp2, 4, str(tmp_path)))
    loaded = launch(_load_over_route, 4, str(tmp_path), route, tp, backend="gloo")
    got = toy.assemble([r["loaded"] for r in loaded])
    assert got.keys() == saved.keys()
    for key in saved:
        assert torch.equal(got[key], saved[key]), key
    assert sum(r["bytes_read"] for r in loaded) == _stored_data_bytes(str(tmp_path))
    groups = {g for r in loaded for g in r["groups"]}
    assert groups == {"control" if route == "auto" else "trainer"}


def _fail_staging_on_rank_1(rank: int, world: int, root: str):
    from shardpoint.formats.shared_reads import Exchange

    stage = Exchange.stage

    def failing(self):
        if rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (staged on purpose)")
        stage(self)

    Exchange.stage = failing
    topo = sp.Topology(1, 1, world)
    try:
        sp.Checkpointer(root, topology=topo).load(toy.build(topo, zero=False))
    except sp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_staging_failure_on_one_rank_stops_every_rank_before_any_transfer(tmp_path):
    launch(_save_tp2_dp2, 4, str(tmp_path))
    outcomes = launch(_fail_staging_on_rank_1, 4, str(tmp_path))
    assert "out of memory" in outcomes[1] and "a file is damaged" not in outcomes[1]
    for rank in (0, 2, 3):
        assert "rank(s) [1]" in outcomes[rank] and "out of memory" in outcomes[rank], outcomes[rank]


def test_only_a_backend_that_moves_device_memory_itself_takes_the_device_route():
    from shardpoint.parallel.comm import moves_directly

    assert moves_directly("nccl", "cuda")
    assert moves_directly("cpu:gloo,cuda:nccl", "cuda")
    assert not moves_directly("cpu:gloo,cuda:nccl", "cpu")
    assert not moves_directly("gloo", "cuda")  # gloo stages CUDA tensors through host memory itself
    assert not moves_directly("gloo", "cpu")
    assert not moves_directly("nccl", "cpu")
    # without a process group every load takes the control route (one process, nothing travels)
    assert shared_reads.route_for([("cuda",), ("cuda",)]).trainer is False
    with pytest.raises(ValueError, match="exchange route 'nccl'"):
        shared_reads.route_for([("cpu",)], "nccl")


def test_the_keys_as_bits_say_the_same_as_names_would():
    """Keys as bits over the saved keys plus the unsaved ones: nothing lost on the way to rank 0."""
    from shardpoint.formats.base import wanted_keys, wanted_summary

    saved = sorted(f"model.w{i}" for i in range(13))
    asked = [{"model.w0", "model.w12", "model.new"}, {"model.w5"}, set(), {"optimizer.x", "model.w5"}]
    union = wanted_keys([wanted_summary(keys, saved) for keys in asked], saved)
    assert union == set().union(*asked)


def _reference_reads(needs: list[dict], files: list[str]) -> dict[str, int]:
    """The planner as first written, a dict per rank: what the columnar one must answer."""
    wanted: dict[str, dict[int, int]] = {}
    for rank, items in enumerate(needs):
        for at, (nbytes, _) in items.items():
            per_rank = wanted.setdefault(files[at], {})
            per_rank[rank] = per_rank.get(rank, 0) + nbytes
    load, readers = [0] * len(needs), {}
    for name in sorted(wanted, key=lambda n: (-max(wanted[n].values()), n)):
        most = max(wanted[name].values())
        readers[name] = min((r for r, b in wanted[name].items() if b == most), key=lambda r: (load[r], r))
        load[readers[name]] += most
    return readers


def _reference_sharing(needs: list[dict], files: list[str], sizes: dict, budget: int, readers: dict) -> dict:
    needers: dict[int, list[int]] = {}
    for rank, rank_needs in enumerate(needs):
        for at in rank_needs:
            needers.setdefault(at, []).append(rank)
    held, receivers = [0] * len(needs), {}
    for at in sorted(needers):
        reader = readers[files[at]]
        others = [r for r in needers[at] if r != reader]
        if not others:
            continue
        cost = {r: 0 if needs[r].get(at, (0, False))[1] else sizes[at] for r in (reader, *others)}
        taken = []
        if held[reader] + cost[reader] <= budget:
            taken = [r for r in others if held[r] + cost[r] <= budget]
            for r in taken:
                held[r] += cost[r]
            if taken:
                held[reader] += cost[reader]
        receivers[at] = taken
    return receivers


def test_the_columnar_planner_answers_as_the_dict_planner_on_random_jobs():
    import random

    rng = random.Random(7)
    for _ in range(400):
        world, count = rng.randint(1, 9), rng.randint(1, 15)
        files = [f"f{rng.randrange(rng.randint(1, 5))}" for _ in range(count)]
        sizes = {at: rng.choice([10, 20, 30, 50]) for at in range(count)}
        needs = [
            {at: (sizes[at], rng.random() < 0.6) for at in range(count) if rng.random() < 0.5} for _ in range(world)
        ]
        columns = Needs.from_dicts(needs)
        readers = plan_reads(columns, files)
        assert readers == _reference_reads(needs, files)
        budget = rng.choice([0, 10, 30, 60, 1000])
        assert plan_sharing(columns, files, sizes, budget, readers) == _reference_sharing(
            needs, files, sizes, budget, readers
        )
