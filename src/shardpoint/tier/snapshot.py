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

Frozen parameters (``requires_grad=False``: a fine-tune's base) go into a second file,
``frozen.pt``. When their bytes are unchanged since this rank's previous local save
(the same xxh3-128 digest the persistent tier's dedup uses), the new copy's
``frozen.pt`` is a hard link to the previous one's: nothing is written, each copy
still holds all its files (deleting the older copy only drops a link), and a node
whose filesystem refuses links writes the file as before.

:class:`LocalSnapshotFormat` follows the :class:`~shardpoint.formats.base.CheckpointFormat`
interface, so the load pipeline's steps (config check, missing-key check, optimizer
shards, scheduler, RNG) run unchanged on it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import xxhash

from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord
from shardpoint.errors import CorruptCheckpointError, TopologyMismatchError
from shardpoint.formats.base import FormatContext, Loaded, read_torch_file, unexpected_keys, write_torch_file
from shardpoint.formats.dedup import tensor_digest
from shardpoint.parallel import comm
from shardpoint.state.train_state import FlatState

__all__ = ["DATA_FILE", "FROZEN_FILE", "LocalSnapshotFormat"]

log = logging.getLogger(__name__)

DATA_FILE = "state.pt"
FROZEN_FILE = "frozen.pt"
VERSION = 1


class LocalSnapshotFormat:
    """``format="local"``: this rank's state in ``state.pt`` (and ``frozen.pt``); every rank reads only its own."""

    name = "local"
    restores_in_last_round = True  # load runs ``ctx.restore`` inside its one round (see LoadPipeline)

    def __init__(self) -> None:
        self._frozen: tuple[str, str, FileRecord] | None = None  # digest, where the published copy keeps it, record

    def save(self, ctx: FormatContext, flat: FlatState) -> dict[str, FileRecord]:
        """Write this rank's files into ``ctx.directory`` (no collective); their records, computed while writing."""
        trained = {k: s for k, s in flat.tensors.items() if k not in flat.frozen}
        payload = {
            "version": VERSION,
            **_tensors(trained),
            "rank_local": dict(flat.rank_local),
            "common": flat.common,
            "per_rank": flat.per_rank,
        }
        path = ctx.storage.join(ctx.directory, DATA_FILE)
        records = {DATA_FILE: write_torch_file(payload, path, ctx.storage)}
        frozen = {k: s for k, s in flat.tensors.items() if k in flat.frozen}
        if frozen:
            records[FROZEN_FILE] = self._save_frozen(ctx, frozen)
        return records

    def _save_frozen(self, ctx: FormatContext, frozen: dict[str, Any]) -> FileRecord:
        """``frozen.pt``: a hard link to the previous copy's when its tensors are unchanged, else written."""
        digest = xxhash.xxh3_128("".join(f"{k}:{tensor_digest(s.tensor)}" for k, s in sorted(frozen.items())).encode())
        path = ctx.storage.join(ctx.directory, FROZEN_FILE)
        # where this copy's file will be once published (tier.marker.publish_copy: rank_NNNNN beside the tmp dir)
        final = os.path.join(os.path.dirname(ctx.directory.rstrip("/")), f"rank_{comm.rank():05d}", FROZEN_FILE)
        previous = self._frozen
        if previous is not None and previous[0] == digest.hexdigest() and _link(previous[1], path, previous[2]):
            log.debug("local tier: frozen tensors unchanged, %s linked to %s", path, previous[1])
            self._frozen = (previous[0], final, previous[2])
            return previous[2]
        record = write_torch_file({"version": VERSION, **_tensors(frozen)}, path, ctx.storage)
        self._frozen = (digest.hexdigest(), final, record)
        return record

    def fingerprint(self, ctx: FormatContext, flat: FlatState) -> str | None:
        return None

    def finish(self, ctx: FormatContext, parts: list[Any]) -> dict[str, FileRecord]:
        return {}

    def files_read_by_all(self, meta: CheckpointMetadata) -> list[str]:
        return []  # each rank's copy was verified when the tier chose it (shardpoint.tier.choose)

    def checksummed_while_reading(self, meta: CheckpointMetadata) -> set[str]:
        return set()

    def load(self, ctx: FormatContext, flat: FlatState, meta: CheckpointMetadata) -> Loaded:
        """Fill ``flat`` from this rank's files and restore the rest (``ctx.restore``); one agreement round, so a
        failure anywhere, in the read or the restore, is raised everywhere."""
        path = ctx.storage.join(ctx.directory, DATA_FILE)

        def read() -> Loaded:
            payload = _read(ctx, path)
            size = ctx.storage.size(path)
            if FROZEN_FILE in meta.files:
                frozen_path = ctx.storage.join(ctx.directory, FROZEN_FILE)
                frozen = _read(ctx, frozen_path)
                for part in ("tensors", "boxes"):
                    payload[part] = {**payload[part], **frozen[part]}
                size += ctx.storage.size(frozen_path)
            with torch.no_grad():
                missing = _fill(flat, payload, path)
            saved = set(payload["tensors"]) | set(payload["rank_local"])
            wanted = set(flat.tensors) | set(flat.rank_local)
            loaded = Loaded(
                payload["common"],
                payload["per_rank"],
                missing,
                unexpected_keys(saved, wanted),
                checked={DATA_FILE},
                bytes_read=size,
            )
            if ctx.restore is not None:
                ctx.restore(loaded)  # scheduler, RNG, stateful: their outcome rides on this round's
            return loaded

        return comm.agree(read, "reading the local-tier checkpoint")


def _tensors(shards: dict[str, Any]) -> dict[str, Any]:
    return {
        "tensors": {k: s.tensor for k, s in shards.items()},
        "boxes": {k: [list(s.global_shape), list(s.global_offset)] for k, s in shards.items()},
    }


def _read(ctx: FormatContext, path: str) -> dict[str, Any]:
    payload = read_torch_file(ctx.storage, path, mmap=True)  # copied straight into the live tensors
    if not isinstance(payload, dict) or payload.get("version") != VERSION:
        raise CorruptCheckpointError(f"{path} is not a local-tier snapshot (version {VERSION})")
    return payload


def _link(source: str, path: str, record: FileRecord) -> bool:
    """Hard-link ``source`` (the previous copy's file, of ``record``'s size) to ``path``; False when not possible."""
    try:
        if os.path.getsize(source) != record.size:
            return False
        os.link(source, path)
        return True
    except OSError:  # gone (retention, a failed save), another filesystem, links refused
        return False


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
