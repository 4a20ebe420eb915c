"""Worst days: damaged files, full or read-only disks, a second writer, crafted pickles, bad markers."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint.storage.lock import LockedError
from tests.test_checkpointer import assert_same, make_state, train

FORMATS = ["dist", "torch"]


def two_checkpoints(root: Path, fmt: str) -> tuple[sp.TrainState, sp.TrainState]:
    ckpt = sp.Checkpointer(root, format=fmt)
    first = make_state()
    train(first)
    ckpt.save(1, first)
    second = make_state(seed=1)
    train(second)
    ckpt.save(2, second)
    ckpt.close()
    return first, second


def data_file(directory: Path) -> Path:
    """The biggest data file of a checkpoint (where model weights live)."""
    marker = json.loads((directory / "shardpoint.json").read_text())
    name = max(marker["files"], key=lambda n: marker["files"][n]["size"])
    return directory / name


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped": (flip_byte, "checksum mismatch"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "truncated"),
    "missing": (lambda p: p.unlink(), "missing"),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_file_is_detected_and_fallback_loads_previous(tmp_path, fmt, damage):
    first, _ = two_checkpoints(tmp_path, fmt)
    victim = data_file(tmp_path / "iter_0000002")
    apply, words = DAMAGE[damage]
    apply(victim)
    with pytest.raises(sp.CorruptCheckpointError, match=words) as info:
        sp.Checkpointer(tmp_path).load(make_state(5))
    assert victim.name in str(info.value)
    fresh = make_state(5)
    result = sp.Checkpointer(tmp_path).load(fresh, fallback=True)
    assert result.iteration == 1
    assert_same(first, fresh)


def test_verify_false_skips_checksums_but_not_sizes(tmp_path):
    two_checkpoints(tmp_path, "dist")
    victim = data_file(tmp_path / "iter_0000002")
    victim.write_bytes(victim.read_bytes() + b"extra")
    with pytest.raises(sp.CorruptCheckpointError, match="size"):
        sp.Checkpointer(tmp_path, verify=False).load(make_state())


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda text: text[: len(text) // 2], "not valid JSON"),
        (lambda text: text.replace('"format_version": 1', '"format_version": 99'), "newer than this shardpoint"),
        (lambda text: text.replace('"format": "dist"', '"format": "pickle"'), "unknown format"),
        (lambda text: text.replace('"iteration": 2', '"iteration": "two"'), "'iteration' should be an integer"),
        (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "topology"}), "missing the field"),
        (lambda text: "[1, 2]", "not a JSON object"),
    ],
    ids=["truncated", "future-version", "unknown-format", "wrong-type", "missing-field", "not-object"],
)
def test_bad_marker_is_a_clear_error(tmp_path, edit, match):
    two_checkpoints(tmp_path, "dist")
    marker = tmp_path / "iter_0000002" / "shardpoint.json"
    marker.write_text(edit(marker.read_text()))
    with pytest.raises(sp.CorruptCheckpointError, match=match) as info:
        sp.Checkpointer(tmp_path).load(make_state())
    assert "shardpoint.json" in str(info.value)


# ----------------------------------------------------------------- full disk
@pytest.fixture
def small_fs(tmp_path):
    """A 3 MiB tmpfs, or skip where mounting is not allowed (non-root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the injected-fault test covers ENOSPC")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def big_state(megabytes: float) -> sp.TrainState:
    model = torch.nn.Linear(int(megabytes * 1e6 / 4 / 256), 256, bias=False)
    return sp.TrainState(model)


@pytest.mark.parametrize("fmt", FORMATS)
def test_too_big_save_is_refused_before_writing(small_fs, fmt):
    root = small_fs / "run"
    ckpt = sp.Checkpointer(root, format=fmt)
    ckpt.save(1, big_state(0.5))
    with pytest.raises(sp.StorageError, match=r"not enough space.*GB needed.*GB free"):
        ckpt.save(2, big_state(4))
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert sorted(os.listdir(root)) == [".shardpoint.lock", "iter_0000001", "latest_checkpointed_iteration.txt"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # DCP writer threads
@pytest.mark.parametrize("fmt", FORMATS)
def test_disk_filling_up_mid_save_loses_nothing(small_fs, fmt, monkeypatch):
    root = small_fs / "run"
    ckpt = sp.Checkpointer(root, format=fmt)
    kept = big_state(0.5)
    ckpt.save(1, kept)
    ballast = small_fs / "ballast"

    def fill_disk():  # another process eats the space while the save waits at "before-data"
        time.sleep(0.2)
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        ballast.write_bytes(b"\0" * (free - 200_000))

    monkeypatch.setenv("SHARDPOINT_FAULT", "point=before-data,rank=0,action=stall,seconds=0.6")
    filler = threading.Thread(target=fill_disk)
    filler.start()
    with pytest.raises(sp.StorageError, match="no space left on device") as info:
        ckpt.save(2, big_state(1))
    filler.join()
    assert "GB free" in str(info.value)
    monkeypatch.delenv("SHARDPOINT_FAULT")
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not any(n.startswith(".shardpoint-tmp") for n in os.listdir(root))  # partial files removed
    fresh = big_state(0.5)
    assert sp.Checkpointer(root).load(fresh).iteration == 1
    assert torch.equal(fresh.model.weight, kept.model.weight)
    ballast.unlink()
    ckpt.save(3, big_state(1))  # after space is freed the next save works
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_read_only_filesystem(small_fs):
    root = small_fs / "run"
    sp.Checkpointer(root).save(1, big_state(0.1))
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(sp.StorageError, match="read-only filesystem"):
        sp.Checkpointer(root).save(2, big_state(0.1))
    assert sp.Checkpointer(root).load(big_state(0.1)).iteration == 1


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("code,match", [("EACCES", "permission denied"), ("ENOSPC", "no space left")])
def test_injected_os_errors_are_clear_and_recoverable(tmp_path, monkeypatch, fmt, code, match):
    first, _ = two_checkpoints(tmp_path, fmt)
    ckpt = sp.Checkpointer(tmp_path, format=fmt)
    monkeypatch.setenv("SHARDPOINT_FAULT", f"point=mid-data,rank=0,action=raise,errno={code}")
    with pytest.raises(sp.StorageError, match=match):
        ckpt.save(3, first)
    monkeypatch.delenv("SHARDPOINT_FAULT")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not any(n.startswith(".shardpoint-tmp") for n in os.listdir(tmp_path))
    ckpt.save(3, first)  # training code caught it and carries on
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_failed_retention_does_not_fail_the_save(tmp_path, monkeypatch):
    ckpt = sp.Checkpointer(tmp_path, keep_last=1)
    ckpt.save(1, make_state())
    monkeypatch.setenv("SHARDPOINT_FAULT", "point=during-retention,rank=0,action=raise")
    ckpt.save(2, make_state())
    ckpt.wait()
    assert (tmp_path / "iter_0000001").exists()  # retention skipped, with a warning
    monkeypatch.delenv("SHARDPOINT_FAULT")
    ckpt.save(3, make_state())
    ckpt.wait()
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003"]


# ------------------------------------------------------------- one writer
HOLDER = """
import sys, time, torch, shardpoint as sp
ckpt = sp.Checkpointer(sys.argv[1])
ckpt.save(1, sp.TrainState(torch.nn.Linear(2, 2)))
print("saved", flush=True)
time.sleep(60)
"""


def test_second_writer_is_refused_with_the_holder_named(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "saved"
        with pytest.raises(LockedError, match=f"pid.*{holder.pid}"):
            sp.Checkpointer(tmp_path).save(2, make_state())
        assert sp.Checkpointer(tmp_path).load(sp.TrainState(torch.nn.Linear(2, 2))).iteration == 1  # reading is fine
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing anything: its lock is taken over
    assert json.loads((tmp_path / ".shardpoint.lock").read_text())["pid"] == holder.pid
    sp.Checkpointer(tmp_path).save(2, sp.TrainState(torch.nn.Linear(2, 2)))
    assert json.loads((tmp_path / ".shardpoint.lock").read_text())["pid"] == os.getpid()


def test_a_holder_in_this_same_process_is_named_as_such(tmp_path):
    first = sp.Checkpointer(tmp_path)
    first.save(1, sp.TrainState(torch.nn.Linear(2, 2)))  # holds the lock until closed
    with pytest.raises(LockedError, match=rf"this same process \(pid {os.getpid()}\).*close\(\) it first"):
        sp.Checkpointer(tmp_path).save(2, make_state())
    first.close()
    sp.Checkpointer(tmp_path).save(2, sp.TrainState(torch.nn.Linear(2, 2)))  # released: taken


# ------------------------------------------------------------ safe loading
class Exploit:
    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def rewrite_checksums(directory: Path) -> None:
    """What an attacker would do: make the marker vouch for the crafted files."""
    from shardpoint.catalog.integrity import record_file
    from shardpoint.storage.base import LocalStorage

    marker_path = directory / "shardpoint.json"
    marker = json.loads(marker_path.read_text())
    for name in list(marker["files"]):
        if not (directory / name).exists():  # a file the attacker removed: the marker stops listing it
            del marker["files"][name]
            continue
        record = record_file(LocalStorage(directory), str(directory / name))
        marker["files"][name] = {"size": record.size, "xxh3_64": record.xxh3_64}
    marker_path.write_text(json.dumps(marker))


def test_pickle_payload_in_torch_file_never_runs(tmp_path):
    sp.Checkpointer(tmp_path, format="torch").save(1, make_state())
    evidence = tmp_path / "pwned"
    target = tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    payload = torch.load(target, weights_only=True)
    payload["common"]["extra"]["note"] = Exploit(str(evidence))
    torch.save(payload, target)
    rewrite_checksums(tmp_path / "iter_0000001")
    with pytest.raises(sp.UnsafeCheckpointError, match="model_optim_rng.pt"):
        sp.Checkpointer(tmp_path).load(make_state())
    assert not evidence.exists()


def test_pickle_payload_in_dcp_metadata_never_runs(tmp_path):
    sp.Checkpointer(tmp_path, format="dist").save(1, make_state())
    evidence = tmp_path / "pwned"
    (tmp_path / "iter_0000001" / ".metadata").write_bytes(pickle.dumps(Exploit(str(evidence))))
    rewrite_checksums(tmp_path / "iter_0000001")
    # the chunk index records the .metadata written with it: the load is refused before anything is unpickled
    with pytest.raises(sp.CorruptCheckpointError, match=r"\.chunk_index"):
        sp.Checkpointer(tmp_path).load(make_state())
    assert not evidence.exists()
    # without the index (removed too), .metadata goes through the restricted unpickler, which refuses it
    (tmp_path / "iter_0000001" / ".chunk_index").unlink()
    (tmp_path / "iter_0000001" / ".chunk_rows").unlink()
    rewrite_checksums(tmp_path / "iter_0000001")
    with pytest.raises(sp.UnsafeCheckpointError, match=r"\.metadata asks to load posix.system"):
        sp.Checkpointer(tmp_path).load(make_state())
    assert not evidence.exists()
    # plain pickle would have run it: the payload is real
    pickle.loads((tmp_path / "iter_0000001" / ".metadata").read_bytes())
    assert evidence.exists()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # DCP writer threads
def test_a_failing_extra_writer_thread_fails_the_save(tmp_path, monkeypatch):
    """DCP drops exceptions of its extra writer threads; the save must not commit without their tensors."""
    from shardpoint.catalog.integrity import HashingWriter
    from shardpoint.formats import shares

    monkeypatch.setattr(shares, "LARGE_ITEM_BYTES", 0)  # a tiny state still gets its second writer thread
    monkeypatch.setattr(shares, "THREAD_MIN_BYTES", 1)
    real_write = HashingWriter.write

    def write_failing_off_main_thread(self, data):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(28, "No space left on device")
        return real_write(self, data)

    ckpt = sp.Checkpointer(tmp_path, thread_count=2)
    state = make_state()
    ckpt.save(1, state)
    monkeypatch.setattr(HashingWriter, "write", write_failing_off_main_thread)
    with pytest.raises(sp.StorageError):
        ckpt.save(2, state)
    monkeypatch.undo()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not (tmp_path / "iter_0000002").exists()
    assert sp.Checkpointer(tmp_path).load(make_state(3)).iteration == 1


class _WithOrder(torch.nn.Module):
    """A module whose buffer's size is data (a sampler's order), as transformers' tests build one."""

    def __init__(self, n: int):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("data_order", torch.arange(n))


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_a_size_difference_is_named_as_one_not_as_damage(tmp_path, fmt):
    with sp.Checkpointer(str(tmp_path), format=fmt) as ckpt:
        ckpt.save(1, sp.TrainState(model=_WithOrder(12)))
    with sp.Checkpointer(str(tmp_path), format=fmt) as ckpt, pytest.raises(sp.ShapeMismatchError) as error:
        ckpt.load(sp.TrainState(model=_WithOrder(0)))
    assert not isinstance(error.value, sp.CorruptCheckpointError)
    assert "'model.data_order' has" in str(error.value) and "(12,)" in str(error.value) and "(0,)" in str(error.value)
    assert "another size" in str(error.value)


class _ResizingOrder(_WithOrder):
    """A module that takes its buffer at the saved size, as modules whose state is data do."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        saved = state_dict.get(prefix + "data_order")
        if saved is not None and saved.shape != self.data_order.shape:
            self.data_order = torch.empty_like(saved)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_a_module_whose_state_changes_size_loads_through_its_own_load_state_dict(tmp_path, fmt):
    saved = _ResizingOrder(12)
    saved.data_order = torch.randperm(12)
    with sp.Checkpointer(str(tmp_path), format=fmt) as ckpt:
        ckpt.save(1, sp.TrainState(model=saved))
    model = _ResizingOrder(0)
    with sp.Checkpointer(str(tmp_path), format=fmt) as ckpt:
        ckpt.load(sp.TrainState(model=model), strict=True)
    assert torch.equal(model.data_order, saved.data_order)
    assert torch.equal(model.lin.weight, saved.lin.weight)  # the other tensors still load in place
