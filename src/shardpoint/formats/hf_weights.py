"""Hugging Face weights straight into sharded models, and out again: torchtitan's ``initial_load_in_hf`` /
``last_save_in_hf`` as a library.

:func:`load_hf_weights` fills a model whose tensors are DTensors (FSDP2, tensor parallel,
both) or plain tensors from a Hugging Face directory (``model.safetensors``, or shards
with ``model.safetensors.index.json``), local or ``s3://``, at whatever mesh it has;
:func:`save_hf_weights` writes one from every rank, which ``from_pretrained`` loads.

Load: rank 0 reads the index (one broadcast); every rank reads the headers of its share
of the files and reports the box (global offset and shape) of every tensor it holds (one
all-gather); every rank derives the same plan of who reads which byte ranges and reads
(:mod:`.hf_read`); one agreement ends it, plus one before each batch whose bytes move
between ranks. Save: :mod:`.hf_write`.

Names: the model's own (canonical) names, whatever wraps it (:mod:`shardpoint.state.naming`),
with a mixture-of-experts layer's stacked experts taken as the per-expert tensors
``save_pretrained`` stores (:mod:`.hf_experts`), matched to the stored ones directly, through a ``transformers`` model's
``base_model_prefix`` (a ``LlamaModel`` checkpoint into ``LlamaForCausalLM`` and back), or
through ``rename``. Tied parameters are read once.

Why not DCP's ``HuggingFaceStorageReader`` (``torch.distributed.checkpoint.hf_storage``):
it reads local files only (``safe_open`` maps them; ``s3://`` fails), every rank reads
what it needs itself, so bytes that ranks share are read once per rank, and it matches
keys exactly (no tied or prefixed names). Measured on one 2-core machine (2 gloo ranks,
Llama of 155M parameters stored in bf16, 311 MB in 4 files, warm page cache, best of 3):
FSDP2 dp=2 0.24 s for both, each rank reading its half; tp=2 0.40 s vs DCP's 0.24 s,
311 MB read vs 443 MB; replicated 0.66 s vs 0.28 s, 311 MB vs 623 MB. On a warm page
cache re-reading is cheaper than passing bytes over loopback gloo; on object storage or
a shared filesystem, where each byte costs a request and bandwidth, reading once is
what keeps a restart's cost from growing with the number of replicas.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from shardpoint.errors import CheckpointError, MissingKeysError, ShapeMismatchError
from shardpoint.formats.hf_experts import expert_scheme, split_experts
from shardpoint.formats.hf_read import (
    Box,
    locate,
    plan_reads,
    read_index,
    reraise,
    run_reads,
    stored_tensors,
)
from shardpoint.formats.hf_write import (
    FileWriter,
    WritePlan,
    as_dtype,
    finish,
    open_dir,
    prepare,
    unpublish,
    write_rounds,
)
from shardpoint.formats.safetensors_index import RangeReader, StoredTensor, parse_size, read_header
from shardpoint.parallel import comm
from shardpoint.state import naming
from shardpoint.state.sharding import Shard, flatten_shards

__all__ = ["HFLoadResult", "HFSaveResult", "ShapeMismatchError", "load_hf_weights", "save_hf_weights"]

log = logging.getLogger(__name__)


@dataclass
class HFLoadResult:
    """What :func:`load_hf_weights` did (the same on every rank, except ``bytes_read``)."""

    path: str
    loaded: list[str]  # model keys filled from the checkpoint (tied copies not repeated)
    missing: list[str]  # model keys the checkpoint lacks (only with strict=False)
    unexpected: list[str]  # stored keys the model lacks (only with strict=False)
    bytes_read: int  # tensor bytes this rank read
    header_bytes: int  # index and header bytes this rank read


@dataclass
class HFSaveResult:
    """What :func:`save_hf_weights` wrote (the same on every rank, except ``bytes_written``)."""

    path: str
    files: list[str]
    total_size: int  # tensor bytes in all files
    bytes_written: int  # bytes this rank wrote


def load_hf_weights(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
) -> HFLoadResult:
    """Load Hugging Face safetensors weights into ``model`` in place, at whatever sharding it has.

    Collective: every rank calls it (also with no process group, in one process). Each
    rank reads only the byte ranges of its own shards, and bytes several ranks need are
    read once and passed on. Call it after ``fully_shard`` / ``parallelize_module`` and,
    for a model built on the meta device, after ``model.to_empty(device=...)``.

    Args:
        model: the model, possibly wrapped (DDP, ``torch.compile``, activation checkpointing);
            keys are its own names. Tied parameters (``lm_head`` sharing the embedding) are
            filled from whichever of their names the checkpoint holds.
        path: a directory holding ``model.safetensors`` or ``model.safetensors.index.json``
            and its shards, a single ``.safetensors`` file, or the same on ``s3://``.
        strict: raise when the checkpoint lacks a model tensor or holds one the model lacks.
        rename: stored name -> model name (mapping or function), for models whose names
            differ from the checkpoint's. Without it a model with ``base_model_prefix``
            (``transformers``) also loads a checkpoint saved with or without that prefix.

    Returns:
        :class:`HFLoadResult`.

    Raises:
        MissingKeysError: ``strict`` and keys differ, naming them.
        ShapeMismatchError: a tensor's stored shape differs from the model's, naming it.
        CorruptCheckpointError: a file is missing, truncated, or its header damaged, naming it.

    Example::

        model = LlamaForCausalLM(config)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        sp.load_hf_weights(model, "s3://models/Llama-3.1-8B")
    """
    start = time.perf_counter()
    storage, directory, single = locate(path)
    me, headers, local = comm.rank(), RangeReader(storage, directory), {}
    weight_map = comm.from_root(lambda: read_index(headers, single), "reading the Hugging Face index")
    files = [single] if weight_map is None else sorted(set(weight_map.values()))

    def survey() -> tuple[dict[str, dict[str, StoredTensor]], dict[str, Box], dict[str, str]]:
        found = {name: read_header(headers, name) for name in files[me :: comm.world_size()]}
        local["shards"], tied = _model_targets(model)
        _check_materialized(local["shards"])
        return found, {k: _box(s) for k, s in local["shards"].items() if k not in tied}, tied

    try:
        gathered = comm.agree_all(survey, "reading Hugging Face safetensors headers")
    finally:
        headers.close()
    stored = stored_tensors({f: t for found, _, _ in gathered for f, t in found.items()}, weight_map, single)
    everyone = [boxes for _, boxes, _ in gathered]
    tied = {a: k for _, _, t in gathered for a, k in t.items()}
    pairs, missing, unexpected = _match(stored, everyone, tied, rename, _base_prefix(model))
    _check_shapes(pairs, stored, everyone, directory)
    if strict and (missing or unexpected):
        raise MissingKeysError(directory, missing, unexpected)
    reader = RangeReader(storage, directory)
    try:
        run_reads(plan_reads(pairs, stored, everyone), local["shards"], reader, me)
    finally:
        reader.close()
    if me == 0:
        log.info(
            "loaded %d tensors from %s in %.2f s (rank 0 read %.1f MB)",
            len(pairs),
            directory,
            time.perf_counter() - start,
            reader.bytes_read / 1e6,
        )
    return HFLoadResult(directory, sorted(pairs), missing, unexpected, reader.bytes_read, headers.bytes_read)


def save_hf_weights(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "5GB",
    *,
    save_config: bool = True,
) -> HFSaveResult:
    """Write ``model``'s weights as Hugging Face safetensors (sharded, with the index) from every rank.

    Collective: every rank calls it. Each full tensor is written once, by the rank that
    writes its file; the other ranks send it their pieces. ``transformers``'
    ``from_pretrained(path)`` loads the result.

    Args:
        model: the model, possibly sharded (DTensors) and wrapped; tied tensors are written once.
        path: a directory, local or ``s3://``; existing Hugging Face weight files in it are replaced.
        dtype: cast floating-point tensors to this dtype (``torch.bfloat16`` or ``"bfloat16"``);
            None keeps each tensor's dtype.
        max_shard_size: the largest file, as ``save_pretrained`` takes it ("5GB", "500MiB", or bytes);
            a larger tensor gets a file of its own.
        save_config: when the model has a ``transformers`` config, rank 0 also writes
            ``config.json`` (and ``generation_config.json``), as ``save_pretrained`` does.

    Returns:
        :class:`HFSaveResult`.

    Example::

        sp.save_hf_weights(model, "out/llama-sft", dtype=torch.bfloat16)
        LlamaForCausalLM.from_pretrained("out/llama-sft")
    """
    max_bytes, out_dtype = parse_size(max_shard_size), as_dtype(dtype)
    storage, directory = open_dir(path)
    me, local = comm.rank(), {}

    def survey() -> tuple[dict[str, Box], dict[str, str]]:
        local["shards"], tied = _model_targets(model)
        return {k: _box(s) for k, s in local["shards"].items() if k not in tied}, tied

    everyone = [boxes for boxes, _ in comm.agree_all(survey, "describing the model's tensors for a save")]
    plan = WritePlan(everyone, out_dtype, max_bytes)
    in_place = not storage.supports_rename
    comm.from_root(lambda: prepare(storage, directory, in_place), f"preparing {directory}")
    writer = FileWriter(storage, directory, plan, me, in_place)
    error = write_rounds(plan, local["shards"], writer, me)
    if error is not None:
        writer.discard()
    comm.agree(lambda: reraise(error), f"writing Hugging Face weights to {directory}")
    if not in_place:
        comm.from_root(lambda: unpublish(storage, directory), f"replacing the weights in {directory}")
        comm.agree(writer.publish, f"publishing the weight files in {directory}")
    comm.from_root(lambda: finish(storage, directory, plan, model if save_config else None), "writing the index")
    return HFSaveResult(directory, plan.names, plan.total_size, writer.bytes_written)


# --- the model's side ----------------------------------------------------------------------------------------


def _model_targets(model: torch.nn.Module) -> tuple[dict[str, Shard], dict[str, str]]:
    """The model's tensors as Shards under canonical keys, and ``{tied key: the key it shares a parameter with}``."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    # stacked experts (transformers' MoE layers) as the per-expert tensors checkpoints store
    shards = split_experts(flatten_shards(naming.model_state(model), ""), expert_scheme(naming.unwrap(model)))
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        fqns = _get_fqns(model, name)
        if len(fqns) != 1:
            continue
        fqn = next(iter(fqns))
        owner = first.setdefault(id(param), fqn)
        if owner != fqn and owner in shards and fqn in shards:
            tied[fqn] = owner
    return shards, tied


