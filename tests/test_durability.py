"""Files are durable when shardpoint says so: every ``fsync`` sees the whole file.

``os.fsync`` is wrapped to record the size the kernel holds for the file at that
moment; a flush missing before the sync shows as a size smaller than the final file
(before the fix: ``fsync(.metadata.tmp)`` with 0 of its 826 bytes written).
"""

from __future__ import annotations

import os
import re
import stat

import pytest

import shardpoint as sp
from tests.test_checkpointer import CONFIG, make_state, train


@pytest.fixture
def fsync_sizes(monkeypatch):
    """(path, size at fsync) for every regular file shardpoint fsyncs."""
    seen: list[tuple[str, int]] = []
    real = os.fsync

    def recording(fd):
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode):
            seen.append((os.readlink(f"/proc/self/fd/{fd}"), info.st_size))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return seen


_TMP_DIR = re.compile(r"\.shardpoint-tmp-(.+?)-[0-9a-f]{8}(?=/)")


def _final_size(path: str) -> int | None:
    """The size of the file once committed: the temporary directory renamed, ``.tmp`` names replaced."""
    final = _TMP_DIR.sub(lambda m: m.group(1), path)
    for candidate in (final, re.sub(r"\.tmp(-\d+)?$", "", final)):
        if os.path.isfile(candidate):
            return os.path.getsize(candidate)
    return None


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_every_fsync_sees_the_whole_file(tmp_path, fsync_sizes, fmt):
    state = make_state()
    ckpt = sp.Checkpointer(str(tmp_path / "run"), format=fmt, config=CONFIG, keep_last=None)
    for it in (1, 2, 3):  # the first save plans; the later ones replay the plan (dist_replay's .metadata)
        train(state)
        ckpt.save(it, state)
    ckpt.close()
    checked = [(p, size, _final_size(p)) for p, size in fsync_sizes]
    names = {os.path.basename(p) for p, _, final in checked if final is not None}
    expected = {".metadata.tmp", "shardpoint.json"} if fmt == "dist" else {"model_optim_rng.pt", "shardpoint.json"}
    assert expected <= {re.sub(r"\.tmp-\d+$", "", n) for n in names}, names
    short = [(p, size, final) for p, size, final in checked if final is not None and size != final]
    assert not short, f"fsynced before flushing (path, bytes on disk at fsync, final bytes): {short}"
