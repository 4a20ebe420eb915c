"""Crafted pickles inside Megatron-LM, DeepSpeed and torch_dist files raise and run nothing."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardpoint.errors import UnsafeCheckpointError
from shardpoint.foreign import read_foreign
from shardpoint.foreign._unpickle import load_foreign, save_foreign

FIXTURES = Path(__file__).parent / "fixtures" / "foreign"


class Evil:
    """Unpickling this with plain pickle would create the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def copy_fixture(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name / "ckpt", dst)
    for path in dst.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dst


def plant(path: Path, key: str, marker: Path) -> None:
    """Rewrite a copied file with an Evil object under ``key`` (everything else as the tool wrote it)."""
    state = load_foreign(path)
    state[key] = Evil(marker)
    path.unlink()
    save_foreign(state, path)  # the tools' own classes go back under their names; Evil as os.system


def test_megatron_file_with_a_crafted_object_raises_and_runs_nothing(tmp_path):
    root = copy_fixture("megatron-legacy-tp2", tmp_path)
    marker = tmp_path / "pwned"
    plant(root / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt", "args", marker)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system") as info:
        read_foreign(root)
    assert "mp_rank_01/model_optim_rng.pt" in str(info.value)
    assert not marker.exists()


def test_deepspeed_zero_file_with_a_crafted_object_raises_and_runs_nothing(tmp_path):
    root = copy_fixture("deepspeed-zero1-dp2", tmp_path)
    marker = tmp_path / "pwned"
    plant(root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", "ds_config", marker)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        read_foreign(root)
    assert not marker.exists()


def test_torch_dist_sharded_object_bytes_with_a_crafted_object_raise(tmp_path):
    root = copy_fixture("megatron-torchdist-tp2", tmp_path)
    step = root / "iter_0000002"
    marker = tmp_path / "pwned"
    for path in step.glob("__*.distcp"):
        path.unlink()
    (step / ".metadata").unlink()
    # a DCP checkpoint whose "rng_state" object is a crafted pickle (DCP stores objects with torch.save)
    state = {"embedding.word_embeddings.weight": torch.zeros(128, 64), "rng_state/shard_0.0_1.1": Evil(marker)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(step)), no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        read_foreign(root)
    assert not marker.exists()


def test_a_harmless_class_outside_the_allow_list_is_refused_by_name(tmp_path):
    import datetime

    path = tmp_path / "x.pt"
    torch.save({"when": datetime.date(2024, 1, 1)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"datetime\.date"):
        load_foreign(path)


def test_stand_ins_never_import_the_tools_and_write_back_under_their_names(tmp_path):
    before = set(sys.modules)  # the integrations' tests may have imported the tools in this worker already
    state = load_foreign(FIXTURES / "megatron-legacy-tp1/ckpt/iter_0000002/mp_rank_00/model_optim_rng.pt")
    imported = set(sys.modules) - before
    assert not any(m == "megatron" or m.startswith(("megatron.", "deepspeed")) for m in imported), imported
    assert repr(state["args"].attention_backend) == "megatron.core.transformer.enums.AttnBackend(5)"
    save_foreign(state, tmp_path / "again.pt")
    again = load_foreign(tmp_path / "again.pt")
    assert vars(again["args"]) == vars(state["args"])


def test_a_megatron_checkpoint_is_recognised_whatever_this_process_registered_as_safe():
    """megatron-core registers argparse.Namespace with torch's safe globals when imported; detection must not care."""
    import argparse

    from shardpoint.foreign.importer import find_foreign

    ckpt = FIXTURES / "megatron-legacy-tp1/ckpt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        assert find_foreign(ckpt) == str(ckpt / "iter_0000002")
        assert argparse.Namespace in torch.serialization.get_safe_globals()  # the registry is left as it was


def test_a_real_enum_registered_by_megatron_still_reads_as_the_stand_in(tmp_path):
    """megatron-core registers its AttnBackend as safe; torch's registry is a set, so which one is built is chance."""
    enums = pytest.importorskip("megatron.core.transformer.enums")
    path = FIXTURES / "megatron-legacy-tp1/ckpt/iter_0000002/mp_rank_00/model_optim_rng.pt"
    with torch.serialization.safe_globals([enums.AttnBackend, enums.ModelType]):
        state = load_foreign(path)
    assert repr(state["args"].attention_backend) == "megatron.core.transformer.enums.AttnBackend(5)"
    save_foreign(state, tmp_path / "again.pt")
    assert vars(load_foreign(tmp_path / "again.pt")["args"]) == vars(state["args"])
