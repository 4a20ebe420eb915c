"""Crafted or unusual foreign files: accepted when valid, otherwise a named CorruptCheckpointError.

Issue 34 items 10 and 11. Every case is what a file from someone else can hold: a valid
safetensors file the library accepts, a header nested to exhaust the parser, an index naming
files outside its directory, an index too large to read, and Megatron distributed-optimizer
checkpoints whose args and buckets disagree. None may surface as a raw Python error.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

import shardpoint as sp
from shardpoint.catalog.untrusted_json import MAX_JSON_BYTES
from shardpoint.errors import CorruptCheckpointError
from shardpoint.foreign import megatron_torch_dist, read_foreign
from shardpoint.foreign._unpickle import load_foreign, save_foreign
from shardpoint.foreign.hf_files import read_hf_dir
from tests.test_foreign_distopt import DISTOPT, STEP_DIR, copy_ckpt


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


class _Three(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.c = torch.nn.Parameter(torch.zeros(3))
        self.z = torch.nn.Parameter(torch.zeros(0))


def test_a_zero_size_tensor_listed_after_one_at_the_same_offset_loads(tmp_path):
    header = {
        "a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]},
        "c": {"dtype": "F32", "shape": [3], "data_offsets": [8, 20]},
        "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},  # listed after c, starts where c starts
    }
    data = struct.pack("<d", 2.5) + struct.pack("<3f", 1, 2, 3)
    _write_safetensors(tmp_path / "model.safetensors", header, data)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:  # the safetensors library accepts it
        assert f.get_tensor("z").numel() == 0
    model = _Three()
    sp.load_hf_weights(model, tmp_path)
    assert model.a.item() == 2.5 and model.c.tolist() == [1, 2, 3]


def test_a_header_nested_to_exhaust_the_parser_is_named(tmp_path):
    deep = b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors.*nests deeper"):
        sp.load_hf_weights(_Three(), tmp_path)


def _index(directory: Path, weight_map: dict) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text("{}")


@pytest.mark.parametrize("file", ["", "model\x00.safetensors", "/etc/hostname", "..", "../model.safetensors"])
def test_an_index_naming_a_file_outside_its_directory_is_refused(tmp_path, file):
    _index(tmp_path, {"a": file, "c": "model-00001-of-00001.safetensors"})
    with pytest.raises(CorruptCheckpointError, match=r"index\.json names file .*not a file name inside"):
        sp.load_hf_weights(_Three(), tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"index\.json names file .*not a file name inside"):
        read_hf_dir(tmp_path)  # the converter's reader (convert --from hf)


def test_an_index_too_large_to_be_real_is_refused_unread(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    with open(index, "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)  # sparse: costs no disk
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CorruptCheckpointError, match=r"index\.json.*more than .*refusing to read it"):
        sp.load_hf_weights(_Three(), tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"index\.json.*more than .*refusing to read it"):
        read_hf_dir(tmp_path)


def test_megatron_args_that_disagree_with_the_layers_present_are_named(tmp_path, monkeypatch):
    root = copy_ckpt(tmp_path)
    common_path = root / STEP_DIR / "common.pt"
    common = load_foreign(common_path)
    common["args"].num_layers = 1  # the checkpoint holds layers 0 and 1
    os.unlink(common_path)
    save_foreign(common, common_path)
    with pytest.raises(CorruptCheckpointError, match=r"should have 1 layers"):  # stacked layers: named on read
        read_foreign(root)
    # Layers stored one by one (decoder.layers.N.*, no stacking to check) reach the bucket decoder as they are.
    decode = megatron_torch_dist.decode_buckets

    def args_saying_one_layer(where, args, *rest):
        return decode(where, SimpleNamespace(**{**vars(args), "num_layers": 1}), *rest)

    monkeypatch.setattr(megatron_torch_dist, "decode_buckets", args_saying_one_layer)
    with pytest.raises(CorruptCheckpointError, match=r"holds decoder\.layers\.1\..*num_layers=1"):
        read_foreign(DISTOPT)


def test_megatron_buckets_with_a_gap_are_named(monkeypatch):
    split = megatron_torch_dist.split_buckets

    def with_a_gap(state):
        """The checkpoint as if its first bucket were stored as bucket_idx_3 (a gap at 0)."""
        chains = split(state)  # {chained optimizer: {(group, gbuf, dtype, bucket): tensors}}
        buckets = chains[0]
        first = min(buckets)
        buckets[(*first[:3], 3)] = buckets.pop(first)
        return chains

    monkeypatch.setattr(megatron_torch_dist, "split_buckets", with_a_gap)
    with pytest.raises(CorruptCheckpointError, match=r"bucket indices .* have gaps \(no bucket_idx_0\)"):
        read_foreign(DISTOPT)
