"""The ``torch`` format: Megatron-LM's legacy layout, one ``torch.save`` file per model-parallel rank.

::

    iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt   # written by data-parallel rank 0
    iter_0000100/mp_rank_TT[_PPP]/dp_rank_DDDD.pt      # each dp rank's own parts: state split over dp
                                                       # (ZeRO, FSDP) and RankLocal tensors

``model_optim_rng.pt`` holds what Megatron's does (checkpoint version, iteration,
model, optimizer, scheduler, RNG of every dp rank, FLOPs so far) with two
differences: tensors sit under their global keys with their box in the global tensor
(``sharding``), so ``shardpoint convert`` can re-split them for another layout
offline, and the config is stored as JSON text, never as a pickled ``args`` object.
Everything loads with ``torch.load(weights_only=True)``.

The file is per model-parallel rank, so loading needs the same tp and pp; dp may
change (a distributed optimizer's slices are reassembled from every dp rank's pieces).
Checkpoints written before the per-dp-rank files held all pieces in one gathered
``distrib_optim.pt`` and the rank-local tensors in the main file; both still load.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import torch

from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord
from shardpoint.errors import CorruptCheckpointError, TopologyMismatchError
from shardpoint.formats.base import (
    FormatContext,
    Loaded,
    read_torch_file,
    size_difference,
    unexpected_keys,
    write_torch_file,
)
from shardpoint.parallel import comm
from shardpoint.parallel.topology import Topology
from shardpoint.state import naming, rank_local
from shardpoint.state.sharding import Shard, copy_overlap
from shardpoint.state.train_state import OPTIM_PREFIX, FlatState
from shardpoint.storage.base import Storage

__all__ = ["TorchFormat"]

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0
MAIN_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"  # older checkpoints: every dp rank's pieces, gathered to dp rank 0
DP_FILE_PREFIX = "dp_rank_"


class TorchFormat:
    """``format="torch"``: Megatron's per-model-parallel-rank files."""

    name = "torch"

    def save(self, ctx: FormatContext, flat: FlatState) -> dict[str, FileRecord]:
        topo = ctx.topology
        folder = topo.mp_rank_name
        storage = ctx.storage
        storage.makedirs(storage.join(ctx.directory, folder))
        split = _split_over_dp(topo, flat, ctx.distributed_optimizer)
        dp_sharded = {k: s for k, s in flat.tensors.items() if k in split}
        plain = {k: s for k, s in flat.tensors.items() if k not in dp_sharded}
        files = _write_dp_file(ctx, folder, dp_sharded, flat.rank_local)
        # only small objects cross ranks: RNG states, stateful objects, rank-local key names
        per_dp_rank = self._gather_over_dp(topo, (flat.per_rank, sorted(flat.rank_local)))
        if topo.dp_rank != 0:
            return files
        if per_dp_rank is None:  # this rank is dp rank 0 by its groups but not where Megatron's order puts it
            raise TopologyMismatchError(
                f"rank {topo.rank} is data-parallel rank 0 of {topo.mp_rank_name}, but Megatron's rank order puts "
                f"that at rank {topo.rank_of(tp=topo.tp_rank, pp=topo.pp_rank, dp=0)}; build the topology with "
                "ranks in tp, dp, pp order, or save with format='dist'"
            )
        rng_states = [per_rank.get("rng") for per_rank, _ in per_dp_rank]
        stateful = [per_rank.get("stateful") for per_rank, _ in per_dp_rank]
        rank_local_keys = [keys for _, keys in per_dp_rank]
        payload = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": flat.common["iteration"],
            "model": {k: _compact(s.tensor) for k, s in plain.items() if k.startswith("model.")},
            "optimizer": {k: _compact(s.tensor) for k, s in plain.items() if k.startswith(OPTIM_PREFIX)},
            "sharding": {
                k: {"global_shape": list(s.global_shape), "global_offset": list(s.global_offset)}
                for k, s in plain.items()
            },
            "common": flat.common,
            "rng_state": rng_states if flat.per_rank else None,
            "rank_local_keys": rank_local_keys if any(rank_local_keys) else None,
            "stateful": stateful if any(stateful) else None,
            "num_floating_point_operations_so_far": flat.common.get("extra", {}).get("flops", 0),
            "config_json": json.dumps(flat.common.get("config", {})),
            "topology": topo.describe(),
        }
        main_name = f"{folder}/{MAIN_FILE}"
        files[main_name] = write_torch_file(payload, storage.join(ctx.directory, main_name), storage)
        return files

    def fingerprint(self, ctx: FormatContext, flat: FlatState) -> str | None:
        return None  # every save gathers over dp anyway; nothing to replay

    def finish(self, ctx: FormatContext, parts: list[Any]) -> dict[str, FileRecord]:
        return {}

    @staticmethod
    def _gather_over_dp(topo: Topology, obj: Any) -> list[Any] | None:
        """Every dp rank's ``obj`` on dp rank 0 of this model-parallel rank (None elsewhere)."""
        if topo.dp_size == 1:
            return [obj]
        dp_root = topo.rank_of(tp=topo.tp_rank, pp=topo.pp_rank, dp=0)
        return comm.gather_to(obj, dp_root, topo.dp_group())

    def files_read_by_all(self, meta: CheckpointMetadata) -> list[str]:
        return sorted(name for name in meta.files if name.startswith("mp_rank_"))  # same tp/pp: every folder

    def checksummed_while_reading(self, meta: CheckpointMetadata) -> set[str]:
        return set()  # torch.load reads each file whole: verified before, in one pass

    def load(self, ctx: FormatContext, flat: FlatState, meta: CheckpointMetadata) -> Loaded:
        _check_layout(ctx, meta)
        storage = ctx.storage
        folder = ctx.topology.mp_rank_name
        main_path = storage.join(ctx.directory, folder, MAIN_FILE)
        payload = comm.agree(lambda: _read(storage, main_path), "reading the torch-format checkpoint")
        stored = {**payload.get("model", {}), **payload.get("optimizer", {})}

        def fill() -> tuple[list[str], dict | None, list[str]]:
            nonlocal stored
            per_dp = {
                name: read_torch_file(storage, storage.join(ctx.directory, name), mmap=True)
                for name in dp_files(meta.files, folder)
            }
            pieces = _merged_pieces(per_dp.values()) if per_dp else None
            own_keys = _rank_local_keys(payload)
            keys = {*stored, *(pieces or {}), *(k for ks in own_keys for k in ks)}
            names = naming.stored_to_current(keys, ctx.rename, main_path, canonical=meta.canonical_keys)
            stored, pieces = naming.translate(names, stored), pieces and naming.translate(names, pieces)
            own_keys = [[names.get(k, k) for k in ks] for ks in own_keys]
            plan = _rank_local_plan(ctx, flat, meta, own_keys, set(stored) | set(pieces or {}), main_path)
            boxes = naming.translate(names, payload.get("sharding", {}))
            missing = _fill(plan.shared, stored, boxes, pieces, main_path, flat)
            if plan.own:
                own = _own_tensors(payload, per_dp, f"{folder}/{dp_file(ctx.topology.dp_rank)}", ctx.topology.dp_rank)
                _fill_own(plan.own, naming.translate(names, own), main_path)
            rank_local.reinitialise(plan)
            return missing, pieces, list(plan.reinit)

        missing, pieces, reinit = comm.agree(fill, "loading the torch-format tensors")
        if ctx.optimizer_reshard == "reinit":
            rank_local.warn_reinit(reinit, ctx.directory)
        missing = sorted(set().union(*comm.all_gather(missing)))
        wanted = set().union(*comm.all_gather(sorted(set(flat.tensors) | set(flat.rank_local))))
        saved_keys = set().union(*comm.all_gather(sorted(set(stored) | set(pieces or {}))))
        per_rank = _per_rank(payload.get("rng_state"), payload.get("stateful"), meta, ctx)
        return Loaded(payload["common"], per_rank, missing, unexpected_keys(saved_keys, wanted))


