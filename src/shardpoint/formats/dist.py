"""The reshardable ``dist`` format, built on ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards in parallel; DCP deduplicates boxes that several
ranks hold (data-parallel replicas) and spreads those writes over the replicas.
Tensors are stored under global keys with their global shape, so any layout can
load them, and plain ``dcp.load`` reads them with no shardpoint import.

DCP's default planners only understand whole tensors, ``DTensor`` and the old
``ShardedTensor``. :class:`ShardSavePlanner` / :class:`ShardLoadPlanner` teach them
:class:`~shardpoint.state.sharding.Shard`: the write item of a shard is its box in the
global tensor, and a load reads exactly the saved chunks that overlap this rank's
boxes (not the whole checkpoint).

Besides DCP's files: ``common.pt`` (state every rank shares: iteration, optimizer
hyperparameters, scheduler, extra) written by rank 0, and ``rng/rank_NNNNN.pt`` per
rank, restored only at the same layout.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, cast

import fsspec
import torch
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from shardpoint.catalog.integrity import HashingWriter, without_zip_crc32
from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord, listed_record
from shardpoint.errors import CheckpointError, UnsafeCheckpointError
from shardpoint.formats import dedup, dist_save, load_parts, shared_reads, split_plan
from shardpoint.formats.base import (
    FormatContext,
    Loaded,
    read_torch_file,
    wanted_summary,
    write_torch_file,
)
from shardpoint.formats.batched_writes import write_plan
from shardpoint.formats.chunk_index import INDEX_NAME
from shardpoint.formats.chunk_rows import ROWS_NAME
from shardpoint.formats.dcp_errors import dcp_errors
from shardpoint.formats.dcp_metadata import DCP_METADATA, SafeMetadata
from shardpoint.formats.dcp_read import StreamingReads
from shardpoint.formats.dist_replay import fingerprint_of, shard_spec
from shardpoint.parallel import comm
from shardpoint.state import naming, rank_local
from shardpoint.state.sharding import Shard
from shardpoint.state.train_state import FlatState
from shardpoint.storage.base import Storage
from shardpoint.storage.object_store import (
    READ_BLOCK,
    WRITE_BLOCK,
    is_object_url,
    object_filesystem,
    retrying,
    store_of,
)
from shardpoint.storage.safe_io import paused_gc

__all__ = [
    "DCP_METADATA",
    "DistFormat",
    "SafeFileSystemReader",
    "ShardLoadPlanner",
    "ShardSavePlanner",
    "dcp_reader",
    "dcp_writer",
]

log = logging.getLogger(__name__)

# Single-process saves and loads are intended (no process group means one rank); DCP
# warns about them on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

COMMON_FILE = "common.pt"


def rng_file(rank: int) -> str:
    return f"rng/rank_{rank:05d}.pt"


class ShardSavePlanner(DefaultSavePlanner):
    """Write each :class:`Shard` as its box of the global tensor."""

    def __init__(self, shards: dict[str, Shard]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards = shards

    def create_local_plan(self) -> SavePlan:
        items = [_write_item(key, shard) for key, shard in self.shards.items() if _written(shard)]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        # every item is stored contiguous, so a load can take its bytes as they are (see dcp_read)
        return self.shards[index.fqn].tensor.contiguous()


class ShardLoadPlanner(DefaultLoadPlanner):
    """Read, for each :class:`Shard`, the saved chunks that overlap its box."""

    def __init__(self, shards: dict[str, Shard], where: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.shards = shards
        self.where = where

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set by DCP before planning
        requests = []
        for key, shard in self.shards.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                continue  # missing, or an object: reported by DistFormat before DCP runs
            chunk = ChunkStorageMetadata(offsets=torch.Size(shard.global_offset), sizes=shard.tensor.shape)
            same = _same_chunk(key, md, chunk)
            requests += [same] if same is not None else create_read_items_for_chunk_list(key, md, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.shards[index.fqn].tensor

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise UnsafeCheckpointError(f"{self.where}: entry {read_item.dest_index.fqn!r} is a pickled object; refusing")


def _same_chunk(key: str, md: Any, chunk: ChunkStorageMetadata) -> ReadItem | None:
    """The read of a box saved exactly as it is wanted (a load at the saved layout), or None.

    Saved chunks never overlap, so a saved chunk equal to the wanted box is the only one
    to read. This is the item DCP's resharding sweep returns for it, at a fraction of its
    cost per tensor (it shows at thousands of tensors per rank).
    """
    if not isinstance(md, TensorStorageMetadata):
        return None
    for index, saved in enumerate(md.chunks):
        if saved.offsets == chunk.offsets and saved.sizes == chunk.sizes:
            zeros = torch.Size([0] * len(chunk.sizes))
            return ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(key, chunk.offsets, 0),
                dest_offsets=zeros,
                storage_index=MetadataIndex(key, saved.offsets, index),
                storage_offsets=zeros,
                lengths=torch.Size(chunk.sizes),
            )
    return None


class SafeFileSystemReader(StreamingReads, SafeMetadata, FileSystemReader):
    """DCP's local reader, with safe metadata loading and one checked pass per file (see StreamingReads)."""


