"""Per-item costs out of the dist format: templated archives, batched writes, plans without per-item work.

Each fast path must give what the general one gives: the bytes ``torch.save`` writes,
the read items DCP plans, the fingerprint of the plan.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch

import shardpoint as sp
from shardpoint.catalog.integrity import without_zip_crc32
from shardpoint.formats.tensor_archive import TEMPLATE_MAX_BYTES, archive_parts, templated
from tests.counting import count_calls


def _every_kind() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(4, 4, generator=g).half(),
        "fp64": torch.randn(3, generator=g).double(),
        "int64": torch.arange(11),
        "int8": torch.randint(-100, 100, (9,), generator=g, dtype=torch.int8),
        "bool": torch.rand(13, generator=g) > 0.5,
        "zero_dim": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(6, 4, generator=g).T.clone(),  # dense, not contiguous
        "complex": torch.randn(3, dtype=torch.complex64, generator=g),
    }


def _torch_save(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    with without_zip_crc32():  # as DCP's writer streams write (see formats.dist)
        torch.save(tensor, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", list(_every_kind()))
def test_a_templated_archive_is_what_torch_save_writes(kind):
    tensor = _every_kind()[kind]
    assert templated(tensor)
    head, body, tail = archive_parts(tensor)
    archive = head + bytes(body) + tail
    assert archive == _torch_save(tensor)
    back = torch.load(io.BytesIO(archive), weights_only=True)
    assert torch.equal(back, tensor) and back.dtype == tensor.dtype and back.stride() == tensor.stride()
    # the template is cached by signature: other values of the same shape are their own bytes
    other = torch.zeros_like(tensor) if tensor.dtype != torch.bool else ~tensor
    head, body, tail = archive_parts(other)
    assert torch.equal(torch.load(io.BytesIO(head + bytes(body) + tail), weights_only=True), other)


def test_views_and_large_tensors_are_left_to_torch_save():
    base = torch.randn(100)
    assert not templated(base[10:20])  # torch.save writes the whole storage of a view
    assert not templated(base[:20])
    assert not templated(torch.nn.Parameter(torch.randn(3)))  # pickled as a Parameter
    assert not templated(torch.empty(TEMPLATE_MAX_BYTES // 4 + 1))


def _state(n: int) -> dict[str, torch.Tensor]:
    kinds = _every_kind()
    tensors = {f"{name}_{i}": t + i if t.dtype.is_floating_point else t for i in range(n) for name, t in kinds.items()}
    tensors["big"] = torch.randn(TEMPLATE_MAX_BYTES // 4 + 7)  # through torch.save, written straight
    tensors["view"] = torch.randn(50)[5:25]
    return tensors


class _Tensors(torch.nn.Module):
    """Buffers of every kind; ``sharded_state_dict`` so names and dtypes are kept as given."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.tensors = tensors

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors


_PLAIN_DCP = """
import json, sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
path = sys.argv[1]
meta = FileSystemReader(path).read_metadata()
state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
         if k.startswith("model.")}
dcp.load(state, checkpoint_id=path, no_dist=True)
assert "shardpoint" not in sys.modules
print(json.dumps({k: int(v.reshape(-1).view(torch.uint8).sum()) for k, v in state.items()}))
"""


def test_many_small_tensors_of_every_dtype_are_read_by_plain_dcp_and_torch_load(tmp_path):
    tensors = _state(40)
    ckpt = sp.Checkpointer(str(tmp_path), keep_last=2)
    for iteration in (1, 2):  # the second save replays the first one's plan
        ckpt.save(iteration, sp.TrainState(_Tensors(tensors)))
    ckpt.close()
    path = tmp_path / "iter_0000002"
    out = subprocess.run([sys.executable, "-c", _PLAIN_DCP, str(path)], capture_output=True, text=True, check=True)
    sums = json.loads(out.stdout)
    assert sums.keys() == {f"model.{k}" for k in tensors}
    for key, tensor in tensors.items():
        assert sums[f"model.{key}"] == int(tensor.reshape(-1).view(torch.uint8).sum()), key
    # every item is a torch.save archive of its own, at the offset .metadata records
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata()
    for index, info in meta.storage_data.items():
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            item = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        assert torch.equal(item, tensors[index.fqn.removeprefix("model.")]), index.fqn
    # and shardpoint loads it back
    loaded = {k: torch.zeros_like(t) for k, t in tensors.items()}
    sp.Checkpointer(str(tmp_path)).load(sp.TrainState(_Tensors(loaded)))
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())