def _box(shard: Shard) -> Box:
    return Box(shard.global_shape, shard.global_offset, tuple(shard.tensor.shape), shard.tensor.dtype)


def _check_materialized(shards: Mapping[str, Shard]) -> None:
    meta = [k for k, s in shards.items() if s.tensor.is_meta]
    if meta:
        raise CheckpointError(
            f"{len(meta)} model tensor(s) are on the meta device (e.g. {meta[0]!r}) and cannot be loaded into; "
            "materialize the model first with model.to_empty(device=...)"
        )


def _base_prefix(model: torch.nn.Module) -> str:
    prefix = getattr(naming.unwrap(model), "base_model_prefix", "")
    return prefix if isinstance(prefix, str) else ""


def _match(
    stored: Mapping[str, StoredTensor],
    everyone: Sequence[Mapping[str, Box]],
    tied: Mapping[str, str],
    rename: Mapping[str, str] | Callable[[str], str] | None,
    prefix: str,
) -> tuple[dict[str, str], list[str], list[str]]:
    """``({model key: stored key}, missing model keys, unexpected stored keys)``, the same on every rank.

    Model keys are the union over ranks (a pipeline stage holds only its layers). A stored
    key that names a tied copy fills the parameter it shares, unless its own name is stored.
    """
    model_keys = {k for boxes in everyone for k in boxes}
    known = model_keys | set(tied)
    user = rename if callable(rename) else (lambda name, table=dict(rename or {}): table.get(name, name))
    candidates: list[Callable[[str], str | None]] = [lambda name: name]
    if prefix:
        candidates.append(lambda name: f"{prefix}.{name}")
        candidates.append(lambda name: name[len(prefix) + 1 :] if name.startswith(prefix + ".") else None)
    best = max(candidates, key=lambda fn: sum(fn(user(k)) in known for k in stored))
    pairs: dict[str, str] = {}
    unexpected = []
    for skey in sorted(stored, key=lambda k: (tied.get(best(user(k)) or "") is not None, k)):
        name = best(user(skey))
        if name not in known:
            unexpected.append(skey)
            continue
        pairs.setdefault(tied.get(name, name), skey)
    missing = sorted(model_keys - set(pairs))
    return pairs, missing, sorted(unexpected)


def _check_shapes(pairs: Mapping[str, str], stored: Mapping, everyone: Sequence[Mapping[str, Box]], where: str) -> None:
    shapes = {k: b.global_shape for boxes in everyone for k, b in boxes.items()}
    wrong = [
        f"  {key!r}: stored {tuple(stored[skey].shape)} in {stored[skey].file}, model {shapes[key]}"
        for key, skey in sorted(pairs.items())
        if tuple(stored[skey].shape) != shapes[key]
    ]
    if wrong:
        raise ShapeMismatchError(
            f"{len(wrong)} tensor(s) of {where} differ in shape from the model's:\n"
            + "\n".join(wrong[:8])
            + ("\n  ..." if len(wrong) > 8 else "")
            + "\nBuild the model from the checkpoint's config.json (e.g. AutoConfig.from_pretrained)."
        )