class SafeFsspecReader(StreamingReads, SafeMetadata, FsspecReader):
    """DCP's fsspec reader (object storage), with safe metadata loading and one checked pass per file."""

    direct_reads = False  # reading an item's end first would defeat the object store's read-ahead

    def __init__(self, path: str):
        # as HashingFsspecWriter: shardpoint's client for an object store's URL; any other
        # protocol (the node-local view's shardpoint-node://, registered with fsspec) from
        # fsspec's registry
        FileSystemReader.__init__(self, path)
        self.fs = FsspecFileSystem()
        self.fs.fs = object_filesystem(path, READ_BLOCK) if is_object_url(path) else fsspec.core.url_to_fs(path)[0]
        self.path = path


class _RecordingStreams:
    """Mixin for DCP filesystems: record size and checksum of every file written through them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, FileRecord] = {}
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        inner = cast(FileSystemBase, super())  # the DCP filesystem this mixin is combined with
        if mode != "wb":
            with inner.create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with inner.create_stream(path, mode) as raw, without_zip_crc32():
                writer = HashingWriter(raw)
                yield writer
                writer.flush()
        except BaseException as exc:
            with self._lock:
                self.errors.append(exc)  # DCP's extra writer threads drop their exceptions; see _CompleteWrites
            raise
        with self._lock:
            self.records[os.fspath(path)] = writer.record()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        cast(FileSystemBase, super()).rename(path, new_path)
        with self._lock:
            if os.fspath(path) in self.records:
                self.records[os.fspath(new_path)] = self.records.pop(os.fspath(path))


class HashingFileSystem(_RecordingStreams, FileSystem):
    """DCP's local filesystem, recording what it writes."""


class HashingFsspecFileSystem(_RecordingStreams, FsspecFileSystem):
    """DCP's fsspec filesystem (uploads on close), recording what it writes."""


class _CompleteWrites:
    """Mixin for DCP writers: fail the save when any write item has no result.

    With ``thread_count > 1`` DCP runs extra writer threads whose exceptions are lost:
    their items silently have no storage record and the save "succeeds" without
    them. Every item of this rank's plan must come back written, or the first error
    any writer thread hit (a full disk becomes a StorageError upstream) is raised.
    """

    fs: Any  # the writer's _RecordingStreams filesystem, set by the writer's __init__
    records: Callable[[], dict[str, FileRecord]]  # this rank's files, relative to the checkpoint (each writer's)
    copy_file: Callable[[str, str], None]  # a sibling checkpoint's file copied in (writers with copies_referred)
    dedup: Any = None  # formats.dedup.StoredItems: frozen items stored already are referred to, not written
    frozen: frozenset[str] = frozenset()  # the keys dedup may refer to
    referred: Mapping[str, FileRecord] = MappingProxyType({})  # the earlier checkpoints' files referred to
    copies_referred = False  # object stores: the files referred to are copied in, server-side (formats.dedup)

    def finish(self, metadata: Metadata, results: Any) -> None:
        super().finish(metadata, results)  # type: ignore[misc]
        self.metadata: Metadata | None = metadata  # rank 0 of a dcp.save: its index (dist_save.index_after_dcp)

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        to_write, refer = self.dedup.split(plan, planner, self.frozen) if self.dedup is not None else (plan, {})
        if refer and self.copies_referred:
            copied = self.dedup.copy_into(refer, self.copy_file)
            if len(copied) < len(refer):  # a file that could not be copied: its items are written
                to_write = dataclasses.replace(plan, items=[i for i in plan.items if i.index not in copied])
            refer = copied
        results = write_plan(self, to_write, planner)  # DCP's layout, fewer calls per item
        dir_name = self.dedup.dir_name if self.dedup is not None else ""
        if self.dedup is not None:
            self.dedup.written(results, self.records())
            self.referred = dedup.referred_records(refer, dir_name)
        future: Future = Future()
        future.set_result(results + dedup.referred_results(refer, dir_name))
        written = {result.index for result in future.value()}
        missing = [item.index.fqn for item in plan.items if item.index not in written]
        if missing:
            errors = self.fs.errors
            if errors:
                raise errors[0]
            raise CheckpointError(f"{len(missing)} tensor(s) were not written, e.g. {missing[:3]}; nothing committed")
        return future


