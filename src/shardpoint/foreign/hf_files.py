"""Hugging Face model directories on local disk: ``config.json`` and safetensors, single or sharded.

What ``save_pretrained`` writes and ``from_pretrained`` reads:

* ``config.json``;
* ``model.safetensors``, or, when the weights exceed ``max_shard_size``,
  ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``
  (``{"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}``). Tensors go
  to shards in order, a new shard when the next tensor would pass the limit (a
  tensor larger than the limit gets a shard of its own), as ``transformers`` does.

Writing: every file goes under a temporary name first and is renamed when all are
written (the index and config last), so an interrupted export leaves no half model;
files of the same names are replaced, and model files of another sharding that
would be left beside the new ones are refused rather than deleted (shardpoint
deletes only what it wrote).

Reading names the damaged file: an unreadable or inconsistent ``config.json`` or
index, a shard the index names that is missing, a safetensors file whose header
is garbled or that is shorter than its header says (``safetensors`` checks that the
data it describes is all there), a tensor the index places in a file that lacks it.
safetensors has no checksums, so flipped bytes inside tensor data are not detected.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from shardpoint.catalog.untrusted_json import check_member_name, read_json_object
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.storage.permissions import as_umask_allows

__all__ = ["CONFIG", "INDEX", "WEIGHTS", "parse_size", "read_hf_dir", "write_hf_dir"]

log = logging.getLogger(__name__)

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors$")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"`` (10^9, as transformers counts), ``"500MiB"`` (2^20) or an int.

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size).upper())
        if not match:
            raise ValueError(f"max_shard_size {size!r} is not a size such as '5GB' or '500MB'")
        value = int(float(match.group(1)) * _UNITS[match.group(2) or "B"])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _plan_shards(tensors: Mapping[str, torch.Tensor], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_hf_dir(
    out_dir: str | os.PathLike[str],
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    max_shard_size: int | str = "5GB",
) -> list[str]:
    """Write ``config.json`` and the weights (sharded with an index when large); return the files written.

    Raises:
        CheckpointError: ``out_dir`` holds model files of another sharding that would be left stale.
        ValueError: ``max_shard_size`` is not a size.
    """
    from safetensors.torch import save_file

    out = os.path.abspath(os.fspath(out_dir))
    shards = _plan_shards(tensors, parse_size(max_shard_size))
    count = len(shards)
    names = [WEIGHTS] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    os.makedirs(out, exist_ok=True)
    keep = set(names) | ({INDEX} if len(names) > 1 else set())
    stale = [n for n in os.listdir(out) if (n in (WEIGHTS, INDEX) or _SHARD.match(n)) and n not in keep]
    if stale:
        raise CheckpointError(
            f"{out} holds model files of an earlier export ({', '.join(sorted(stale)[:3])}) that this one would "
            "not replace; export into an empty directory or remove them"
        )
    payloads: dict[str, Any] = {}
    for name, members in zip(names, shards):
        payloads[name] = {k: tensors[k].detach().contiguous() for k in members}
    if len(names) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {k: name for name, members in zip(names, shards) for k in members}
        payloads[INDEX] = {"metadata": {"total_size": total}, "weight_map": weight_map}
    payloads[CONFIG] = dict(config)
    tmp = {name: os.path.join(out, f".{name}.tmp-{os.getpid()}") for name in payloads}
    try:
        for name, payload in payloads.items():
            if name.endswith(".safetensors"):
                save_file(payload, tmp[name], metadata={"format": "pt"})
                as_umask_allows(tmp[name])  # safetensors writes 0600; a model directory is for others to read
            else:
                with open(tmp[name], "w") as f:
                    json.dump(payload, f, indent=2)
        for name in payloads:  # weights first, then the index and the config
            os.replace(tmp[name], os.path.join(out, name))
    finally:
        for path in tmp.values():
            if os.path.exists(path):
                os.unlink(path)
    log.debug("wrote %s: %d weight file(s)", out, len(names))
    return [os.path.join(out, n) for n in payloads]


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        return read_json_object(path, what)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; a Hugging Face model directory has {what}") from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{path} is damaged: not readable ({exc})") from None


def _weight_files(directory: str) -> dict[str, list[str] | None]:
    """``{file: tensors the index places there (None: all)}``."""
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        weight_map = _read_json(index, "an index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptCheckpointError(f"{index} is damaged: it has no weight_map")
        placed: dict[str, list[str]] = {}
        for tensor, file in weight_map.items():
            placed.setdefault(check_member_name(file, index), []).append(tensor)
        return {**placed}
    if os.path.exists(os.path.join(directory, WEIGHTS)):
        return {WEIGHTS: None}
    raise CheckpointError(
        f"{directory} has neither {WEIGHTS} nor {INDEX}; a Hugging Face model directory holds safetensors weights"
    )


def read_hf_dir(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, tensors)`` of a local Hugging Face model directory, every tensor read.

    Raises:
        CheckpointError: not a model directory (which file is missing).
        CorruptCheckpointError: a damaged config, index or safetensors file (named).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = os.path.abspath(os.fspath(path))
    if "://" in os.fspath(path) or not os.path.isdir(directory):
        raise CheckpointError(f"{path} is not a local directory; --from hf reads a Hugging Face model directory")
    config = _read_json(os.path.join(directory, CONFIG), CONFIG)
    tensors: dict[str, torch.Tensor] = {}
    for file, expected in _weight_files(directory).items():
        full = os.path.join(directory, file)
        if not os.path.isfile(full):
            raise CorruptCheckpointError(f"{full} is missing: {INDEX} places {len(expected or [])} tensors in it")
        try:
            found = load_file(full)
        except SafetensorError as exc:
            raise CorruptCheckpointError(f"{full} is damaged: not a readable safetensors file ({exc})") from None
        absent = sorted(set(expected or []) - set(found))
        if absent:
            raise CorruptCheckpointError(f"{full} lacks {absent[:3]}, which {INDEX} places in it")
        tensors.update(found)
    return config, tensors
