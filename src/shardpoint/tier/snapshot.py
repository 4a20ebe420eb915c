"""The local tier's file: one rank's whole state in one ``torch.save`` file, read back at the same layout.

Why not the ``dist`` format: DCP stores each replicated box once, in whichever rank's
file its planner chose, so restoring one rank can need files written on other nodes,
and its save and load are collectives. The local tier is bound to the layout it
was saved at (invariant 12), so each rank can keep exactly what it needs to restore
itself: its shards (with their boxes, checked on load), rank-local tensors, the common
state and its RNG streams. A rank's files are then self-contained: they can be
replicated, checked and fetched rank by rank, and writing them needs no collective.

The file is read with ``torch.load(weights_only=True)`` (it holds tensors and plain
values only): loading never runs code from it (invariant 6).

:class:`LocalSnapshotFormat` follows the :class:`~shardpoint.formats.base.CheckpointFormat`
interface, so the load pipeline's steps (config check, missing-key check, optimizer
shards, scheduler, RNG) run unchanged on it.
"""

from __future__ import annotations

from typing import Any

import torch

from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord
from shardpoint.errors import CorruptCheckpointError, TopologyMismatchError
from shardpoint.formats.base import FormatContext, Loaded, read_torch_file, unexpected_keys, write_torch_file
from shardpoint.parallel import comm
from shardpoint.state.train_state import FlatState

__all__ = ["DATA_FILE", "LocalSnapshotFormat"]

DATA_FILE = "state.pt"
VERSION = 1


class LocalSnapshotFormat:
    """``format="local"``: this rank's state in ``state.pt``; every rank reads only its own."""

    name = "local"

    def save(self, ctx: FormatContext, flat: FlatState) -> dict[str, FileRecord]:
        """Write this rank's file into ``ctx.directory`` (no collective); its record, computed while writing."""
        payload = {
            "version": VERSION,
            "tensors": {k: s.tensor for k, s in flat.tensors.items()},
            "boxes": {k: [list(s.global_shape), list(s.global_offset)] for k, s in flat.tensors.items()},
            "rank_local": dict(flat.rank_local),
            "common": flat.common,
            "per_rank": flat.per_rank,
        }
        path = ctx.storage.join(ctx.directory, DATA_FILE)
        return {DATA_FILE: write_torch_file(payload, path, ctx.storage)}

    def fingerprint(self, ctx: FormatContext, flat: FlatState) -> str | None:
        return None

    def finish(self, ctx: FormatContext, parts: list[Any]) -> dict[str, FileRecord]:
        return {}

    def files_read_by_all(self, meta: CheckpointMetadata) -> list[str]:
        return []  # each rank's copy was verified when the tier chose it (shardpoint.tier.choose)

    def checksummed_while_reading(self, meta: CheckpointMetadata) -> set[str]:
        return set()

    def load(self, ctx: FormatContext, flat: FlatState, meta: CheckpointMetadata) -> Loaded:
        """Fill ``flat`` from this rank's file; one agreement round so a failure anywhere is raised everywhere."""
        path = ctx.storage.join(ctx.directory, DATA_FILE)

        def read() -> Loaded:
            payload = read_torch_file(ctx.storage, path, mmap=True)  # copied straight into the live tensors
            if not isinstance(payload, dict) or payload.get("version") != VERSION:
                raise CorruptCheckpointError(f"{path} is not a local-tier snapshot (version {VERSION})")
            with torch.no_grad():
                missing = _fill(flat, payload, path)
            saved = set(payload["tensors"]) | set(payload["rank_local"])
            wanted = set(flat.tensors) | set(flat.rank_local)
            size = ctx.storage.size(path)
            return Loaded(
                payload["common"],
                payload["per_rank"],
                missing,
                unexpected_keys(saved, wanted),
                checked={DATA_FILE},
                bytes_read=size,
            )

        return comm.agree(read, "reading the local-tier checkpoint")


def _fill(flat: FlatState, payload: dict[str, Any], path: str) -> list[str]:
    """Copy the saved tensors into the live ones in place; returns the keys the file lacks."""
    missing = []
    tensors, boxes = payload["tensors"], payload["boxes"]
    for key, shard in flat.tensors.items():
        if key not in tensors:
            missing.append(key)
            continue
        saved_box = [list(shard.global_shape), list(shard.global_offset)]
        if boxes.get(key) != saved_box or tuple(tensors[key].shape) != tuple(shard.tensor.shape):
            raise TopologyMismatchError(
                f"{path}: {key} was saved as shape {tuple(tensors[key].shape)} at {boxes.get(key)}, this rank holds "
                f"{tuple(shard.tensor.shape)} at {saved_box}; a local-tier checkpoint loads only into the model "
                "and layout it was saved from: load the persistent checkpoint instead"
            )
        shard.tensor.copy_(tensors[key])
    for key, tensor in flat.rank_local.items():
        saved = payload["rank_local"].get(key)
        if saved is None:
            missing.append(key)
        elif tuple(saved.shape) != tuple(tensor.shape):
            raise TopologyMismatchError(
                f"{path}: rank-local {key} has shape {tuple(saved.shape)}, not {tuple(tensor.shape)}"
            )
        else:
            tensor.copy_(saved)
    return sorted(missing)
