"""First saves without central planning (issue 36 item 3): local plans, ``.metadata`` from compact records.

* :func:`~shardpoint.formats.metadata_records.assemble` writes the pickle of the very
  ``Metadata`` DCP's own planner builds from the same plans: chunks, index hints,
  properties, storage records, every dtype and rank, 0-d tensors and offsets past 2**31;
* the records a rank sends are counted: well under 0.3 of the pickled plans DCP gathers;
* at 4 real ranks (tp=2 × dp=2, replicas and shards), the first save makes no DCP
  planning round, each replicated box is written once, plain ``dcp.load`` (no
  shardpoint planner or reader) reads every tensor exactly, and ``.metadata`` holds
  what ``dcp.save`` writes for the same state.
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import shardpoint as sp
from shardpoint.commands.scale import count_collectives
from shardpoint.formats.metadata_records import assemble, encode
from tests.distributed import launch

_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)


def _item(key: str, offset, size, shape, dtype, requires_grad=False) -> WriteItem:
    kind = WriteItemType.TENSOR if tuple(size) == tuple(shape) else WriteItemType.SHARD
    return WriteItem(
        index=MetadataIndex(key, torch.Size(offset)),
        type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(size)),
            properties=TensorProperties(dtype=dtype, requires_grad=requires_grad),
            size=torch.Size(shape),
        ),
    )


def _plans(world: int, params: int) -> list[SavePlan]:
    plans = []
    for rank in range(world):
        items = [_item(f"layers.{p}.w", (rank * 4, 0), (4, 3), (world * 4, 3), _DTYPES[p % 4]) for p in range(params)]
        items.append(_item("step", (), (), (), torch.float32))  # 0-d, whole on every rank
        items.append(_item(f"rank_local.{rank}.stat", (0, 0, 0), (2, 2, 2), (2, 2, 2), torch.float64, True))
        if rank == world - 1:
            big = 3 * 2**31  # offsets and lengths past int32
            items.append(_item("huge", (big,), (5,), (big + 5,), torch.uint8))
        plans.append(SavePlan(items))
    return plans


def _results(plans: list[SavePlan]) -> list[list[WriteResult]]:
    return [
        [
            WriteResult(item.index, 64, _StorageInfo(f"__{rank}_{i % 3}.distcp", i * 2**31 + 7, 64 + i))
            for i, item in enumerate(plan.items)
        ]
        for rank, plan in enumerate(plans)
    ]


def _dcp_metadata(plans, results):
    """What ``dcp.save`` builds on rank 0 for these plans and write results."""
    final, metadata = create_default_global_save_plan(plans)  # DefaultSavePlanner's, before validation
    metadata.storage_data = {
        item.index: result.storage_data
        for plan, written in zip(final, results)
        for item, result in zip(plan.items, written)
    }
    return final, metadata


def test_the_assembled_metadata_is_the_one_dcp_builds():
    world = 5
    plans = _plans(world, 7)
    plans[0].items[0] = _item("step", (), (), (), torch.float32)  # some rank lists a key first
    deduplicated = [SavePlan([i for i in p.items if i.index.fqn != "step" or r == 2]) for r, p in enumerate(plans)]
    results = _results(deduplicated)
    final, expected = _dcp_metadata(deduplicated, results)
    parts = [encode(p.items, r) for p, r in zip(deduplicated, results)]
    parts.insert(1, None)  # a rank with nothing to say
    data = b"".join(assemble(parts))
    found = pickle.loads(data)
    assert found.state_dict_metadata == expected.state_dict_metadata
    assert found.storage_data == expected.storage_data
    hints = {index: index.index for plan in final for index in (item.index for item in plan.items)}
    assert all(index.index == hints[index] for index in found.storage_data)  # DCP's index hints too
    assert (found.version, found.planner_data, found.storage_meta) == (CURRENT_DCP_VERSION, None, None)  # as finish
    assert len(data) < 1.1 * len(pickle.dumps(expected))  # about DCP's size: names written once, ints narrow


def test_the_records_are_a_small_part_of_the_plans_dcp_gathers():
    plans = _plans(64, 40)
    results = _results(plans)
    records = sum(encode(p.items, r).nbytes for p, r in zip(plans, results))
    gathered_by_dcp = len(pickle.dumps(plans)) + len(pickle.dumps(results))  # plans, then write results
    assert records <= 0.3 * len(pickle.dumps(plans)), (records, gathered_by_dcp)


def _first_save(rank: int, world: int, root: str):
    topo = sp.Topology(2, 1, world // 2)
    torch.manual_seed(0)  # every dp replica holds the same values
    tp = topo.tp_rank
    model = _TensorParallel(tp)
    state = sp.TrainState(model)
    calls = count_collectives()
    with sp.Checkpointer(os.path.join(root, "sp"), topology=topo, keep_last=0) as ckpt:
        before = sum(calls.values())
        ckpt.save(1, state)
        used = sum(calls.values()) - before
    # the same state through dcp.save's central planning, for comparison
    from shardpoint.formats.dist import ShardSavePlanner, _shards

    shards = {k: v for k, v in _shards(_flat(state), rank).items()}
    dcp.save(
        {k: s.tensor for k, s in shards.items()},
        checkpoint_id=os.path.join(root, "dcp"),
        planner=ShardSavePlanner(shards),
        process_group=torch.distributed.new_group(backend="gloo"),  # CPU tensors: not the (strict) default group
    )
    return {"calls": used}


def _flat(state):
    from shardpoint.state.train_state import collect

    return collect(state, iteration=1, include_rng=False)


class _TensorParallel(torch.nn.Module):
    """Column-parallel weights (sharded over tp) beside a replicated bias and norm (every rank)."""

    def __init__(self, tp_rank: int):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.full = {f"layers.{i}.w": torch.randn(8, 3, generator=g) for i in range(5)}
        self.bias = {f"layers.{i}.b": torch.randn(3, generator=g) for i in range(5)}
        self.tp_rank = tp_rank

    def sharded_state_dict(self):
        rows = slice(self.tp_rank * 4, (self.tp_rank + 1) * 4)
        out = {k: sp.Shard(v[rows], (8, 3), (self.tp_rank * 4, 0)) for k, v in self.full.items()}
        out.update(self.bias)
        return out


def _chunks_of(metadata) -> dict:
    """Each tensor's properties, size and chunks (sorted by offset) from a DCP ``Metadata``."""
    return {
        key: (md.properties, md.size, sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
        for key, md in metadata.state_dict_metadata.items()
    }


def test_a_first_save_at_four_ranks_needs_no_planning_round_and_plain_dcp_reads_it(tmp_path):
    results = launch(_first_save, 4, str(tmp_path))
    model = _TensorParallel(0)
    saved = sorted(p for p in os.listdir(tmp_path / "sp" / "iter_0000001") if p.endswith(".distcp"))
    assert saved  # every rank with something to write wrote its own files
    plain = {f"model.{k}": torch.zeros(8, 3) for k in model.full} | {f"model.{k}": torch.zeros(3) for k in model.bias}
    dcp.load(plain, checkpoint_id=str(tmp_path / "sp" / "iter_0000001"))  # no shardpoint planner, no reader
    for k, v in {**model.full, **model.bias}.items():
        assert torch.equal(plain[f"model.{k}"], v), k
    with open(tmp_path / "sp" / "iter_0000001" / ".metadata", "rb") as f:
        ours = pickle.load(f)
    with open(tmp_path / "dcp" / ".metadata", "rb") as f:
        theirs = pickle.load(f)
    # every chunk DCP writes; their order follows the writers, which rank 0 picks with arrays (state.box_table),
    # not with DCP's greedy one box at a time
    assert _chunks_of(ours) == _chunks_of(theirs)
    assert set(ours.storage_data) == set(theirs.storage_data)  # each box stored once
    bias_writers = {info.relative_path.split("_")[2] for i, info in ours.storage_data.items() if i.fqn.endswith(".b")}
    assert len(bias_writers) > 1  # boxes every rank holds are spread over the ranks, not all written by rank 0
    # shardpoint's own rounds only (dcp.save adds 13, test_coverage): the replica check's boxes and hashes each
    # go to rank 0 and back (a gather and a scatter each), so no rank receives every rank's boxes
    assert [r["calls"] for r in results] == [8] * 4


def _weigh_the_replica_rounds(rank: int, world: int, root: str):
    """A first save of tp=2 × dp=world/2 (shards and replicas), weighing what each rank receives in the replica check.

    The check's two exchanges (boxes, then hashes of the shared ones) are weighed as
    pickled, against what an all-gather of the same messages would give every rank.
    """
    from shardpoint.parallel import comm

    weighed = {"received": 0, "all-gathered": 0}
    scatter, gather = comm.scatter_from, comm.gather_to
    rounds = ("finding replicated tensors", "comparing replicated tensors")

    def weighed_gather(obj, dst, group=None, what="a collective round"):
        out = gather(obj, dst, group, what=what)
        if what in rounds:
            sizes = torch.tensor([len(pickle.dumps(obj))])
            torch.distributed.all_reduce(sizes)  # (default group: uncounted by the control group's rounds)
            weighed["all-gathered"] += int(sizes)
        return out

    def weighed_scatter(parts, *args, what="a collective round", **kwargs):
        out = scatter(parts, *args, what=what, **kwargs)
        if what in rounds:
            weighed["received"] += len(pickle.dumps(out))
        return out

    all_to_all = comm.all_to_all

    def weighed_all_to_all(payloads, group=None, what="a collective round"):  # planned by key (split_survey)
        out = all_to_all(payloads, group, what)
        if what in rounds:
            sizes = torch.tensor([sum(len(pickle.dumps(p)) for r, p in enumerate(payloads) if r != rank)])
            torch.distributed.all_reduce(sizes)  # (default group: uncounted by the control group's rounds)
            weighed["all-gathered"] += int(sizes)
            weighed["received"] += sum(len(pickle.dumps(p)) for r, p in enumerate(out) if r != rank)
        return out

    comm.scatter_from, comm.gather_to, comm.all_to_all = weighed_scatter, weighed_gather, weighed_all_to_all
    topo = sp.Topology(2, 1, world // 2)
    model = _Many(topo.tp_rank)
    sp.Checkpointer(root, topology=topo).save(1, sp.TrainState(model))
    plain = {f"model.{k}": torch.zeros(8, 3) for k in model.full} | {f"model.{k}": torch.zeros(3) for k in model.bias}
    torch.distributed.barrier()
    if rank == 0:
        dcp.load(plain, checkpoint_id=os.path.join(root, "iter_0000001"), no_dist=True)
    exact = rank != 0 or all(torch.equal(plain[f"model.{k}"], v) for k, v in {**model.full, **model.bias}.items())
    return {**weighed, "exact": exact}


class _Many(_TensorParallel):
    def __init__(self, tp_rank: int):
        super().__init__(tp_rank)
        g = torch.Generator().manual_seed(2)
        self.full = {f"layers.{i}.w": torch.randn(8, 3, generator=g) for i in range(40)}
        self.bias = {f"layers.{i}.b": torch.randn(3, generator=g) for i in range(40)}


def test_the_replica_check_sends_each_rank_its_own_answer_not_every_rank_s_boxes(tmp_path):
    """8 ranks × 80 boxes: each rank receives the boxes of the keys it checks and its answers, not every rank's boxes.

    Checked by key across ranks (state.split_survey), a rank receives every rank's boxes
    of its keys (an eighth of the job here, when the names hash evenly) and an answer
    from each planner; an all-gather gives every rank all of them.
    """
    results = launch(_weigh_the_replica_rounds, 8, str(tmp_path))
    assert all(r["exact"] for r in results)
    for r in results:
        assert 0 < r["received"] < 2.5 / 8 * r["all-gathered"], results
    assert sum(r["received"] for r in results) < 1.3 * results[0]["all-gathered"]  # the job's boxes about once