class HashingFileSystemWriter(_CompleteWrites, FileSystemWriter):
    """DCP's FileSystemWriter whose files are checksummed while they are written."""

    def __init__(self, path: str, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = HashingFileSystem()

    def records(self) -> dict[str, FileRecord]:
        """This rank's files, relative to the checkpoint directory."""
        root = os.fspath(self.path)
        return {os.path.relpath(p, root): r for p, r in self.fs.records.items()}


class HashingFsspecWriter(_CompleteWrites, FsspecWriter):
    """DCP's FsspecWriter (object storage) with checksums computed while uploading."""

    def __init__(self, path: str, **kwargs: Any):
        # FsspecWriter.__init__ would pick the filesystem by URL through fsspec's registry
        # (for gs:// a gcsfs class that needs gRPC); shardpoint's own client settings instead
        FileSystemWriter.__init__(self, path, sync_files=False, **kwargs)
        self.fs = HashingFsspecFileSystem()
        self.fs.fs = object_filesystem(path, WRITE_BLOCK)
        self.path = path

    copies_referred = True

    def records(self) -> dict[str, FileRecord]:
        root = os.fspath(self.path).rstrip("/") + "/"
        return {p.removeprefix(root): r for p, r in self.fs.records.items()}

    def copy_file(self, source: str, name: str) -> None:
        """Copy ``source`` (a file of a checkpoint beside this one) into this checkpoint as ``name``, server-side."""
        here = os.fspath(self.path).rstrip("/")
        src, dst = f"{here.rpartition('/')[0]}/{source}", f"{here}/{name}"
        retrying(lambda: self.fs.fs.copy(src, dst), f"copying {src} to {dst}", store_of(dst).is_transient)


def dcp_writer(
    storage: Storage, directory: str, thread_count: int = 1
) -> HashingFileSystemWriter | HashingFsspecWriter:
    """A DCP writer for ``directory`` on ``storage`` that checksums what it writes (see ``.records()``)."""
    if storage.is_local:
        return HashingFileSystemWriter(directory, sync_files=True, thread_count=thread_count)
    return HashingFsspecWriter(directory, thread_count=thread_count)


def dcp_reader(
    storage: Storage,
    directory: str,
    thread_count: int = 1,
    expected: dict[str, FileRecord] | None = None,
    contiguous_items: bool = False,
    listed: Mapping[str, FileRecord] | None = None,
) -> SafeFileSystemReader | SafeFsspecReader:
    """A DCP reader for ``directory`` on ``storage`` that never unpickles more than DCP metadata.

    ``expected``: records of the files whose checksums are checked while reading;
    ``contiguous_items``: the checkpoint says every item is a contiguous tensor
    (``CheckpointMetadata.contiguous_items``), so items are decoded without ``torch.load``;
    ``listed``: the marker's files (``CheckpointMetadata.files``), the only ones the
    reader opens, each item within its recorded size (DESIGN invariant 16).
    """
    reader = SafeFileSystemReader(directory) if storage.is_local else SafeFsspecReader(directory)
    reader.thread_count = thread_count
    reader.expected = expected
    reader.listed = listed
    reader.contiguous_items = contiguous_items
    return reader


class DistFormat:
    """``format="dist"``: sharded, deduplicated, reshardable on load."""

    name = "dist"
    shared_reads = True  # replicas split the reading (formats.shared_reads); False: every rank reads its own
    exchange_route = "auto"  # how shared reads pass chunks on (shared_reads.route_for): auto, control, trainer
    checks_in_first_round = True  # load runs ``ctx.checks`` inside its plan round (see LoadPipeline._verify)
    restores_in_last_round = True  # and ``ctx.restore`` inside its last round (see LoadPipeline._read_and_restore)

    def save(self, ctx: FormatContext, flat: FlatState) -> dict[str, FileRecord]:
        rank = comm.rank()
        storage, directory = ctx.storage, ctx.directory
        storage.makedirs(storage.join(directory, "rng"))
        writer = dcp_writer(storage, directory, ctx.thread_count)
        writer.dedup, writer.frozen = ctx.dedup, frozenset(flat.frozen)
        shards = _shards(flat, rank)
        state_dict = {key: shard.tensor for key, shard in shards.items()}
        planner = ShardSavePlanner(shards)
        with dcp_errors(directory), paused_gc():
            dist_save.write(ctx, writer, planner, state_dict, lambda: self.fingerprint(ctx, flat))
        ctx.pending["writer"] = writer
        files = {**writer.records(), **writer.referred}
        if flat.per_rank:
            path = storage.join(directory, rng_file(rank))
            files[rng_file(rank)] = write_torch_file(flat.per_rank, path, storage)
        if rank == 0:
            files[COMMON_FILE] = write_torch_file(flat.common, storage.join(directory, COMMON_FILE), storage)
        return files

    def fingerprint(self, ctx: FormatContext, flat: FlatState) -> str | None:
        # the specs of the items ShardSavePlanner would plan, without building them (per-item cost)
        specs = (shard_spec(key, shard) for key, shard in _shards(flat, comm.rank()).items() if _written(shard))
        return fingerprint_of(specs, comm.rank(), comm.world_size())

    def finish(self, ctx: FormatContext, parts: list[Any]) -> dict[str, FileRecord]:
        """Rank 0: ``.metadata`` from every rank's records (:mod:`~shardpoint.formats.dist_save`)."""
        writer = ctx.pending["writer"]
        with dcp_errors(ctx.directory):
            if not dist_save.finish(ctx, writer, parts):
                return {}  # dcp.save wrote it
        records = writer.records()
        return {name: records[name] for name in (DCP_METADATA, INDEX_NAME, ROWS_NAME) if name in records}

    def files_read_by_all(self, meta: CheckpointMetadata) -> list[str]:
        return sorted(meta.files)

    def checksummed_while_reading(self, meta: CheckpointMetadata) -> set[str]:
        """DCP's data files (see dcp_read), ``.metadata`` and the chunk index's files (load_parts.share_outline)."""
        index = (DCP_METADATA, INDEX_NAME, ROWS_NAME)
        return {name for name in meta.files if name.endswith(".distcp") or name in index}

    def load(self, ctx: FormatContext, flat: FlatState, meta: CheckpointMetadata) -> Loaded:
        """Four rounds at any rank count: the outline, the plan (gathered, then each rank's part), the reads.

        The chunk index (``.metadata`` without one) is read and checked once per job, by
        rank 0, which broadcasts only its outline (:func:`load_parts.share_outline`). Each
        rank places its targets against the outline (running the pipeline's file checks
        alongside) and sends rank 0 their boxes; rank 0 plans every rank's reads from the
        whole index and sends each rank
        its own part (:mod:`~shardpoint.formats.load_parts`), so no rank but rank 0
        holds another rank's chunks. Each rank then runs DCP's planner and reader on its
        part by itself (as ``dcp.load(no_dist=True)``); the outcome round raises any
        rank's failure everywhere.
        """
        expected = {n: meta.files[n] for n in self.checksummed_while_reading(meta)} if ctx.verify else None
        reader = dcp_reader(ctx.storage, ctx.directory, ctx.thread_count, expected, meta.contiguous_items, meta.files)
        reader.metadata_record = (expected or {}).get(DCP_METADATA)
        head = split_plan.share_head(reader, meta.files) if ROWS_NAME in meta.files else None
        if head is not None:  # planned by key across ranks (formats.split_plan)
            outline, whole = head.outline.metadata(), None
        else:  # an index without its rows apart, or none: planned on rank 0 (formats.load_parts)
            outline, whole = load_parts.share_outline(reader, meta.files)  # whole: rank 0's index (or .metadata)
        saved = sorted(outline.state_dict_metadata)
        local: dict[str, Any] = {}

        def prepare() -> load_parts.Request:
            if ctx.checks is not None:
                ctx.checks()  # the pipeline's file checks: their outcome rides on this round's
            targets, local["plan"] = self._targets(ctx, flat, meta, outline)
            load_parts.check_shapes(targets, outline, meta, ctx, flat)
            local["present"] = present = {k: s for k, s in targets.items() if k in outline.state_dict_metadata}
            keys = wanted_summary(targets, saved)  # bits, not names: rank 0 receives every rank's
            boxes = load_parts.boxes_of(present, outline, saved)
            return load_parts.Request(keys, *boxes, shared_reads.device_types(present))

        def plan(requests: list[load_parts.Request]) -> list[load_parts.Part]:
            assert whole is not None  # rank 0's
            shared = self.shared_reads and len(requests) > 1 and load_parts.stores_any(whole)
            budget = shared_reads.EXCHANGE_BUFFER_BYTES
            return load_parts.plan(whole, requests, shared, budget, ctx.directory)

        # one rank's mismatch (a pipeline stage's layer) must stop every rank before anything is read
        if head is not None:
            shared = self.shared_reads and comm.world_size() > 1
            part = split_plan.plan_part(ctx.storage, ctx.directory, meta.files, head, prepare, shared)
        else:
            part = comm.plan_at_root(prepare, plan, "preparing the load")
        position: dict[Any, int] = {}
        if isinstance(whole, Metadata) and comm.world_size() == 1:  # the part is the file: not rebuilt chunk by chunk
            metadata = whole
        else:
            metadata, position = part.metadata(outline, saved)
        present, placement = local["present"], local["plan"]
        planner = ShardLoadPlanner(present, ctx.directory)
        planner.set_up_planner({k: s.tensor for k, s in present.items()}, metadata, comm.rank() == 0)
        items = planner.create_local_plan().items
        missing, unexpected = part.missing, part.unexpected
        exchange = None
        if part.shared:
            route = shared_reads.route_for([part.kinds], self.exchange_route)
            exchange = shared_reads.Exchange(items, present, metadata, position, route, part.assignment(comm.rank()))
        listed_record(meta.files, COMMON_FILE, ctx.directory, "the dist format")  # read only what the marker lists
        common_path = ctx.storage.join(ctx.directory, COMMON_FILE)

        def read() -> tuple[list[str], int]:
            with dcp_errors(ctx.directory, loading=True), paused_gc():
                if exchange is None:  # what dcp.load(no_dist=True) does, without planning a second time
                    reader.set_up_storage_reader(metadata, comm.rank() == 0)
                    reader.read_data(LoadPlan(items), planner).wait()
                else:
                    _read_items(reader, metadata, present, exchange, ctx.directory)
            if exchange is not None:
                exchange.stage()  # outside dcp_errors: a GPU out of memory is not a damaged file
            local["common"] = read_torch_file(ctx.storage, common_path)
            local["per_rank"] = self._per_rank(ctx, meta)
            checked = load_parts.check_metadata_beside_index(reader, meta.files)
            outcome = sorted(reader.checked | reader.metadata_checked | checked), reader.bytes_read
            return outcome if exchanging else finish(outcome)

        def finish(outcome: Any) -> Any:
            """The last round's step, every tensor in place: zero what could not be placed, then the pipeline's
            restore (``ctx.restore``: scheduler, RNG, stateful), whose failure rides on this round's outcome."""
            rank_local.reinitialise(placement)
            local["loaded"] = Loaded(local["common"], local["per_rank"], missing, unexpected)
            if ctx.restore is not None:
                ctx.restore(local["loaded"])
            return outcome

        exchanging = exchange is not None and exchange.needed()  # the same on every rank
        outcomes = comm.agree_all(read, "reading the checkpoint")
        if exchanging and exchange is not None:
            running = exchange

            def pass_on() -> None:
                running.run(planner.resolve_tensor)
                finish(None)

            comm.agree(pass_on, "passing tensors to other ranks")
        if ctx.optimizer_reshard == "reinit":
            rank_local.warn_reinit(list(placement.reinit), ctx.directory)
        loaded = local["loaded"]
        loaded.checked = set().union(*(names for names, _ in outcomes))
        loaded.bytes_read = outcomes[comm.rank()][1]
        return loaded

    @staticmethod
    def _targets(
        ctx: FormatContext, flat: FlatState, meta: CheckpointMetadata, metadata: Metadata
    ) -> tuple[dict[str, Shard], rank_local.RankLocalPlan]:
        """Stored DCP key -> target shard (global keys, this rank's own rank-local keys), and the placement plan.

        Stored names are translated to current ones first (wrapper prefixes of older
        checkpoints, ``rename``), so placement and messages use the model's names.
        """
        rank = comm.rank()
        to_current = naming.stored_to_current(
            metadata.state_dict_metadata, ctx.rename, ctx.directory, canonical=meta.canonical_keys
        )
        to_stored = {current: stored for stored, current in to_current.items()}
        saved = {to_current.get(k, k) for k in metadata.state_dict_metadata}
        per_rank = [split for split in map(naming.split_key, saved) if split is not None]
        same_layout = meta.topology == ctx.topology.describe()
        plan = rank_local.resolve(
            flat,
            saved,
            {key for r, key in per_rank if r == rank} if same_layout else (),
            {key for _, key in per_rank},
            policy=ctx.optimizer_reshard,
            where=ctx.directory,
        )
        targets = dict(plan.shared)
        targets.update({naming.stored_key(k, rank): rank_local.whole(t) for k, t in plan.own.items()})
        return {to_stored.get(k, k): shard for k, shard in targets.items()}, plan

    def _per_rank(self, ctx: FormatContext, meta: CheckpointMetadata) -> dict[str, Any] | None:
        if meta.topology != ctx.topology.describe():
            if comm.rank() == 0:
                log.warning(
                    "checkpoint was saved at tp=%(tp)s pp=%(pp)s dp=%(dp)s; per-rank RNG streams and "
                    "TrainState.stateful objects (data loaders, samplers) are not restored at a different layout "
                    "(ranks no longer correspond): dropout masks differ and data loaders start afresh",
                    meta.topology,
                )
            return None
        name = rng_file(ctx.topology.rank)
        return read_torch_file(ctx.storage, ctx.storage.join(ctx.directory, name)) if name in meta.files else None


def _read_items(reader: Any, metadata: Metadata, present: dict[str, Shard], exchange: Any, where: str) -> None:
    """This rank's share of a shared load: DCP's reader on the items of the files it was given, no collective."""
    items, extra = exchange.read_items()
    targets = {**present, **extra}
    planner = ShardLoadPlanner(targets, where)
    planner.set_up_planner({k: s.tensor for k, s in targets.items()}, metadata, False)
    reader.set_up_storage_reader(metadata, False)
    reader.read_data(LoadPlan(items), planner).wait()


def _shards(flat: FlatState, rank: int) -> dict[str, Shard]:
    """What DCP writes for this rank: the global-key shards and the rank-local tensors under this rank's keys."""
    shards = dict(flat.tensors)
    shards.update({naming.stored_key(k, rank): rank_local.whole(t) for k, t in flat.rank_local.items()})
    return shards


def _written(shard: Shard) -> bool:
    """An empty local piece (uneven FSDP shards) has no box to write; DCP would dedup a real piece against it."""
    return shard.tensor.numel() > 0 or math.prod(shard.global_shape) == 0


def _write_item(key: str, shard: Shard) -> WriteItem:
    tensor = shard.tensor
    return WriteItem(
        index=MetadataIndex(key, torch.Size(shard.global_offset)),
        type=WriteItemType.SHARD if not shard.is_full else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(shard.global_offset), sizes=tensor.shape),
            properties=TensorProperties.create_from_tensor(tensor),
            size=torch.Size(shard.global_shape),
        ),
    )
