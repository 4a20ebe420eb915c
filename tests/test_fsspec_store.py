"""Any fsspec filesystem as shardpoint storage (issue 58 #5): ``memory://`` and a registered one, real fsspec.

``ordered://`` is fsspec's MemoryFileSystem registered under its own name with each
finished write noted, so the test sees the order the commit protocol writes in.
"""

from __future__ import annotations

import logging

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import shardpoint as sp
from shardpoint.cli import main as cli
from shardpoint.errors import StorageError
from shardpoint.storage import fsspec_store
from shardpoint.storage.base import open_storage


class _Noted(dict):
    """A filesystem's files, noting each path as its write is committed."""

    written: list[str] = []

    def __setitem__(self, path, file):
        super().__setitem__(path, file)
        self.written.append(path)


class OrderedMemory(MemoryFileSystem):
    """fsspec's memory filesystem under another protocol, with files apart from memory://'s, writes noted."""

    protocol = "ordered"
    store = _Noted()
    pseudo_dirs = [""]
    written = _Noted.written


fsspec.register_implementation("ordered", OrderedMemory, clobber=True)


def _state(seed: int) -> sp.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return sp.TrainState(model=model, optimizer=opt)


def test_a_save_writes_data_then_the_marker_then_the_tracker_and_loads_back(caplog, monkeypatch):
    monkeypatch.setattr(fsspec_store, "_WARNED", set())
    OrderedMemory.written.clear()
    saved = _state(0)
    with caplog.at_level(logging.WARNING, "shardpoint.storage.fsspec_store"):
        with sp.Checkpointer("ordered://run/ckpt") as ckpt:
            ckpt.save(10, saved)
        loaded = _state(1)
        result = sp.Checkpointer("ordered://run/ckpt").load(loaded)
    assert result.iteration == 10
    for a, b in zip(saved.model.parameters(), loaded.model.parameters()):
        assert torch.equal(a, b)

    written = [p.split("://")[-1].lstrip("/") for p in OrderedMemory.written]
    files = [p for p in written if p.startswith("run/ckpt/iter_0000010/")]
    assert files[-1] == "run/ckpt/iter_0000010/shardpoint.json", written
    assert len(files) > 2  # the data files, every one before the marker
    assert written[-1] == "run/ckpt/latest_checkpointed_iteration.txt", written

    # one warning for the scheme, naming the guarantees it cannot give, however many storages were opened
    warnings = [r.getMessage() for r in caplog.records if "ordered://" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "create-only write" in warnings[0] and "durable" in warnings[0]


def test_the_marker_is_written_create_only_and_unknown_schemes_are_refused_by_name():
    storage = open_storage("memory://create-only/ckpt")
    storage.write_new("memory://create-only/ckpt/x/shardpoint.json", b"{}")
    with pytest.raises(FileExistsError):
        storage.write_new("memory://create-only/ckpt/x/shardpoint.json", b"{}")
    storage.remove("memory://create-only/ckpt")
    with pytest.raises(StorageError, match=r"nosuch://x/y: unsupported URL scheme \(no fsspec filesystem knows it\)"):
        open_storage("nosuch://x/y")


def test_the_cli_verifies_a_checkpoint_on_memory(capsys):
    with sp.Checkpointer("memory://cli-run/ckpt") as ckpt:
        ckpt.save(3, _state(0))
    assert cli(["verify", "memory://cli-run/ckpt"]) == 0
    out = capsys.readouterr().out
    assert "iter_0000003" in out or "3" in out, out
    fsspec.filesystem("memory").rm("/cli-run", recursive=True)
