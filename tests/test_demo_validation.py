"""GPT-NeoX's forward-pass validation catches weights that checksums cannot.

The damage is done to a tensor inside its DCP file *and* the file's checksum in
``shardpoint.json`` is recomputed, as if the bytes had gone wrong before the
checksum was taken (bad host memory, a buggy conversion tool): integrity checks
pass, only the logits of the fixed batch can tell.
"""

from __future__ import annotations

import io
import os

import torch

import shardpoint as sp
from shardpoint.catalog.integrity import record_file
from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.demo.trainer import TrainConfig, Trainer
from shardpoint.formats.dist import SafeFileSystemReader
from shardpoint.storage.base import open_storage
from tests.distributed import launch
from tests.test_demo_training import config

LAYOUT = (1, 2, 1)


def _run(rank: int, world: int, cfg: TrainConfig) -> str | None:
    try:
        Trainer(cfg).run()
    except sp.ValidationError as exc:
        return str(exc)
    return None


def _alter_tensor_keeping_checksums(checkpoint: str, key: str) -> None:
    """Rewrite ``key``'s values in place inside its .distcp file, then re-record that file's checksum."""
    metadata = SafeFileSystemReader(checkpoint).read_metadata()
    [info] = [info for index, info in metadata.storage_data.items() if index.fqn == key]
    path = os.path.join(checkpoint, info.relative_path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    blob = bytes(data[info.offset : info.offset + info.length])
    tensor = torch.load(io.BytesIO(blob), weights_only=True)
    old, new = tensor.numpy().tobytes(), (tensor * 0.5 + 0.25).numpy().tobytes()
    at = info.offset + blob.index(old)
    data[at : at + len(old)] = new
    with open(path, "wb") as f:
        f.write(data)
    marker = os.path.join(checkpoint, MARKER_NAME)
    with open(marker) as f:
        meta = CheckpointMetadata.from_json(f.read(), marker)
    meta.files[info.relative_path] = record_file(open_storage(checkpoint), path)
    with open(marker, "w") as f:
        f.write(meta.to_json())


def test_forward_validation_rejects_altered_weights(tmp_path):
    root = str(tmp_path / "run")
    assert launch(_run, 2, config(root, LAYOUT, train_iters=2)) == [None, None]
    _alter_tensor_keeping_checksums(f"{root}/iter_0000002", "model.decoder.final_layernorm.weight")
    errors = launch(_run, 2, config(root, LAYOUT, train_iters=4))
    assert all(e is not None for e in errors), "every rank must raise, not only the one holding the logits"
    assert "forward-pass validation failed" in errors[0] and "iter_0000002" in errors[0]
    assert not (tmp_path / "run" / "iter_0000003").exists()
    # The damage is invisible to the checksums: without validation the same checkpoint loads and trains on.
    assert launch(_run, 2, config(root, LAYOUT, train_iters=3, validate_forward=False)) == [None, None]