def dp_file(dp_rank: int) -> str:
    """The file of one data-parallel rank's own parts (distributed-optimizer pieces, rank-local tensors)."""
    return f"{DP_FILE_PREFIX}{dp_rank:04d}.pt"


def dp_files(names: Iterable[str], folder: str) -> list[str]:
    """The per-dp-rank files of model-parallel rank ``folder`` among ``names``, and the older gathered one."""
    return sorted(
        n
        for n in names
        if n.startswith(folder + "/")
        and (n.rsplit("/", 1)[-1].startswith(DP_FILE_PREFIX) or n.endswith("/" + DISTRIB_OPTIM_FILE))
    )


def read_pieces(storage: Storage, directory: str, names: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """The distributed-optimizer pieces held in the files ``names`` (relative to ``directory``)."""
    return _merged_pieces(read_torch_file(storage, storage.join(directory, n), mmap=True) for n in names)


def _merged_pieces(payloads: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    merged: dict[str, list[dict[str, Any]]] = {}
    for payload in payloads:
        for key, items in payload.get("pieces", {}).items():
            merged.setdefault(key, []).extend(items)
    return merged


def _write_dp_file(
    ctx: FormatContext, folder: str, dp_sharded: dict[str, Shard], own: dict[str, torch.Tensor]
) -> dict[str, FileRecord]:
    """This rank's dp-split pieces and rank-local tensors in a file of its own.

    Every data-parallel rank writes its own parts, as Megatron's ``torch_dist``
    ranks do: no rank receives another's optimizer slice, so neither GPU nor host
    memory holds more than this rank's state (one host copy of its own parts).
    Before, the slices were pickled and gathered to dp rank 0, which needed
    slice × dp of memory there.
    """
    if not dp_sharded and not own:
        return {}
    topo = ctx.topology
    payload = {
        "pieces": _pieces(dp_sharded),
        "rank_local": {k: _compact(t) for k, t in own.items()},
        "dp_rank": topo.dp_rank,
        "dp_size": topo.dp_size,
    }
    name = f"{folder}/{dp_file(topo.dp_rank)}"
    return {name: write_torch_file(payload, ctx.storage.join(ctx.directory, name), ctx.storage)}


def _rank_local_keys(payload: dict[str, Any]) -> list[list[str]]:
    """Per dp rank, the keys of its rank-local tensors (older checkpoints held the tensors in the main file)."""
    if payload.get("rank_local_keys"):
        return [list(keys) for keys in payload["rank_local_keys"]]
    return [sorted(d) for d in payload.get("rank_local") or []]


def _own_tensors(payload: dict[str, Any], per_dp: dict[str, dict], name: str, dp_rank: int) -> dict[str, torch.Tensor]:
    if payload.get("rank_local"):  # older checkpoints: every dp rank's tensors in the main file
        return payload["rank_local"][dp_rank]
    if name not in per_dp:
        raise CorruptCheckpointError(f"{name} is missing; the checkpoint is incomplete")
    return per_dp[name]["rank_local"]


def _split_over_dp(topo: Topology, flat: FlatState, distributed_optimizer: bool) -> set[str]:
    """Keys whose data-parallel ranks hold different boxes (ZeRO, FSDP), so dp rank 0 alone cannot write them.

    Each dp rank writes its pieces of them into its own file (:func:`dp_file`). Collective over the
    dp group; every dp rank gets the same answer.
    """
    split = {k for k in flat.tensors if distributed_optimizer and k.startswith(OPTIM_PREFIX)}
    if topo.dp_size == 1:
        return split
    boxes = comm.all_gather({k: s.global_offset for k, s in flat.tensors.items()}, topo.dp_group())
    keys = set().union(*boxes)
    return split | {k for k in keys if len({b.get(k) for b in boxes}) > 1}


def _check_layout(ctx: FormatContext, meta: CheckpointMetadata) -> None:
    topo, saved = ctx.topology, meta.topology
    if (saved["tp"], saved["pp"]) != (topo.tp_size, topo.pp_size):
        raise TopologyMismatchError(
            f"{ctx.directory} is a 'torch' format checkpoint saved at tp={saved['tp']} pp={saved['pp']}, "
            f"but this job runs tp={topo.tp_size} pp={topo.pp_size}. The torch format stores one file per "
            "model-parallel rank and cannot be resharded on load: resume with the saved tp/pp, save with "
            "format='dist' (reshardable), or re-split it offline with "
            f"`shardpoint convert {ctx.directory} OUT --tp {topo.tp_size} --pp {topo.pp_size}`"
        )


def _read(storage: Storage, path: str) -> dict[str, Any]:
    if not storage.exists(path):
        raise CorruptCheckpointError(f"{path} is missing; the checkpoint is incomplete")
    return read_torch_file(storage, path, mmap=True)


def _rank_local_plan(
    ctx: FormatContext,
    flat: FlatState,
    meta: CheckpointMetadata,
    per_dp_rank: list[list[str]],
    shared: set[str],
    where: str,
) -> rank_local.RankLocalPlan:
    same_layout = meta.topology["dp"] == ctx.topology.dp_size  # tp and pp were checked already
    return rank_local.resolve(
        flat,
        shared,
        set(per_dp_rank[ctx.topology.dp_rank]) if same_layout and per_dp_rank else (),
        set().union(*per_dp_rank),
        policy=ctx.optimizer_reshard,
        where=where,
    )


def _fill_own(targets: dict[str, torch.Tensor], stored: dict[str, torch.Tensor], where: str) -> None:
    for key, target in targets.items():
        _copy_whole(key, rank_local.whole(target), stored[key], None, where)


def _fill(
    targets: dict[str, Shard],
    stored: dict[str, torch.Tensor],
    boxes: dict[str, dict],
    pieces: dict | None,
    where: str,
    flat: FlatState,
) -> list[str]:
    """Copy stored tensors into ``targets``; returns the keys found nowhere.

    A whole model tensor stored at another size is read at that size when ``flat`` allows
    it (``FlatState.resize``: the model's ``load_state_dict`` then takes it).
    """
    missing = []
    for key, target in targets.items():
        if key in stored:
            source, box = stored[key], boxes.get(key)
            saved_whole = box is None or list(box["global_shape"]) == list(source.shape)
            if saved_whole and tuple(source.shape) != target.global_shape:
                target = flat.resize(key, tuple(source.shape)) or target
            _copy_whole(key, target, source, boxes.get(key), where)
        elif pieces is not None and key in pieces:
            for piece in pieces[key]:
                copy_overlap(target, piece["tensor"], piece["global_offset"])
        else:
            missing.append(key)
    return missing


def _per_rank(
    rng_states: list | None, stateful: list | None, meta: CheckpointMetadata, ctx: FormatContext
) -> dict[str, Any] | None:
    if not rng_states and not stateful:
        return None
    if meta.topology["dp"] != ctx.topology.dp_size:
        log.warning(
            "checkpoint saved at dp=%d, running dp=%d: per-rank RNG streams and TrainState.stateful objects "
            "(data loaders, samplers) are not restored",
            meta.topology["dp"],
            ctx.topology.dp_size,
        )
        return None
    dp_rank = ctx.topology.dp_rank
    return {"rng": rng_states[dp_rank] if rng_states else None, "stateful": stateful[dp_rank] if stateful else None}


def _pieces(shards: dict[str, Shard]) -> dict[str, list[dict[str, Any]]]:
    return {
        k: [
            {
                "tensor": _compact(s.tensor),
                "global_offset": list(s.global_offset),
                "global_shape": list(s.global_shape),
            }
        ]
        for k, s in shards.items()
    }


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning just its bytes: ``torch.save`` of a view writes the view's whole storage."""
    tensor = tensor.detach().cpu()
    return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor


def _copy_whole(key: str, target: Shard, source: torch.Tensor, box: dict | None, where: str) -> None:
    if tuple(source.shape) != tuple(target.tensor.shape) or (
        box is not None and tuple(box["global_offset"]) != target.global_offset
    ):
        raise size_difference(
            f"{where}: tensor {key!r} has shape {tuple(source.shape)} at offset "
            f"{tuple(box['global_offset']) if box else '?'}, but this rank expects {tuple(target.tensor.shape)} at "
            f"{target.global_offset}"
        )
    with torch.no_grad():
        target.tensor.copy_(source)