def test_a_damaged_byte_in_a_batched_file_is_named(tmp_path):
    tensors = _state(20)
    with sp.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, sp.TrainState(_Tensors(tensors)))
    files = sorted((tmp_path / "iter_0000001").glob("*.distcp"), key=lambda p: p.stat().st_size)
    victim = files[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    loaded = {k: torch.zeros_like(t) for k, t in tensors.items()}
    with pytest.raises(sp.CorruptCheckpointError, match=victim.name):
        sp.Checkpointer(str(tmp_path)).load(sp.TrainState(_Tensors(loaded)))


def test_a_box_saved_as_wanted_is_read_with_the_item_dcp_plans():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from shardpoint.formats.dist import ShardLoadPlanner

    def chunk(offsets, sizes):
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    saved = [chunk((0, 0), (4, 6)), chunk((4, 0), (4, 6)), chunk((8, 0), (2, 6))]
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size((10, 6)), saved)
    scalar = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(()), [chunk((), ())])
    wanted = {"w": (md, chunk((4, 0), (4, 6))), "s": (scalar, chunk((), ()))}
    planner = ShardLoadPlanner({}, "here")
    for key, (meta, box) in wanted.items():
        tensor = torch.zeros(tuple(box.sizes))
        planner.shards = {key: sp.Shard(tensor, tuple(meta.size), tuple(box.offsets))}
        planner.metadata = type("M", (), {"state_dict_metadata": {key: meta}})()
        assert planner.create_local_plan().items == create_read_items_for_chunk_list(key, meta, [box]), key


def test_the_fingerprint_without_a_plan_is_the_plans():
    from shardpoint.formats.dist import DistFormat, ShardSavePlanner
    from shardpoint.formats.dist_replay import fingerprint
    from shardpoint.state.train_state import FlatState

    tensors = {
        "model.w": sp.Shard(torch.zeros(2, 3), (4, 3), (2, 0)),
        "model.b": sp.Shard(torch.zeros(3, dtype=torch.bfloat16), (3,), (0,)),
        "model.empty": sp.Shard(torch.zeros(0, 3), (4, 3), (4, 0)),  # an uneven FSDP piece: not written
        "optimizer.state.w.step": sp.Shard(torch.tensor(3.0), (), ()),
    }
    flat = FlatState(tensors, {}, {}, rank_local={"seen": torch.zeros(5)})
    shards = {**tensors, "rank_local.00000.seen": sp.Shard(torch.zeros(5), (5,), (0,))}
    plan = ShardSavePlanner(shards).create_local_plan()
    assert len(plan.items) == 4
    assert DistFormat().fingerprint(None, flat) == fingerprint(plan, 0, 1)


@pytest.mark.parametrize("damaged", [False, True], ids=["read-once", "damage-near-the-end"])
def test_a_tensor_read_straight_into_its_target_is_read_once_and_checked_whole(tmp_path, damaged):
    """Its last bytes come with the archive's end (read first, to locate the data): not read a second time."""
    tensors = {"w": torch.randn(64, 128), "big": torch.randn(TEMPLATE_MAX_BYTES // 4 + 7)}
    with sp.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, sp.TrainState(_Tensors(tensors)))
    files = list((tmp_path / "iter_0000001").glob("*.distcp"))
    loaded = {k: torch.zeros_like(t) for k, t in tensors.items()}
    if damaged:  # inside the tensor's last 4 KiB, before the archive's records and directory
        (victim,) = files
        data = bytearray(victim.read_bytes())
        data[len(data) - 2000] ^= 0xFF
        victim.write_bytes(bytes(data))
        with pytest.raises(sp.CorruptCheckpointError, match=victim.name):
            sp.Checkpointer(str(tmp_path)).load(sp.TrainState(_Tensors(loaded)))
        return
    result = sp.Checkpointer(str(tmp_path)).load(sp.TrainState(_Tensors(loaded)))
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())
    assert result.bytes_read == sum(f.stat().st_size for f in files)


