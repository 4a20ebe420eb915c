"""The load, step by step: the mirror of :mod:`shardpoint.lifecycle.save_pipeline`.

Every rank runs the same sequence::

    find        rank 0 picks the checkpoint (tracker, ``iteration=N``, newest intact
                with ``fallback``) and broadcasts it (:mod:`~shardpoint.lifecycle.discovery`)
    open        the storage to read it through: the save directory, the object store,
                or this node's copy in front of the object store
    config      the saved config against the Checkpointer's
    verify      sizes of every file some rank reads, and the checksums of those the
                format does not check while reading them, split over the ranks
    collect     the live tensors to fill (optimizer state created where missing)
    read        the format fills them in place, checking the rest of the checksums
    restore     optimizer shards, scheduler, RNG, ``TrainState.stateful`` and ``extra``:
                the last step of the read's last agreement round, so a failure on one
                rank (a crafted RNG state, a stateful rejecting its state) is raised on
                every rank with no round of its own

Each step that can fail on one rank runs under :func:`shardpoint.parallel.comm.agree`,
so every rank raises instead of leaving the others waiting in a collective (invariant 17:
no rank returns success from a load that failed on another, restores included).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardpoint.catalog.integrity import verify_files
from shardpoint.catalog.metadata import CheckpointMetadata
from shardpoint.errors import ConfigMismatchError, CorruptCheckpointError, MissingKeysError
from shardpoint.formats import CheckpointFormat, FormatContext, Loaded, get_format
from shardpoint.formats.base import read_torch_file
from shardpoint.lifecycle import faults
from shardpoint.lifecycle.discovery import LoadSources
from shardpoint.parallel import comm
from shardpoint.parallel.topology import Topology
from shardpoint.state.naming import Rename
from shardpoint.state.rank_local import RESHARD_POLICIES
from shardpoint.state.train_state import (
    MODEL_PREFIX,
    OPTIM_PREFIX,
    FlatState,
    ParamIndex,
    TrainState,
    collect,
    load_optimizer_shards,
    load_resized,
    restore,
    restoring,
)
from shardpoint.storage.base import Storage

__all__ = ["LoadOptions", "LoadPipeline", "LoadResult", "verify_share"]

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    """What :meth:`Checkpointer.load` loaded.

    Attributes:
        iteration: the iteration to resume from (0 in finetune mode).
        release: the checkpoint was a release checkpoint.
        path: its directory.
        finetune: optimizer and RNG were not loaded and the iteration restarts at 0.
        extra: the ``TrainState.extra`` saved with it (e.g. ``consumed_samples``).
        metadata: the parsed ``shardpoint.json``.
        bytes_read: bytes this rank read from the checkpoint's data files (``dist``: replicas
            split the reading, so about the checkpoint's size over the job, not per replica).
        tier: where this rank's state came from: ``"persistent"`` (the save directory or
            object store), ``"local"`` (a non-persistent copy on this rank's node) or
            ``"peer"`` (a replica another node held, received over the process group).
        source: that source in words (a directory, or the rank and path of the replica).
        tiers: ``{rank: (tier, source)}`` for every rank of the job (the choice is collective).
    """

    iteration: int
    release: bool
    path: str
    finetune: bool
    extra: dict[str, Any]
    metadata: CheckpointMetadata
    storage: Storage | None = field(default=None, repr=False)  # node-local: valid until the next load or close()
    bytes_read: int = 0
    tier: str = "persistent"
    source: str = ""
    tiers: dict[int, tuple[str, str]] = field(default_factory=dict)

    def read_validation_logits(self) -> Any:
        """What was passed as ``validation_logits`` at save (checksum-verified with the rest), or None."""
        if self.metadata.validation_logits is None or self.storage is None:
            return None
        return read_torch_file(self.storage, self.storage.join(self.path, self.metadata.validation_logits))


@dataclass(frozen=True)
class LoadOptions:
    """The arguments of :meth:`shardpoint.Checkpointer.load` (documented there)."""

    iteration: int | None = None
    finetune: bool = False
    load_optimizer: bool = True
    load_rng: bool = True
    strict: bool | str = True  # True, False or "missing" (see Checkpointer.load)
    verify: bool = True
    fallback: bool = False
    optimizer_reshard: str = "error"
    rename: Rename = None

    def __post_init__(self) -> None:
        if self.strict not in (True, False, "missing"):
            raise ValueError(f"strict must be True, False or 'missing', got {self.strict!r}")
        if self.optimizer_reshard not in RESHARD_POLICIES:
            raise ValueError(f"optimizer_reshard must be one of {RESHARD_POLICIES}, got {self.optimizer_reshard!r}")


@dataclass
class _Opened:
    """A checkpoint chosen and opened: what the later steps read from."""

    meta: CheckpointMetadata
    fmt: CheckpointFormat
    ctx: FormatContext  # holds the storage and directory it is read through
    finetune: bool

    @property
    def storage(self) -> Storage:
        return self.ctx.storage

    @property
    def path(self) -> str:
        return self.ctx.directory


class LoadPipeline:
    """Loads a checkpoint into live state; one per Checkpointer (it keeps the last node view open)."""

    def __init__(
        self,
        sources: LoadSources,
        topology: Topology,
        *,
        config: Mapping[str, Any],
        allow_config_mismatch: Collection[str],
        thread_count: int,
    ):
        self.sources = sources
        self.topology = topology
        self.config = dict(config)
        self.allow_config_mismatch = set(allow_config_mismatch)
        self.thread_count = thread_count

    def run(self, state: TrainState, opts: LoadOptions) -> LoadResult | None:
        """Every rank: load into ``state``; None when there is nothing to load."""
        return self.run_found(state, opts, self.find(opts))

    def run_found(self, state: TrainState, opts: LoadOptions, found: tuple[str, str, str] | None) -> LoadResult | None:
        """Every rank: load what :meth:`find` returned (None: nothing to load)."""
        if found is None:
            return None
        return self._load_opened(state, self._open(found, opts), opts)

    def run_opened(
        self,
        state: TrainState,
        opts: LoadOptions,
        fmt: CheckpointFormat,
        storage: Storage,
        path: str,
        meta: CheckpointMetadata,
        tiers: dict[int, tuple[str, str]],
    ) -> LoadResult:
        """Every rank: load a checkpoint that another component chose and opened (the local tier).

        ``path`` on ``storage`` is this rank's own directory of it, read by ``fmt``;
        ``tiers`` says where every rank's state comes from. The steps after ``open``
        are the same as for a persistent checkpoint.
        """
        ctx = FormatContext(storage, path, self.topology, strict=opts.strict, thread_count=self.thread_count)
        return self._load_opened(state, _Opened(meta, fmt, ctx, False), opts, tiers)

    def _load_opened(
        self, state: TrainState, opened: _Opened, opts: LoadOptions, tiers: dict[int, tuple[str, str]] | None = None
    ) -> LoadResult:
        self._check_config(opened.meta, opened.path)
        streamed = self._verify(opened, opts)
        flat = self._collect_targets(state, opened, opts)
        faults.hit("mid-load", comm.rank())
        loaded = self._read_and_restore(state, opened, flat, streamed, opts)
        log.info(
            "loaded %s (iteration %d%s)", opened.path, opened.meta.iteration, ", finetune" if opened.finetune else ""
        )
        tiers = tiers or {r: ("persistent", opened.path) for r in range(comm.world_size())}
        return LoadResult(
            0 if opened.finetune else opened.meta.iteration,
            opened.meta.release,
            opened.path,
            opened.finetune,
            dict(loaded.common.get("extra", {})),
            opened.meta,
            opened.storage,
            loaded.bytes_read,
            *tiers[comm.rank()],
            tiers,
        )

    def close(self) -> None:
        self.sources.close()

    # ------------------------------------------------------------------ steps
    def find(self, opts: LoadOptions) -> tuple[str, str, str] | None:
        """Rank 0 decides, everyone receives the one answer: ``(where, directory, marker text)``."""
        return comm.from_root(
            lambda: self.sources.find(opts.iteration, opts.verify and opts.fallback), "finding the checkpoint"
        )

    def _open(self, found: tuple[str, str, str], opts: LoadOptions) -> _Opened:
        where, path, meta_json = found
        meta = CheckpointMetadata.from_json(meta_json, path)
        storage, path = self.sources.reader(where, path, meta, opts.verify)  # local, remote, or node + remote
        ctx = FormatContext(
            storage,
            path,
            self.topology,
            strict=opts.strict,
            thread_count=self.thread_count,
            optimizer_reshard=opts.optimizer_reshard,
            rename=opts.rename,
            verify=opts.verify,
        )
        return _Opened(meta, get_format(meta.format), ctx, opts.finetune or meta.release)

    def _check_config(self, meta: CheckpointMetadata, path: str) -> None:
        differences = {
            key: (meta.config.get(key), self.config.get(key))
            for key in set(meta.config) | set(self.config)
            if key not in self.allow_config_mismatch and meta.config.get(key) != self.config.get(key)
        }
        if differences and self.config:
            raise ConfigMismatchError(path, differences)

    def _verify(self, opened: _Opened, opts: LoadOptions) -> set[str]:
        """Check this rank's share of the files; returns those the format checksums while reading.

        The files are every file some rank reads (each rank's own list may differ: torch
        format), split over all ranks. A format that says ``checks_in_first_round`` runs
        the check itself, first thing in its first agreement, so no rank reads a tensor
        from a damaged checkpoint and the load needs no round of its own for it.
        """
        fmt, meta = opened.fmt, opened.meta
        files = fmt.files_read_by_all(meta)
        streamed = fmt.checksummed_while_reading(meta) if opts.verify else set()

        def check() -> None:
            verify_share(opened.storage, opened.path, meta, files, opts.verify, streamed)

        if getattr(fmt, "checks_in_first_round", False):
            opened.ctx.checks = check  # the format's first round carries the outcome: one round fewer
        else:
            comm.agree(check, "verifying checkpoint files")
        return streamed

    def _collect_targets(self, state: TrainState, opened: _Opened, opts: LoadOptions) -> FlatState:
        return collect(
            state,
            iteration=opened.meta.iteration,
            include_optimizer=opts.load_optimizer and not opened.finetune,
            include_rng=False,
            init_optimizer=True,
            resizable=True,
        )

    def _read_and_restore(
        self, state: TrainState, opened: _Opened, flat: FlatState, streamed: set[str], opts: LoadOptions
    ) -> Loaded:
        """Fill ``flat`` and restore the rest into ``state``, with one outcome on every rank.

        A format that says ``restores_in_last_round`` runs the restore (``ctx.restore``) as
        the last step of its last agreement round, once every tensor is in place, so its
        outcome rides on that round's; for any other format the restore is agreed in a
        round of its own.
        """

        def restore(loaded: Loaded) -> None:
            self._restore(state, flat, loaded, opened, opts)

        fmt = opened.fmt
        if getattr(fmt, "restores_in_last_round", False):
            opened.ctx.restore = restore
            loaded = fmt.load(opened.ctx, flat, opened.meta)
        else:
            loaded = fmt.load(opened.ctx, flat, opened.meta)
            comm.agree(lambda: restore(loaded), "restoring the loaded state")
        _verify_unread(opened.storage, opened.path, opened.meta, streamed, loaded.checked)
        return loaded

    def _restore(self, state: TrainState, flat: FlatState, loaded: Loaded, opened: _Opened, opts: LoadOptions) -> None:
        """Everything but the tensors filled in place; a failure names the item, the rank and the checkpoint."""
        where = f"checkpoint {opened.path}"
        _forget_unsaved_optimizer_state(state, flat, loaded)
        with restoring("the model's resized tensors", where, "or load into a model of the saved sizes"):
            load_resized(state, flat)
        unexpected = [] if opts.strict == "missing" else loaded.unexpected  # "missing": saved extras are skipped
        if opts.strict and (loaded.missing or unexpected):
            raise MissingKeysError(opened.path, loaded.missing, unexpected)
        with_optimizer = opts.load_optimizer and not opened.finetune
        if state.optimizer is not None and with_optimizer:
            keep = "or load with load_optimizer=False to keep the current optimizer state"
            with restoring("the optimizer's shards (load_sharded_state_dict)", where, keep):
                load_optimizer_shards(state.optimizer, flat.tensors)
        if not opened.finetune:
            per_rank = loaded.per_rank if opts.load_rng else None
            restore(state, loaded.common, per_rank, include_optimizer=opts.load_optimizer, where=where)


def _forget_unsaved_optimizer_state(state: TrainState, flat: FlatState, loaded: Loaded) -> None:
    """Parameters that had no optimizer state at the save (never stepped, or no gradient yet) are not an error.

    Loading created their state (to have targets to fill); drop it again so they start
    as they would have at the save.
    """
    missing = set(loaded.missing)
    by_param: dict[str, set[str]] = {}
    for key in [*flat.tensors, *flat.rank_local]:
        if key.startswith(OPTIM_PREFIX):
            by_param.setdefault(key[len(OPTIM_PREFIX) :].rsplit(".", 1)[0], set()).add(key)
    unsaved = {param for param, keys in by_param.items() if keys <= missing}
    if not unsaved:
        return
    loaded.missing = [
        k
        for k in loaded.missing
        if not (k.startswith(OPTIM_PREFIX) and k[len(OPTIM_PREFIX) :].rsplit(".", 1)[0] in unsaved)
    ]
    optimizer = state.optimizer
    if isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "sharded_state_dict"):
        index = ParamIndex(state.model, {k: v for k, v in flat.tensors.items() if k.startswith(MODEL_PREFIX)})
        for group in optimizer.param_groups:
            for param in group["params"]:
                if index.lookup(param) in unsaved:
                    optimizer.state.pop(param, None)


def verify_share(
    storage: Storage,
    path: str,
    meta: CheckpointMetadata,
    names: list[str],
    checksums: bool,
    sizes_only: Collection[str] = (),
    advice: str = "Load an earlier iteration (iteration=N or fallback=True)",
) -> None:
    """Check this rank's share of ``names`` (round-robin): presence and size always, checksums if asked.

    ``sizes_only``: files whose checksums the load checks while reading them; ``advice``:
    how the caller's user picks another checkpoint (frameworks name their own setting).
    """
    missing_record = [n for n in names if n not in meta.files]
    if missing_record:
        raise CorruptCheckpointError(f"{path}: {missing_record[0]} is not listed in shardpoint.json")
    share = names[comm.rank() :: comm.world_size()] if len(names) >= comm.world_size() else names
    problems = verify_files(storage, path, meta, share, checksums=checksums, sizes_only=sizes_only)
    if problems:
        raise CorruptCheckpointError(
            f"checkpoint {path} is damaged: "
            + "; ".join(map(str, problems))
            + f". {advice}, or run `shardpoint verify` for a report"
        )


def _verify_unread(
    storage: Storage, path: str, meta: CheckpointMetadata, streamed: set[str], checked: set[str]
) -> None:
    """Check the files meant to be checked while reading that no rank read (nothing in them was loaded).

    ``checked``: the files any rank checked while reading (the format gathers them).
    """
    if not streamed:
        return
    unread = sorted(streamed - checked)
    if unread:
        comm.agree(lambda: verify_share(storage, path, meta, unread, True), "verifying checkpoint files")
