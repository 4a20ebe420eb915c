"""A reader opens only what the checkpoint lists, and sizes nothing from a crafted number (DESIGN invariant 16).

Issue 54 defects 7, 10 and 11. Each checkpoint here is real (saved by shardpoint, or a
Megatron fixture), then changed the way an attacker or a damaged disk would: its
``.metadata`` names another run's file (with the marker's record of ``.metadata``
updated to match, so only the check of what it names can catch it), a stored length or
a tensor size far past the file, a marker naming a file beside the checkpoint or an
absolute path, a marker with a number past Python's digit limit. Every reader (``load``
on two ranks, ``verify``, ``inspect``, the offline reader) must refuse by name, open
nothing outside, allocate nothing from the crafted number, and a damaged newest
checkpoint must leave ``load(fallback=True)`` to the one before.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint.catalog.integrity import record_file
from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.errors import CorruptCheckpointError
from shardpoint.storage.base import LocalStorage
from shardpoint.storage.safe_io import load_dcp_metadata
from tests import toy
from tests.distributed import launch
from tests.test_cli_commands import run_cli

SOLO = sp.Topology(1, 1, 1)
IT1 = "iter_0000001"


def _save(root: Path, fill: float, iterations: tuple[int, ...] = (1,)) -> dict[str, torch.Tensor]:
    """A one-rank checkpoint per iteration of a toy model filled with ``fill + iteration``; the last weights."""
    state = toy.build(SOLO)
    ckpt = sp.Checkpointer(str(root), topology=SOLO)
    for it in iterations:
        with torch.no_grad():
            for p in state.model.parameters():
                p.fill_(fill + it)
        ckpt.save(it, state)
    ckpt.close()
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


def _craft_metadata(checkpoint: Path, change) -> None:
    """Rewrite ``.metadata`` through ``change(metadata)`` and the marker's record of it, as an attacker would.

    The chunk index (both files) goes too (a load would plan from it and refuse it as recording
    another ``.metadata``, ``tests/test_chunk_index.py``): loads then plan from the
    crafted ``.metadata``, as for checkpoints written before the index.
    """
    path = checkpoint / ".metadata"
    metadata = change(load_dcp_metadata(path.read_bytes(), str(path)))
    path.write_bytes(pickle.dumps(metadata))
    for name in (".chunk_index", ".chunk_rows"):
        (checkpoint / name).unlink(missing_ok=True)
        _craft_marker(checkpoint, lambda m, name=name: m["files"].pop(name, None))
    _craft_marker(checkpoint, lambda m: m["files"].update({".metadata": _record(path)}))


def _craft_marker(checkpoint: Path, change) -> None:
    marker = json.loads((checkpoint / MARKER_NAME).read_text())
    change(marker)
    (checkpoint / MARKER_NAME).write_text(json.dumps(marker))


def _record(path: Path) -> dict:
    record = record_file(LocalStorage("/"), str(path))
    return {"size": record.size, "xxh3_64": record.xxh3_64}


def _storage_records(change):
    """A ``.metadata`` change applied to every storage record (DCP's ``_StorageInfo``)."""

    def apply(metadata):
        records = {index: change(info) for index, info in metadata.storage_data.items()}
        return dataclasses.replace(metadata, storage_data=records)

    return apply


# ----------------------------------------------------------------- files outside (defect 7)


def _every_reader(rank: int, world: int, root: str, outside: str) -> dict:
    """Each reader of the crafted checkpoint, with every file opened under ``outside`` recorded."""
    seen: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event in ("open", "os.stat", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes)):
            target = os.path.abspath(os.fsdecode(args[0]))
            if target.startswith(outside):
                seen.append(f"{event} {target}")

    sys.addaudithook(hook)
    outcomes = {}
    for verify in (True, False):
        try:
            topo = sp.Topology(1, 1, world)
            sp.Checkpointer(root, topology=topo, verify=verify).load(toy.build(topo))
            outcomes[f"load verify={verify}"] = "loaded"
        except sp.CheckpointError as exc:
            outcomes[f"load verify={verify}"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        from shardpoint import offline
        from shardpoint.commands.verify import check_checkpoint

        report = check_checkpoint(IT1, f"{root}/{IT1}")
        outcomes["verify"] = "ok" if report["ok"] else json.dumps(report["problems"])
        for name, read in (("read_full", offline.read_full), ("describe_tensors", _describe)):
            try:
                read(f"{root}/{IT1}", verify=False)
                outcomes[name] = "read"
            except sp.CheckpointError as exc:
                outcomes[name] = f"{type(exc).__name__}: {exc}"
    return {"outcomes": outcomes, "seen": seen}


def _describe(path: str, verify: bool) -> None:
    from shardpoint import offline

    offline.describe_tensors(path, offline.resolve(path)[1])


def test_a_metadata_naming_another_runs_file_is_refused_by_every_reader_which_never_opens_it(tmp_path):
    root, outside = tmp_path / "run", tmp_path / "elsewhere" / "private_run"
    _save(root, 1.0)
    _save(outside, 7.0)  # another run's weights, which the crafted .metadata points at
    escape = f"../../elsewhere/private_run/{IT1}/"
    _craft_metadata(
        root / IT1, _storage_records(lambda info: dataclasses.replace(info, relative_path=escape + info.relative_path))
    )
    results = launch(_every_reader, 2, str(root), str(outside))
    for rank, result in enumerate(results):
        assert result["seen"] == [], f"rank {rank} opened files outside the checkpoint: {result['seen']}"
        for reader, outcome in result["outcomes"].items():
            assert outcome.startswith("CorruptCheckpointError") or reader == "verify", (reader, outcome)
            assert "__0_0.distcp" in outcome and "does not list" in outcome, (reader, outcome)


def test_validation_logits_naming_a_file_outside_the_checkpoint_are_refused(tmp_path):
    root = tmp_path / "run"
    _save(root, 1.0)
    secret = tmp_path / "secret.pt"
    torch.save({"private": torch.ones(3)}, secret)
    for name in (str(secret), "../../secret.pt", "common.pt/../../../secret.pt", "not_listed.pt"):
        _craft_marker(root / IT1, lambda m, name=name: m.update(validation_logits=name))
        with pytest.raises(CorruptCheckpointError, match=r"validation_logits names .*not one of the checkpoint's own"):
            sp.Checkpointer(str(root), topology=SOLO).load(toy.build(SOLO)).read_validation_logits()


def test_verify_tells_nothing_of_a_file_beside_the_checkpoint_that_a_crafted_marker_lists(tmp_path):
    root = tmp_path / "run"
    _save(root, 1.0)
    (root / "notes").mkdir()
    (root / "notes" / "diary.txt").write_text("x" * 1234)  # not a checkpoint: no marker, not held
    _craft_marker(root / IT1, lambda m: m["files"].update({"../notes/diary.txt": {"size": 1, "xxh3_64": "0"}}))
    result = run_cli("verify", root, "--json")
    assert result.rc == 1, result.err
    (problem,) = result.json()["checkpoints"][0]["problems"]
    assert problem["file"] == "../notes/diary.txt" and "not a checkpoint beside this one" in problem["problem"]
    assert "1234" not in result.out + result.err  # its size is not told
    with pytest.raises(CorruptCheckpointError, match=r"\.\./notes/diary\.txt: refers to \.\./notes"):
        sp.Checkpointer(str(root), topology=SOLO).load(toy.build(SOLO))


def test_a_stored_once_reference_to_a_sibling_checkpoint_still_loads_and_verifies(tmp_path):
    """The references dedup writes (``../iter_0000001/__0_0.distcp``) are what the rules above allow."""
    root = tmp_path / "run"
    state = toy.build(SOLO)
    for p in state.model.parameters():
        p.requires_grad_(False)  # frozen: the second save refers to the first's bytes
    ckpt = sp.Checkpointer(str(root), topology=SOLO)
    ckpt.save(1, state)
    ckpt.save(2, state)
    ckpt.close()
    marker = json.loads((root / "iter_0000002" / MARKER_NAME).read_text())
    assert f"../{IT1}/__0_0.distcp" in marker["files"]
    assert run_cli("verify", root, "--all").rc == 0
    result = sp.Checkpointer(str(root), topology=SOLO).load(toy.build(SOLO))
    assert result.iteration == 2


# ----------------------------------------------------------------- sizes from crafted numbers (defect 10)


def test_a_crafted_length_is_refused_before_any_buffer_is_sized_from_it(tmp_path):
    root = tmp_path / "run"
    _save(root, 1.0)
    huge = 512 << 20  # the checkpoint holds ~60 KB
    _craft_metadata(root / IT1, _storage_records(lambda info: dataclasses.replace(info, length=huge)))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError) as refused:
            state = toy.build(SOLO)
            state.model.double()  # another dtype: items go through the read buffer, not straight into the targets
            sp.Checkpointer(str(root), topology=SOLO).load(state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"the load allocated {peak} bytes for a crafted length"
    assert refused.match(r"\.metadata places stored bytes of __0_0\.distcp up to byte \d+, past its \d+ bytes")
    result = run_cli("verify", root, "--json")
    assert result.rc == 1 and "past its" in result.out


def test_a_crafted_tensor_size_is_refused_before_the_offline_reader_allocates_it(tmp_path):
    root = tmp_path / "run"
    _save(root, 1.0)

    def huge_tensor(metadata):
        key = "model.embed.weight"
        md = metadata.state_dict_metadata[key]
        tensors = dict(metadata.state_dict_metadata)
        tensors[key] = dataclasses.replace(md, size=torch.Size([1 << 40, 8]))
        return dataclasses.replace(metadata, state_dict_metadata=tensors)

    _craft_metadata(root / IT1, huge_tensor)
    from shardpoint import offline

    with pytest.raises(CorruptCheckpointError, match=r"'model\.embed\.weight' \(size \(1099511627776, 8\)\).*more"):
        offline.read_full(str(root))


def test_a_megatron_torch_dist_size_past_its_files_is_refused_before_allocation(tmp_path):
    from shardpoint.foreign import read_foreign
    from tests.test_foreign_distopt import DISTOPT

    root = tmp_path / "megatron"
    shutil.copytree(DISTOPT, root)
    (step,) = [p for p in root.iterdir() if p.is_dir()]
    path = step / ".metadata"
    from shardpoint.foreign._unpickle import load_dcp_metadata_foreign

    metadata = load_dcp_metadata_foreign(path.read_bytes(), str(path))
    key = next(k for k, md in metadata.state_dict_metadata.items() if hasattr(md, "chunks"))
    tensors = dict(metadata.state_dict_metadata)
    tensors[key] = dataclasses.replace(tensors[key], size=torch.Size([1 << 40, *tensors[key].size[1:]]))
    path.write_bytes(pickle.dumps(dataclasses.replace(metadata, state_dict_metadata=tensors)))
    with pytest.raises(CorruptCheckpointError, match=r"more tensor bytes than the \d+ bytes stored"):
        read_foreign(root)


# ----------------------------------------------------------------- a damaged newest marker (defect 11)


@pytest.mark.parametrize("damage", ["digits", "truncated"])
def test_a_damaged_newest_marker_falls_back_and_is_reported_as_damaged(tmp_path, damage):
    root = tmp_path / "run"
    _save(root, 1.0, iterations=(1,))
    saved = _save(root, 1.0, iterations=(2,))  # iteration 2's weights are 3.0: iteration 1's are 2.0
    newest = root / "iter_0000002" / MARKER_NAME
    text = newest.read_text()
    newest.write_text(text.replace('"consumed_samples": 0', '"consumed_samples": 1' + "0" * 5000))
    if damage == "truncated":
        newest.write_text(text[: len(text) // 2])
    assert newest.read_text() != text
    with pytest.raises(CorruptCheckpointError, match=r"iter_0000002/shardpoint\.json"):
        sp.Checkpointer(str(root), topology=SOLO).load(toy.build(SOLO))
    state = toy.build(SOLO)
    result = sp.Checkpointer(str(root), topology=SOLO).load(state, fallback=True)
    assert result.iteration == 1 and result.path.endswith(IT1)
    for key, tensor in state.model.state_dict().items():
        assert torch.equal(tensor, torch.full_like(saved[key], 2.0)), key
    for command in (("inspect", root), ("verify", root, "--all"), ("prune", root, "--keep-last", "5", "--dry-run")):
        result = run_cli(*command)
        assert result.rc in (0, 1) and "Traceback" not in result.err, (command, result.rc, result.err)
        assert "iter_0000002" in result.out + result.err, (command, result.out)  # prune: refuses, naming it
    assert run_cli("verify", root, "--all").rc == 1