# ------------------------------------------------------- counted: a load's planning per tensor
def _calls_per_tensor(run, small: int = 200, large: int = 400) -> float:
    """What one more tensor adds (the fixed cost cancels): ``run(n)`` prepares n tensors and returns the step."""
    steps = run(small), run(large)
    return (count_calls(steps[1]) - count_calls(steps[0])) / (large - small)


def _saved(n: int, saved_by: int):
    """The whole ``.metadata`` of n (8, 16) tensors saved by ``saved_by`` ranks, row bands of each."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    rows, tensors, storage = 8 // saved_by, {}, {}
    for i in range(n):
        key = f"model.t{i:05d}"
        chunks = [ChunkStorageMetadata(torch.Size((r * rows, 0)), torch.Size((rows, 16))) for r in range(saved_by)]
        tensors[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size((8, 16)), chunks)
        for r, chunk in enumerate(chunks):
            storage[MetadataIndex(key, chunk.offsets)] = _StorageInfo(f"__{r}_0.distcp", 600 * i, 600)
    return Metadata(tensors, storage_data=storage)


def _load_planning(world: int):
    """A load's planning at ``world`` ranks in one process, as ``DistFormat.load`` runs it (no process group).

    Each rank's boxes, rank 0's plan of every rank's part, and on each rank its part's
    DCP metadata and DCP's planner over it (the saved layout: rank r holds row band r).
    """
    from shardpoint.formats import load_parts
    from shardpoint.formats.base import wanted_summary
    from shardpoint.formats.dcp_metadata import outline_of
    from shardpoint.formats.dist import ShardLoadPlanner

    def run(n: int):
        whole, rows = _saved(n, world), 8 // world
        targets = [
            {f"model.t{i:05d}": sp.Shard(torch.zeros(rows, 16), (8, 16), (r * rows, 0)) for i in range(n)}
            for r in range(world)
        ]

        def step() -> None:
            outline = outline_of(whole)
            saved = sorted(outline.state_dict_metadata)
            requests = [
                load_parts.Request(wanted_summary(t, saved), *load_parts.boxes_of(t, outline, saved), ("cpu",))
                for t in targets
            ]
            parts = load_parts.plan(whole, requests, world > 1, 1 << 30, "here")
            for rank, (part, present) in enumerate(zip(parts, targets)):
                metadata, _ = part.metadata(outline, saved)
                planner = ShardLoadPlanner(present, "here")
                planner.set_up_planner({k: s.tensor for k, s in present.items()}, metadata, rank == 0)
                assert len(planner.create_local_plan().items) == n
                if part.shared:
                    part.assignment(rank)

        return step

    return run


@pytest.mark.parametrize("world", [1, 2])
def test_a_loads_planning_makes_a_few_calls_per_tensor_and_rank(world):
    """Counted: no Python step per tensor in the plan beyond DCP's planner's own (issue 59's regression).

    Measured per tensor and rank: 35 (about 25 of them DCP's planner and the objects it
    takes); 80 to 110 when rank 0 tested each tensor's boxes in a Python step of its own
    (2-3x ``torch.load``'s time on a rank of 10,000 small tensors).
    """
    per_tensor_and_rank = _calls_per_tensor(_load_planning(world)) / world
    assert per_tensor_and_rank <= 45, per_tensor_and_rank


def test_a_whole_load_makes_a_bounded_number_of_calls_per_tensor(tmp_path):
    """Counted end to end on one rank: planning, reads, checks and placing, per tensor (issue 59's regression).

    Measured: 150 before load parts, about 200 now (the bounds check of ``.metadata``'s
    items included), 295 with a Python step per tensor in the load's plan.
    """
    folders = iter(range(2))

    def run(n: int):
        root = tmp_path / str(next(folders))
        tensors = {f"t{i}": torch.full((16,), float(i)) for i in range(n)}
        with sp.Checkpointer(str(root)) as ckpt:
            ckpt.save(1, sp.TrainState(_Tensors(tensors)))
        loaded = {k: torch.zeros_like(t) for k, t in tensors.items()}
        loader = sp.Checkpointer(str(root))
        return lambda: loader.load(sp.TrainState(_Tensors(loaded)))

    per_tensor = _calls_per_tensor(run)
    assert per_tensor <= 240, per_tensor


_FIRST_LOAD = r"""
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/rendezvous", rank=0, world_size=1)
import shardpoint as sp
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
sp.Checkpointer(sys.argv[1] + "/run").save(1, sp.TrainState(model))
before = set(sys.modules)
sp.Checkpointer(sys.argv[1] + "/run").load(sp.TrainState(model))
print(sorted(m for m in set(sys.modules) - before if m.startswith("numpy")))
"""


def test_a_first_load_imports_no_numpy_ma(tmp_path):
    """Counted in a fresh process: ``np.unique`` imports ``numpy.ma`` on first use, 0.4 MB of reads a rank.

    The split plan's file and key counts used it; ``bench --scale`` read 1.05 bytes per
    stored byte, not 1.01 (``read_plan.distinct`` instead).
    """
    found = subprocess.run(
        [sys.executable, "-c", _FIRST_LOAD, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert found.stdout.strip().splitlines()[-1] == "[]", found.stdout


# ------------------------------------------------------- counted: the bounds check of .metadata per tensor
def _bounds_check(saved_by: int):
    """``check_stored_items`` over the ``.metadata`` of n tensors saved by ``saved_by`` ranks (rank 0, every load)."""
    from shardpoint.formats.dcp_metadata import check_stored_items

    def run(n: int):
        metadata = _saved(n, saved_by)
        return lambda: check_stored_items(metadata, lambda name: 600 * n, "here")

    return run


@pytest.mark.parametrize("saved_by", [1, 4])
def test_the_bounds_check_of_metadata_makes_no_python_call_per_tensor(saved_by):
    """Counted: every tensor and chunk of ``.metadata`` checked at once, in numpy (issue 59).

    Measured per tensor: 0 (C loops over the tensors and chunks); 45 at one chunk a
    tensor, 51 at four, when each tensor was checked in a Python step of its own.
    """
    per_tensor = _calls_per_tensor(_bounds_check(saved_by))
    assert per_tensor <= 1, per_tensor


@pytest.mark.parametrize(
    "damage,says",
    [
        ("size", r"'model\.t00002' \(size \(8, 4096\)\), \.metadata describes more tensor bytes than the 6000 bytes"),
        ("outside", r"places a chunk of 'model\.t00002' outside its size \(8, 16\)"),
        ("negative", r"gives a chunk of 'model\.t00002' a negative size"),
        ("float", r"gives 'model\.t00002' or one of its chunks a size or an offset that is not a count"),
        ("dims", r"gives 'model\.t00002' or one of its chunks a size or an offset that is not a count"),
    ],
)
def test_a_bad_tensor_in_metadata_is_named(damage, says):
    """The check runs over all tensors at once; a ``.metadata`` that fails it names the first bad tensor."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from shardpoint.formats.dcp_metadata import check_stored_items

    metadata = _saved(5, 2)
    md = metadata.state_dict_metadata["model.t00002"]
    chunk = md.chunks[1]
    if damage == "size":
        md = dataclasses.replace(md, size=torch.Size((8, 4096)))
    elif damage == "outside":
        md.chunks[1] = ChunkStorageMetadata(torch.Size((6, 0)), chunk.sizes)
    elif damage == "negative":
        md.chunks[1] = ChunkStorageMetadata(chunk.offsets, torch.Size((-4, 16)))
    elif damage == "float":
        md = dataclasses.replace(md, size=(8.0, 16))
    else:
        md.chunks[1] = ChunkStorageMetadata(torch.Size((4,)), torch.Size((4,)))
    metadata.state_dict_metadata["model.t00002"] = md
    check_stored_items(_saved(5, 2), lambda name: 3000, "here")  # the same, undamaged, passes
    with pytest.raises(sp.CorruptCheckpointError, match=says):
        check_stored_items(metadata, lambda name: 3000, "here")
