"""The fast save/load path: zip CRC32 off for our files, one checked pass per file, no unpickling of items."""

from __future__ import annotations

import io
import json
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint.catalog.integrity import without_zip_crc32
from shardpoint.formats.base import write_torch_file
from shardpoint.formats.dcp_read import tensor_record
from shardpoint.formats.dist import SafeFileSystemReader
from tests.distributed import launch
from tests.test_checkpointer import assert_same, make_state, train


def _storage_records(path: Path) -> list[zipfile.ZipInfo]:
    return zipfile.ZipFile(path).infolist()


def _items(checkpoint: Path) -> dict[str, tuple[str, int, int]]:
    """DCP key -> (file, offset, length) of its (first) stored item."""
    metadata = SafeFileSystemReader(str(checkpoint)).read_metadata()
    return {
        index.fqn: (info.relative_path, info.offset, info.length)
        for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[1].offset, reverse=True)
    }


def _flip_item_byte(directory: Path, key: str, position: Callable[[int], int], mask: int = 0xFF) -> str:
    """Flip a byte of the stored item of ``key``, at ``position(item length)`` from its start; return its file."""
    name, offset, length = _items(directory)[key]
    victim = directory / name
    data = bytearray(victim.read_bytes())
    data[offset + position(length)] ^= mask
    victim.write_bytes(bytes(data))
    return name


def _trained_linear(seed: int, bias: bool = False) -> sp.TrainState:
    """A Linear(256, 128) and its Adam state after one step: a 128 KiB weight and two moments."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(256, 128, bias=bias)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    return sp.TrainState(model, optimizer)


def test_our_files_skip_zip_crc32_and_other_threads_keep_it(tmp_path):
    seen: dict[str, bool] = {}

    def user_save() -> None:  # another thread of the training process, saving meanwhile
        torch.save(torch.ones(1000), tmp_path / "user.pt")
        seen["after"] = torch.serialization.get_crc32_options()

    with without_zip_crc32():  # a user thread saving while one of our writes is open keeps its CRC32
        write_torch_file({"w": torch.ones(1000)}, str(tmp_path / "ours.pt"))
        thread = threading.Thread(target=user_save)
        thread.start()
        thread.join()
    ours = [r for r in _storage_records(tmp_path / "ours.pt") if "/data/" in r.filename]
    user = [r for r in _storage_records(tmp_path / "user.pt") if "/data/" in r.filename]
    assert ours and all(r.CRC == 0 for r in ours)
    assert user and all(r.CRC != 0 for r in user)
    assert torch.serialization.get_crc32_options() and seen["after"]  # this thread's setting is back
    assert torch.equal(torch.load(tmp_path / "ours.pt", weights_only=True)["w"], torch.ones(1000))


def test_dcp_items_are_written_without_crc32(tmp_path):
    state = make_state()
    train(state)
    sp.Checkpointer(tmp_path).save(1, state)
    name, offset, length = _items(tmp_path / "iter_0000001")["model.fc1.weight"]
    item = (tmp_path / "iter_0000001" / name).read_bytes()[offset : offset + length]
    records = [r for r in zipfile.ZipFile(io.BytesIO(item)).infolist() if "/data/" in r.filename]
    assert records and all(r.CRC == 0 for r in records)


def test_load_unpickles_no_item(tmp_path, monkeypatch):
    """Items of a checkpoint shardpoint wrote are decoded from their bytes, never through torch.load."""
    saved = make_state()
    train(saved)
    sp.Checkpointer(tmp_path).save(1, saved)
    real_load = torch.load

    def no_items(source, *args, **kwargs):
        if isinstance(source, io.BytesIO):
            raise AssertionError("an item was unpickled")
        return real_load(source, *args, **kwargs)

    monkeypatch.setattr(torch, "load", no_items)
    loaded = make_state(seed=3)
    sp.Checkpointer(tmp_path).load(loaded)
    assert_same(saved, loaded)


class _Transposed(torch.nn.Module):
    """A model whose state holds a non-contiguous tensor (a transposed view), larger than a reader's first buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Parameter(torch.arange(1100.0 * 1200).reshape(1100, 1200))

    def sharded_state_dict(self) -> dict:
        return {"base_t": self.base.data.t()}


def test_non_contiguous_tensors_round_trip(tmp_path):
    saved = _Transposed()
    sp.Checkpointer(tmp_path).save(1, sp.TrainState(saved))
    loaded = _Transposed()
    loaded.base.data.zero_()
    sp.Checkpointer(tmp_path).load(sp.TrainState(loaded))
    assert torch.equal(loaded.base, saved.base)


