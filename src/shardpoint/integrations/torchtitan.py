"""torchtitan's checkpoint manager, with shardpoint's commit protocol, checksums and retention.

Switch a torchtitan job over in its config module (``--module pkg --config fn``)::

    config.checkpoint = ShardpointCheckpointManager.Config.like(config.checkpoint)

torchtitan builds whatever class owns ``config.checkpoint``'s type, so nothing in
torchtitan changes; ``like`` keeps every setting of the stock config.

What is written, and why this way
---------------------------------
A ``step-N`` folder holds the DCP checkpoint torchtitan's stock manager
(:class:`torchtitan.components.checkpointer.dcp.CheckpointManager`) writes: the
trainer's flattened state dict under torchtitan's own names (model keys at the top
level, ``optimizer.state.<fqn>.<name>`` and ``optimizer.param_groups.<fqn>.<key>``
from torchtitan's optimizer flattening, ``lr_scheduler.*``, ``dataloader.*``,
``train_state.*``), with the keys, stored types and shapes and ``.metadata`` planner
data that ``dcp.save`` gives it; only the split into ``.distcp`` files may differ.
Beside it, ``shardpoint.json`` lists every file with size and checksum.

shardpoint's own ``dist`` format could not be used: it stores ``model.<key>`` and keeps
non-tensor state in ``common.pt``, so the stock manager, whose strict ``dcp.load`` asks
for torchtitan's names, could not read it. Translating names both ways would copy
torchtitan's flattening rules (nested optimizer states, per-rank data-loader keys) and
break when they change. Writing torchtitan's own state dict instead keeps both
directions trivially true: the stock manager loads our folders as its own, and this
manager loads the stock manager's folders (no ``shardpoint.json``: read without
checksums, said in the log).

``Checkpointer.save`` takes a :class:`~shardpoint.TrainState`, so the manager hands
its state to the pipeline the Checkpointer drives,
:class:`~shardpoint.lifecycle.save_pipeline.SavePipeline`, with
:class:`TorchtitanFormat` as the format plug-in. Every save therefore gets what a
Checkpointer save gets: ranks write into ``.shardpoint-tmp-step-N-*`` and the folder
gets its final name only after every rank's files are written and the marker is in it
(a crash never leaves a half-written ``step-N``, as the stock manager's in-place writes can);
replicated tensors are checked equal across ranks; ``keep_latest_k`` is shardpoint's
retention (it deletes only folders it committed, never the stock manager's); async
saves snapshot the state to host memory before ``save`` returns and commit in the
background; failures on one rank are raised on all of them.

Loading mirrors the stock manager (newest ``step-N`` holding ``.metadata``, or
``load_step``; ``initial_load_path`` when the folder has none; step 0 and initial
loads model-only as configured; ``exclude_from_loading``), through shardpoint's
readers: sizes are checked first, checksums while reading, the ``.metadata`` and every
stored object are unpickled with restricted unpicklers, never ``weights_only=False``.
The data loader's ``dp_rank_N`` bytes, which torchtitan's loader passes to
``pickle.loads`` itself, are first unpickled by
:func:`~shardpoint.storage.safe_io.load_plain_pickle` (containers, numbers, strings,
tensors; anything else raises ``UnsafeCheckpointError`` naming the entry), and the
loader gets a fresh pickle of that result, never the stored bytes.

Limits: Hugging Face safetensors in or out (``initial_load_in_hf``, ``last_save_in_hf``)
are refused (use the stock manager for those); there is no ``upload_to``. The stock
manager finds steps with ``re.search("step-(\\d+)")``, so it also sees a
``.shardpoint-tmp-step-N-*`` folder that a crash left in the instant between DCP's
``.metadata`` and the rename; the next start of this manager removes such leftovers.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's own key naming
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful

from shardpoint.integrations import missing_framework

try:
    from torchtitan.components.checkpointer.base import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
except ModuleNotFoundError as exc:
    raise missing_framework(exc, "torchtitan", "torchtitan") from exc

from shardpoint.catalog.layout import get_layout
from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata, FileRecord
from shardpoint.checkpointer import default_thread_count
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.formats import FormatContext
from shardpoint.formats.dist import DCP_METADATA, ShardSavePlanner, dcp_reader, dcp_writer
from shardpoint.formats.dist_save import save_with_dcp
from shardpoint.lifecycle.load_pipeline import verify_share
from shardpoint.lifecycle.policy import preservation_policies
from shardpoint.lifecycle.save_pipeline import SavePipeline
from shardpoint.parallel import comm
from shardpoint.parallel.topology import Topology
from shardpoint.state.sharding import Shard, to_shard
from shardpoint.state.train_state import FlatState
from shardpoint.storage.base import Storage, open_storage
from shardpoint.storage.safe_io import load_plain_pickle, safe_torch_load

# how a torchtitan user picks another checkpoint, in the damage messages
_ADVICE = "Load an earlier step (checkpoint.load_step)"

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["ShardpointCheckpointManager", "TorchtitanFormat", "flat_state"]

log = logging.getLogger(__name__)

LAYOUT = get_layout("torchtitan")
OBJECTS = "torchtitan_objects"  # FlatState.common: non-tensor leaves, stored as DCP byte items
MAPPINGS = "torchtitan_mappings"  # FlatState.common: DCP's flattening paths (``.metadata`` planner data)


# --------------------------------------------------------------------------- the state and the format
def flat_state(states: Mapping[str, Any]) -> FlatState:
    """torchtitan's checkpoint state dict, flattened as ``dcp.save`` flattens it, as a :class:`FlatState`.

    Stateful values are asked for their ``state_dict()``, nested dicts get DCP's dotted
    keys. Tensors become shards (a ``DTensor`` its local box); everything else
    (hyperparameters, ``last_epoch``, data-loader state) stays an object.
    """
    plain = {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in states.items()}
    flat, mappings = flatten_state_dict(plain)
    tensors: dict[str, Shard] = {}
    objects: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = to_shard(value, key)
        else:
            objects[key] = value
    return FlatState(tensors, {OBJECTS: objects, MAPPINGS: dict(mappings)}, {})


class _SavePlanner(ShardSavePlanner):
    """shardpoint's shard planner, plus DCP byte items for the objects and DCP's planner data."""

    def __init__(self, shards: dict[str, Shard], objects: dict[str, Any], mappings: dict[str, Any]):
        super().__init__(shards)
        self.objects, self.mappings = objects, mappings

    def create_local_plan(self) -> SavePlan:
        items = list(super().create_local_plan().items)
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        merged: dict[str, Any] = {}
        for plan in all_plans:  # per-rank keys (dataloader.dp_rank_N) come from their own rank
            merged.update(plan.planner_data or {})
        plans, metadata = super().create_global_plan(all_plans)
        self.metadata = dataclasses.replace(metadata, planner_data=merged)
        return plans, self.metadata

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.objects:
            return self.objects[index.fqn]  # DCP's transform_object torch.saves it
        return super().lookup_object(index)


class TorchtitanFormat:
    """The format plug-in of :class:`SavePipeline` that writes torchtitan's DCP checkpoint (save side).

    ``save`` runs on every rank (on the background thread for async saves, over
    ``ctx.process_group``); ``dcp.save`` writes ``.metadata`` on rank 0, so ``finish``
    adds nothing. Loading is :meth:`ShardpointCheckpointManager.load`'s: it needs the
    trainer's live objects, which a format never sees.
    """

    name = "torchtitan"

    def save(self, ctx: FormatContext, flat: FlatState) -> dict[str, FileRecord]:
        objects = flat.common.get(OBJECTS, {})
        planner = _SavePlanner(flat.tensors, objects, flat.common.get(MAPPINGS, {}))
        state_dict = {**{key: shard.tensor for key, shard in flat.tensors.items()}, **objects}
        writer = dcp_writer(ctx.storage, ctx.directory, ctx.thread_count)
        with _dcp_errors(ctx.directory):
            save_with_dcp(ctx, writer, planner, state_dict)  # never replayed: every save plans afresh
        return writer.records()

    def fingerprint(self, ctx: FormatContext, flat: FlatState) -> str | None:
        return None  # never replayed: every save plans afresh

    def finish(self, ctx: FormatContext, parts: list[Any]) -> dict[str, FileRecord]:
        return {}

    def load(self, ctx: FormatContext, flat: FlatState, meta: CheckpointMetadata) -> Any:
        raise CheckpointError(
            f"{ctx.directory} is a torchtitan checkpoint: load it with ShardpointCheckpointManager.load() "
            "(or torchtitan's own CheckpointManager), which fills the trainer's objects"
        )

    def files_read_by_all(self, meta: CheckpointMetadata) -> list[str]:
        return sorted(meta.files)

    def checksummed_while_reading(self, meta: CheckpointMetadata) -> set[str]:
        return {name for name in meta.files if name.endswith(".distcp")}


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with stored objects unpickled weights-only (DCP's own uses ``weights_only=False``)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def create_local_plan(self) -> Any:
        try:
            return super().create_local_plan()
        except RuntimeError as exc:
            if "Missing key" not in str(exc):
                raise
            if self.metadata is None:  # DCP sets it before planning: a failure without it is DCP's own
                raise
            missing = sorted(k for k in self.state_dict if k not in self.metadata.state_dict_metadata)
            parts = sorted({key.split(".", 1)[0] for key in missing})
            raise CheckpointError(
                f"{self.where} does not hold the {', '.join(parts)} state being loaded ({len(missing)} keys, "
                f"e.g. {', '.join(missing[:3])}). A model-only checkpoint (the last step with last_save_model_only) "
                "cannot resume training: load another step (load_step), or put those states in exclude_from_loading"
            ) from None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = safe_torch_load(value, name=f"{self.where}: entry {fqn!r}")
        if fqn.startswith(f"{DATALOADER}.") and isinstance(obj, bytes):
            # torchtitan's ParallelAwareDataloader calls pickle.loads on these bytes: hand it a fresh
            # pickle of what the restricted unpickler built, never the stored bytes
            obj = pickle.dumps(load_plain_pickle(obj, f"{self.where}: entry {fqn!r}"))
        set_element(self.original_state_dict, self.mappings[fqn], obj)


# --------------------------------------------------------------------------- the manager
class ShardpointCheckpointManager(BaseCheckpointManager):
    """A torchtitan checkpoint manager whose saves are committed, checksummed and retained by shardpoint.

    Built by torchtitan's trainer from its config exactly as the stock manager is
    (``config.checkpoint.build(dataloader=..., model_parts=..., optimizers=...,
    lr_schedulers=..., states={"train_state": trainer}, sd_adapter=..., base_folder=...)``);
    every rank builds it, and every rank calls ``load``, ``save``, ``maybe_wait_for_saving``
    and ``close``. See the module docstring for what is written.

    Example (a config module)::

        def llama3_debugmodel_shardpoint():
            config = llama3_debugmodel()
            config.checkpoint = ShardpointCheckpointManager.Config.like(config.checkpoint)
            return config
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """The stock fields (interval, keep_latest_k, load_step, ...) mean what they mean there; plus:"""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """Either async mode: the state is copied to host memory (pinned for GPU tensors) before
        ``save`` returns, then written and committed in the background; staging never outlives
        ``save``, so ``maybe_wait_for_staging`` has nothing to wait for."""

        verify: bool = True
        """Check file checksums on load (sizes are always checked)."""

        thread_count: int | None = None
        """Writer and reader threads per rank (default: twice the cores, at most 4)."""

        replica_check_interval: int = 1
        """Compare tensors several ranks hold (plain tensors, replicated DTensor boxes) on the
        first save and every N-th after it; 0: never."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(
                    f"checkpoint.async_mode must be disabled, async or async_with_pinned_mem, got {self.async_mode!r}"
                )
            if self.initial_load_in_hf or self.last_save_in_hf:
                raise ValueError(
                    "ShardpointCheckpointManager reads and writes torchtitan's DCP checkpoints only; for "
                    "checkpoint.initial_load_in_hf / last_save_in_hf use torchtitan's CheckpointManager"
                )
            if self.replica_check_interval < 0:
                raise ValueError(f"checkpoint.replica_check_interval must be >= 0, got {self.replica_check_interval}")

        @classmethod
        def like(cls, other: BaseCheckpointManager.Config, **changes: Any) -> ShardpointCheckpointManager.Config:
            """This Config with every setting of ``other`` (e.g. the stock manager's) it shares, then ``changes``."""
            ours = {f.name for f in dataclasses.fields(cls) if f.init}
            shared = {f.name: getattr(other, f.name) for f in dataclasses.fields(other) if f.init and f.name in ours}
            return cls(**{**shared, **changes})

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: Future | None = None  # set while an async save is written and not yet committed
        self._pending_since = 0.0  # the pipeline's last commit time when that save started
        if not self.enable:
            return
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states  # torchtitan's own dict, extended in place as the stock manager does
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.keep_latest_k = config.keep_latest_k
        self.async_save = config.async_mode != "disabled"
        self.verify = config.verify
        self.thread_count = config.thread_count or default_thread_count()
        comm.control_group()  # collective: created here, on every rank in the same order
        self.storage: Storage = open_storage(self.folder)
        self.root = self.storage.root
        self.pipeline = SavePipeline(
            self.storage,
            self.root,
            layout=LAYOUT,
            fmt=TorchtitanFormat(),
            topology=Topology(1, 1, comm.world_size()),
            config={},
            preservation=preservation_policies(self.keep_latest_k or None, None, None),
            thread_count=self.thread_count,
            replica_check_interval=config.replica_check_interval,
            async_save=self.async_save,
        )
        log.info("shardpoint checkpoints for torchtitan in %s", self.root)

    # ------------------------------------------------------------------ saving
    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save at the stock manager's steps: the interval, step 1 if asked, and the last step.

        The last step's save is synchronous and, with ``last_save_model_only``, holds the
        model alone in ``export_dtype`` (for export, not for resuming), as in the stock manager.
        """
        self._commit_pending(blocking=False)
        if not self._should_save(curr_step, last_step):
            return False
        self._commit_pending(blocking=True)  # one save in flight, as the stock manager waits
        begin = time.monotonic()
        comm.from_root(lambda: self._check_target(curr_step), "checking the checkpoint folder")
        states = self._last_step_states() if last_step else self._flattened_model_states_sd()
        background = self.async_save and not last_step
        path = self.pipeline.start(curr_step, flat_state(states), {}, {}, background=background)
        if background:
            self._pending_since = self.pipeline.times.last_save_time
            self.save_future = Future()
        log.info("%s %s in %.2f s", "staged" if background else "saved", path, time.monotonic() - begin)
        return True

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _check_target(self, step: int) -> None:
        """Rank 0: a ``step-N`` that shardpoint did not write is never replaced (foreign data stays as it is)."""
        path = self.storage.join(self.root, LAYOUT.dir_name(step))
        if self.storage.is_dir(path) and not self.storage.exists(self.storage.join(path, MARKER_NAME)):
            raise CheckpointError(
                f"{path} exists and was not written by shardpoint (no {MARKER_NAME}), e.g. by torchtitan's own "
                "manager; shardpoint never overwrites it: move it away, or resume from it (load_step) and let "
                "training save the later steps"
            )

    def _flattened_model_states_sd(self, states: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The stock manager's layout: model keys at the top level beside the other states."""
        states = self.states if states is None else states
        flat = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            flat.update(states[MODEL].state_dict())
        return flat

    def _last_step_states(self) -> dict[str, Any]:
        if not self.last_save_model_only:
            return self._flattened_model_states_sd()
        dtype = self.export_dtype
        return {
            k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype else v
            for k, v in self.states[MODEL].state_dict().items()
        }

    def _commit_pending(self, blocking: bool) -> None:
        """Commit a finished background save (``blocking``: wait for it); collective while one is pending."""
        future = self.save_future
        if future is None:
            return
        try:
            self.pipeline.finalize(blocking)
        except BaseException as exc:
            self.save_future = None
            future.set_exception(exc)
            raise
        if blocking or self.pipeline.times.last_save_time != self._pending_since:
            self.save_future = None
            future.set_result(None)

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: ``save`` returns once the state sits in host memory."""

    def _wait_for_saving(self) -> None:
        self._commit_pending(blocking=True)

    def _close(self) -> None:
        try:
            self._commit_pending(blocking=True)
        finally:
            self.pipeline.close()

    # ------------------------------------------------------------------ loading
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (-1: the newest), else ``initial_load_path``; False on a fresh start.

        The newest is the highest ``step-N`` that shardpoint committed or that holds DCP's
        ``.metadata`` (the stock manager's), whichever manager wrote it.

        Raises:
            CorruptCheckpointError: a file is missing, truncated or fails its checksum (named).
            CheckpointError: ``step`` does not exist, or the checkpoint lacks keys being loaded.
        """
        self._commit_pending(blocking=True)
        self.pipeline.wait_deletions()
        found = comm.from_root(lambda: self._find(step), "finding the checkpoint")
        if found is None:
            if not self.initial_load_path:
                log.info("no checkpoint in %s: a fresh start", self.root)
                return False
            storage = open_storage(self.initial_load_path)
            path = storage.root
            marker = comm.from_root(lambda: _committed(storage, path), "opening initial_load_path")
            model_only = self.initial_load_model_only
        else:
            storage, (step, path, marker) = self.storage, found
            model_only = step == 0  # a seed checkpoint holds the model only
        begin = time.monotonic()
        states = self._states_to_load(model_only)
        self._read(storage, path, marker, states)
        self.states[MODEL].load_state_dict(states)  # DCP filled the tensors; this refreshes the wrapper
        log.info("loaded %s in %.2f s", path, time.monotonic() - begin)
        return True

    def _find(self, step: int) -> tuple[int, str, str | None] | None:
        """Rank 0: ``(step, directory, marker text or None)`` to load, or None when there is nothing."""
        storage, root = self.storage, self.root
        if not storage.is_dir(root):
            if step != -1:
                raise CheckpointError(f"checkpoint.load_step={step}: checkpoint folder {root} does not exist")
            return None
        steps = self._loadable_steps()
        if step == -1:
            if not steps:
                return None
            step = max(steps)
        elif step not in steps:
            raise CheckpointError(
                f"checkpoint.load_step={step}: no loadable {LAYOUT.dir_name(step)} in {root}; "
                f"loadable steps: {sorted(steps) or 'none'}"
            )
        path = storage.join(root, LAYOUT.dir_name(step))
        return step, path, _committed(storage, path)

    def _loadable_steps(self) -> set[int]:
        storage, found = self.storage, set()
        for name in storage.listdir(self.root):
            step = LAYOUT.parse_dir_name(name)
            path = storage.join(self.root, name)
            if step is not None and any(storage.exists(storage.join(path, f)) for f in (MARKER_NAME, DCP_METADATA)):
                found.add(step)
        return found

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return self.states[MODEL].state_dict()
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        kept = {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}
        return self._flattened_model_states_sd(kept)

    def _read(self, storage: Storage, path: str, marker: str | None, states: dict[str, Any]) -> None:
        """Every rank: check sizes (and ``.metadata``'s checksum), then let DCP fill ``states``, checking the rest.

        Each rank reads the boxes it needs (DCP plans the reads from the live tensors,
        at any sharding) and checksums the files it reads most of; files no rank
        checked that way are checksummed after, split over the ranks.
        """
        meta = CheckpointMetadata.from_json(marker, storage.join(path, MARKER_NAME)) if marker else None
        if meta is None:
            log.info(
                "%s has no %s (written by torchtitan's own manager): loading it without checksums", path, MARKER_NAME
            )
        streamed = {n for n in meta.files if n.endswith(".distcp")} if meta and self.verify else set()
        if meta is not None:
            names = sorted(meta.files)
            comm.agree(
                lambda: verify_share(storage, path, meta, names, self.verify, streamed, _ADVICE), "verifying files"
            )
        expected = {n: meta.files[n] for n in streamed} if meta is not None and self.verify else None
        contiguous = bool(meta and meta.contiguous_items)
        reader = dcp_reader(storage, path, self.thread_count, expected, contiguous, meta.files if meta else None)

        def read() -> list[str]:
            with _dcp_errors(path):
                dcp.load(states, storage_reader=reader, planner=_SafeLoadPlanner(path), no_dist=True)
            return sorted(reader.checked)

        checked = set().union(*comm.agree_all(read, "reading the checkpoint"))
        unread = sorted(streamed - checked)
        if unread and meta is not None:
            comm.agree(lambda: verify_share(storage, path, meta, unread, True, set(), _ADVICE), "verifying files")


def _committed(storage: Storage, path: str) -> str | None:
    """The marker text of a checkpoint directory, None for the stock manager's (``.metadata``, no marker)."""
    marker = storage.join(path, MARKER_NAME)
    if storage.exists(marker):
        return storage.read_bytes(marker).decode("utf-8", errors="replace")
    if not storage.is_dir(path):
        raise CheckpointError(f"{path} is not a directory; point initial_load_path at a step-N checkpoint folder")
    if not storage.exists(storage.join(path, DCP_METADATA)):
        raise CorruptCheckpointError(
            f"{path} has neither {MARKER_NAME} nor {DCP_METADATA}: a save into it did not finish; load another step"
        )
    return None


@contextmanager
def _dcp_errors(directory: str) -> Iterator[None]:
    """DCP's CheckpointException (every rank's traceback) as the first failing rank's own error."""
    try:
        yield
    except CheckpointException as exc:
        rank, (error, _) = min(exc.failures.items(), key=lambda item: item[0])
        if isinstance(error, (CheckpointError, OSError)):
            raise error from None
        raise CheckpointError(f"{directory}: rank {rank}: {type(error).__name__}: {error}") from None
