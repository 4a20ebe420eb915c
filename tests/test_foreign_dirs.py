"""A save never replaces a directory another tool wrote (issue 34, item 2).

On local disk a save of iteration N used to move an existing ``N`` directory aside and
delete it, whoever wrote it. Now a target that exists and holds no shardpoint marker is
refused before any rank writes a byte, with a :class:`ForeignDataError` naming the path
and what it holds; the files stay as they were. What shardpoint committed itself is
still replaced, as before. (Accelerate's own ``checkpoint_0``: tests/test_accelerate_dropin.py.)
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint.catalog.layout import named
from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.lifecycle.node_local import NODE_MARKER
from shardpoint.lifecycle.references import HELD_NOTE
from shardpoint.storage.base import OWN_MARKERS, ForeignDataError, LocalStorage
from shardpoint.tier.marker import LOCAL_MARKER
from tests import distributed

MEGATRON = Path(__file__).parent / "fixtures" / "foreign" / "megatron-legacy-tp1" / "ckpt" / "iter_0000002"


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with the hash of its bytes (a file: just itself)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def state() -> sp.TrainState:
    model = torch.nn.Linear(4, 4)
    return sp.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters()))


def test_marker_names_agree_with_the_modules_that_write_them():
    assert OWN_MARKERS == (MARKER_NAME, NODE_MARKER, LOCAL_MARKER, HELD_NOTE)


def _stock_trainer_checkpoint(path: Path) -> None:
    path.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state.pth"):
        (path / name).write_bytes(name.encode() * 10)


def _lightning_file(path: Path) -> None:
    path.write_bytes(b"a checkpoint Lightning's own torch.save wrote")


# (layout, directory name of iteration 2, how another tool left it there, a name the error must give)
FOREIGN = [
    ("megatron", "iter_0000002", lambda p: shutil.copytree(MEGATRON, p), "mp_rank_00"),
    ("neox", "global_step2", lambda p: shutil.copytree(MEGATRON, p), "mp_rank_00"),
    ("hf", "checkpoint-2", _stock_trainer_checkpoint, "trainer_state.json"),
    (named("epoch=0-step=2.ckpt"), "epoch=0-step=2.ckpt", _lightning_file, "is a file"),
]


@pytest.mark.parametrize("layout, name, make, shown", FOREIGN, ids=["megatron", "neox", "hf", "lightning"])
def test_a_save_over_another_tools_directory_is_refused_and_deletes_nothing(tmp_path, layout, name, make, shown):
    target = tmp_path / name
    make(target)
    before = tree(target)
    ckpt = sp.Checkpointer(tmp_path, layout=layout)
    with pytest.raises(ForeignDataError) as info:
        ckpt.save(2, state())
    message = str(info.value)
    assert str(target) in message and shown in message and "never replaces" in message, message
    assert tree(target) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shardpoint-tmp")]  # nothing was written
    if isinstance(layout, str):  # (a Lightning path is one directory: its next save is refused too)
        ckpt.save(3, state())  # the Checkpointer still works
    ckpt.close()
    assert tree(target) == before


def test_shardpoints_own_checkpoint_is_still_replaced_and_an_empty_directory_taken(tmp_path):
    with sp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, state())
        first = (tmp_path / "iter_0000002" / MARKER_NAME).read_bytes()
        ckpt.save(2, state())  # today's rule: a re-save of an iteration replaces shardpoint's own copy
        assert (tmp_path / "iter_0000002" / MARKER_NAME).read_bytes() != first
        (tmp_path / "iter_0000005").mkdir()  # nothing in it to lose
        ckpt.save(5, state())
    assert (tmp_path / "iter_0000005" / MARKER_NAME).is_file()


def test_publish_dir_itself_refuses_to_replace_a_foreign_directory(tmp_path):
    """The rename is the step that would delete: it checks again, whoever calls it."""
    storage = LocalStorage(tmp_path)
    final, tmp = tmp_path / "iter_0000002", tmp_path / ".shardpoint-tmp-x"
    shutil.copytree(MEGATRON, final)
    tmp.mkdir()
    (tmp / MARKER_NAME).write_text("{}")
    before = tree(final)
    with pytest.raises(ForeignDataError, match="mp_rank_00"):
        storage.publish_dir(str(tmp), str(final))
    assert tree(final) == before and (tmp / MARKER_NAME).exists()
    (final / NODE_MARKER).write_text("{}")  # a node's part of a shardpoint checkpoint: replaceable
    storage.publish_dir(str(tmp), str(final))
    assert sorted(p.name for p in final.iterdir()) == [MARKER_NAME]


def _save_over_foreign(rank: int, world: int, root: str) -> tuple[str, str, str]:
    ckpt = sp.Checkpointer(root, topology=sp.Topology(1, 1, world, rank=rank))
    try:
        ckpt.save(2, state())
        refused = "saved"
    except sp.CheckpointError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    os.environ.pop("SHARDPOINT_FAULT")  # the fault was for the refused save only
    ckpt.save(3, state())  # every rank left the refused save together: the next one runs
    result = ckpt.load(state())
    ckpt.close()
    return refused, result.path, str(rank)


def test_every_rank_refuses_before_any_rank_writes(tmp_path):
    """2 gloo ranks; a fault that fails every rank's first data write shows whether any rank got that far."""
    target = tmp_path / "iter_0000002"
    shutil.copytree(MEGATRON, target)
    before = tree(target)
    env = {"SHARDPOINT_FAULT": "point=before-data,action=raise"}
    results = distributed.launch(_save_over_foreign, 2, str(tmp_path), env=env)
    for refused, loaded, rank in results:
        assert "iter_0000002" in refused and "before-data" not in refused, (rank, refused)
        assert loaded == str(tmp_path / "iter_0000003"), rank
    assert results[0][0].startswith("ForeignDataError") and "mp_rank_00" in results[0][0]
    assert tree(target) == before