def test_tensor_record_finds_the_bytes_or_declines():
    buffer = io.BytesIO()
    torch.save(torch.arange(10, dtype=torch.int64), buffer)
    view = memoryview(bytearray(buffer.getvalue()))
    offset, size = tensor_record(view)
    assert size == 80
    assert torch.equal(torch.frombuffer(view[offset : offset + size], dtype=torch.int64), torch.arange(10))
    two = io.BytesIO()
    torch.save({"a": torch.ones(2), "b": torch.zeros(2)}, two)  # two storages: not a single item
    assert tensor_record(memoryview(two.getvalue())) is None
    assert tensor_record(memoryview(b"not a zip archive")) is None


def test_damaged_item_header_is_a_checksum_error_naming_the_file(tmp_path):
    """A flipped byte in an item's zip directory breaks decoding; the error is still the file's checksum."""
    state = make_state()
    train(state)
    sp.Checkpointer(tmp_path).save(1, state)
    # the item's end-of-central-directory signature: unreadable as a zip
    name = _flip_item_byte(tmp_path / "iter_0000001", "model.fc1.weight", lambda length: length - 22)
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch") as info:
        sp.Checkpointer(tmp_path).load(make_state(seed=3))
    assert name in str(info.value)


def test_a_data_file_no_rank_reads_is_still_verified(tmp_path, monkeypatch):
    """Loading without the optimizer skips files holding only optimizer state; they are checked anyway."""
    from shardpoint.formats import shares

    # two files: the weight and one moment in one, the other moment and the step in the other
    monkeypatch.setattr(shares, "LARGE_ITEM_BYTES", 0)  # tiny items count as large: two threads, two files
    monkeypatch.setattr(shares, "THREAD_MIN_BYTES", 1)
    sp.Checkpointer(tmp_path, thread_count=2).save(1, _trained_linear(0))
    directory = tmp_path / "iter_0000001"
    items = _items(directory)
    marker = json.loads((directory / "shardpoint.json").read_text())
    model_files = {f for key, (f, _, _) in items.items() if key.startswith("model.")}
    optimizer_only = sorted(n for n in marker["files"] if n.endswith(".distcp") and n not in model_files)
    assert optimizer_only, "the save should have put some optimizer state in a file of its own"
    victim = directory / optimizer_only[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch") as info:
        sp.Checkpointer(tmp_path).load(_trained_linear(3), load_optimizer=False)
    assert victim.name in str(info.value)


def _large_state(seed: int) -> sp.TrainState:
    torch.manual_seed(seed)
    return sp.TrainState(torch.nn.Linear(256, 128))  # a 128 KiB weight: read straight into its parameter


def test_large_tensors_are_read_straight_into_their_targets(tmp_path, monkeypatch):
    from shardpoint.formats import dcp_read

    saved = _large_state(0)
    sp.Checkpointer(tmp_path).save(1, saved)
    direct = []
    read_item = dcp_read.StreamingReads._read_item

    def spy(self, *args, **kwargs):
        result = read_item(self, *args, **kwargs)
        direct.append(result is None)
        return result

    monkeypatch.setattr(dcp_read.StreamingReads, "_read_item", spy)
    loaded = _large_state(1)
    sp.Checkpointer(tmp_path).load(loaded)
    assert torch.equal(loaded.model.weight, saved.model.weight) and torch.equal(loaded.model.bias, saved.model.bias)
    assert direct.count(True) == 1  # the weight; the small bias goes through the buffer


def test_flipped_byte_in_a_tensor_read_straight_into_its_target_is_detected(tmp_path):
    sp.Checkpointer(tmp_path).save(1, _large_state(0))
    name = _flip_item_byte(tmp_path / "iter_0000001", "model.weight", lambda length: length // 2, mask=0x01)
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch") as info:
        sp.Checkpointer(tmp_path).load(_large_state(1))
    assert name in str(info.value)


def test_gc_pauses_only_on_the_main_thread_and_comes_back():
    import gc

    from shardpoint.storage.safe_io import paused_gc

    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    seen = []

    def background() -> None:
        with paused_gc():
            seen.append(gc.isenabled())

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen == [True] and gc.isenabled()


def test_where_torch_keeps_the_crc_setting_process_wide_it_is_left_on(tmp_path, monkeypatch):
    from shardpoint.catalog import integrity

    monkeypatch.setattr(integrity, "_CRC_PER_THREAD", False)
    write_torch_file({"w": torch.ones(1000)}, str(tmp_path / "ours.pt"))
    assert all(r.CRC != 0 for r in _storage_records(tmp_path / "ours.pt") if "/data/" in r.filename)
    assert torch.serialization.get_crc32_options()


def _load_with_a_failing_rng_read(rank: int, world: int, root: str) -> str:
    from shardpoint.formats import dist as dist_format

    torch.manual_seed(0)
    sp.Checkpointer(root).save(1, sp.TrainState(torch.nn.Linear(8, 8)))
    if rank == 1:  # e.g. an object-store read that ran out of retries, on one rank only
        real = dist_format.read_torch_file

        def flaky(storage, path, *args, **kwargs):
            if "/rng/" in path:
                raise OSError(f"simulated read failure of {path}")
            return real(storage, path, *args, **kwargs)

        dist_format.read_torch_file = flaky
    try:
        sp.Checkpointer(root).load(sp.TrainState(torch.nn.Linear(8, 8)))
    except sp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_read_failing_on_one_rank_after_dcp_stops_every_rank(tmp_path):
    """No rank is left waiting in a later collective (the checksum gather) for one that failed."""
    results = launch(_load_with_a_failing_rng_read, 2, str(tmp_path), timeout=90)
    assert all(r.startswith("CheckpointError") and "simulated read failure" in r for r in results), results


def test_a_reused_reader_reads_the_metadata_of_the_checkpoint_it_is_reset_to(tmp_path):
    import torch.distributed.checkpoint as dcp

    first, second = tmp_path / "a", tmp_path / "b"
    dcp.save({"x": torch.full((100,), 7.0), "y": torch.full((4,), 1.0)}, checkpoint_id=str(first), no_dist=True)
    dcp.save({"y": torch.full((4,), 5.0), "x": torch.full((100,), 3.0)}, checkpoint_id=str(second), no_dist=True)
    reader = SafeFileSystemReader(str(first))
    reader.read_metadata()
    loaded = {"x": torch.zeros(100)}
    dcp.load(loaded, storage_reader=reader, checkpoint_id=str(second), no_dist=True)
    assert torch.equal(loaded["x"], torch.full((100,), 3.0))


def _zip_entry_field(item: bytes, suffix: bytes) -> int:
    """Offset, in a stored item, of the central-directory entry whose name ends with ``suffix``."""
    position = item.find(b"PK\x01\x02")
    while position >= 0:
        name_length = int.from_bytes(item[position + 28 : position + 30], "little")
        if item[position + 46 : position + 46 + name_length].endswith(suffix):
            return position
        position = item.find(b"PK\x01\x02", position + 1)
    raise AssertionError("no such entry")


@pytest.mark.parametrize("verify", [True, False])
def test_an_archive_zipfile_cannot_parse_falls_back_to_torch_load(tmp_path, verify):
    """A directory entry asking for a newer zip version: zipfile refuses it, torch.load reads the item."""
    saved = _large_state(0)
    sp.Checkpointer(tmp_path).save(1, saved)
    name, offset, length = _items(tmp_path / "iter_0000001")["model.weight"]
    victim = tmp_path / "iter_0000001" / name
    data = bytearray(victim.read_bytes())
    entry = offset + _zip_entry_field(bytes(data[offset : offset + length]), b"/data/0")
    data[entry + 6] = 0xFF  # "version needed to extract"
    victim.write_bytes(bytes(data))
    loaded = _large_state(1)
    if verify:
        with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch"):
            sp.Checkpointer(tmp_path).load(loaded)
    else:
        sp.Checkpointer(tmp_path, verify=False).load(loaded)
        assert torch.equal(loaded.model.weight, saved.model.weight)


def test_a_file_read_only_in_part_is_still_verified(tmp_path):
    """Loading the model only reads a third of the one data file; the rest is still checked."""
    sp.Checkpointer(tmp_path, thread_count=1).save(1, _trained_linear(0))
    directory = tmp_path / "iter_0000001"
    name = _flip_item_byte(directory, "optimizer.state.weight.exp_avg", lambda length: length // 2, mask=0x01)
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch") as info:
        sp.Checkpointer(tmp_path).load(sp.TrainState(torch.nn.Linear(256, 128, bias=False)), load_optimizer=False)
    assert name in str(info.value)
