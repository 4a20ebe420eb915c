"""``ShardpointCheckpointEngine``: DeepSpeed's own checkpoint files, committed crash-safe and read back checked.

DeepSpeed has no config key for a third-party checkpoint engine, but the engine keeps
it in one attribute, ``engine.checkpoint_engine``, that every save and load goes
through (the model states, each ZeRO rank's optimizer states, a pipeline's layer
files). :func:`use` sets that attribute on an initialised engine::

    engine, optimizer, _, scheduler = deepspeed.initialize(...)
    shardpoint.integrations.deepspeed.use(engine)
    engine.save_checkpoint(save_dir, tag=f"global_step{step}", client_state=state)   # unchanged
    engine.load_checkpoint(save_dir)                                                    # unchanged

The files are byte for byte those of DeepSpeed's ``TorchCheckpointEngine`` (the same
``torch.save`` call), so DeepSpeed's loader, ``zero_to_fp32``, ``ds_to_universal`` and
GPT-NeoX read them. What changes (:mod:`~shardpoint.integrations.deepspeed.files`):
the tag is written in a hidden staging directory and renamed into place by a
collective commit that first writes ``shardpoint.json`` (every file's size and
checksum), and ``latest`` is replaced atomically after the rename. A load checks each
file against the marker and unpickles it without running code.

Why :func:`use` also wraps the engine's ``save_checkpoint`` (that one instance only):
after ``commit`` DeepSpeed's rank 0 rewrites ``latest`` with a plain ``open(.., "w")``,
which a kill at that moment leaves empty. The wrapper passes ``save_latest=False`` to
DeepSpeed and has the commit replace ``latest`` atomically itself.

Options beyond DeepSpeed's own (:class:`EngineOptions`, :mod:`.pending`): ``async_save``
(the state copied in memory, written on a thread, committed at a later optimizer step
once every rank's files are written: DeepSpeed's decoupled checkpointing),
``upload_to`` (each committed tag copied to an object store in the background) and
``keep_last`` (GPT-NeoX's ``keep_last_n_checkpoints``, without deleting by regex).

Limits: local (or POSIX-mounted) save directories; DeepSpeed's NVMe-offload copies,
which DeepSpeed writes with ``shutil.copytree`` beside the engine, are not covered.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.errors import CheckpointError
from shardpoint.integrations import missing_framework

try:
    import deepspeed.comm as ds_dist
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
except ModuleNotFoundError as exc:
    raise missing_framework(exc, "deepspeed", "deepspeed") from exc

from shardpoint.integrations.deepspeed.files import (
    LATEST,
    LATEST_UNIVERSAL,
    StagedTag,
    check_tag,
    read_checked,
    tag_iteration,
)
from shardpoint.integrations.deepspeed.pending import PendingSaves, SaveRequest
from shardpoint.integrations.deepspeed.whole_file import WholeFileEngine

__all__ = ["EngineOptions", "ShardpointCheckpointEngine", "use"]

log = logging.getLogger(__name__)
_WRAPPED = "_shardpoint_original_save_checkpoint"
_WRAPPED_LOAD = "_shardpoint_original_load_checkpoint"
_WRAPPED_16BIT = "_shardpoint_original_save_16bit_model"


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """What :func:`use` takes besides the engine.

    Attributes:
        config: the model's defining args, recorded in ``shardpoint.json`` (as
            ``Checkpointer(config=...)`` records them; GPT-NeoX's ``check_checkpoint_args``).
        unverified_ok: read a tag that has no ``shardpoint.json`` (one DeepSpeed's own
            engine wrote, from before the switch) without checksums; still no code is run.
        async_save: ``save_checkpoint`` returns once the state is copied in memory; the files
            are written on a thread and the tag is committed (``latest`` moved) at the first
            optimizer step after every rank's files are written (DeepSpeed's decoupled
            checkpointing). Call ``engine.destroy()`` or the checkpoint engine's ``wait()``
            before the process exits, or the last save stays uncommitted (``latest`` on the one before).
        upload_to: copy each committed tag to this ``s3://``, ``gs://`` or ``az://`` prefix (or a
            shared directory) in the background, committed there with its own ``latest``.
        keep_last: keep the newest N committed tags (locally and at ``upload_to``); None keeps all.
    """

    config: dict[str, Any] = field(default_factory=dict)
    unverified_ok: bool = False
    async_save: bool = False
    upload_to: str | None = None
    keep_last: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.config, dict):
            raise ValueError(f"config must be a dict of the model's defining args, not {type(self.config).__name__}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (None keeps every tag), got {self.keep_last}")


class ShardpointCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` writing DeepSpeed's files through shardpoint's commit.

    DeepSpeed calls, on every rank: ``create`` (collective here: rank 0 makes the
    staging directory), ``makedirs`` / ``save`` for the files this rank writes, then
    ``commit`` (collective: the marker, the rename, ``latest``). ``load`` is called per
    file by DeepSpeed's ``load_checkpoint``. With ``async_save`` or ``upload_to`` the
    engine is *decoupled*: DeepSpeed calls ``commit`` at each optimizer step instead,
    which commits what the background has finished (:mod:`.pending`).
    """

    def __init__(self, config_params: Any = None, options: EngineOptions | None = None):
        super().__init__(config_params)
        self.name = "ShardpointCheckpointEngine"
        self.options = options or EngineOptions()
        # the same setting DeepSpeed's TorchCheckpointEngine reads, so the bytes are the same
        self.zipfile_serialization = True
        if config_params is not None:
            self.zipfile_serialization = bool(config_params.checkpoint_config.get("checkpoint_serialization", True))
        self._engine: Any = None
        self._save_latest: bool | None = None  # set by use()'s wrapper for the save in progress
        self._staged: StagedTag | None = None
        #: set by use()'s load wrapper while DeepSpeed loads a universal checkpoint (see _wrap_load)
        self.universal_load = False
        self.pending = PendingSaves(
            async_save=self.options.async_save, upload_to=self.options.upload_to, keep_last=self.options.keep_last
        )
        #: seconds the last ``save_checkpoint`` held training (with ``async_save``: the copy in memory)
        self.last_stall_seconds = 0.0

    def bind(self, engine: Any) -> None:
        """Remember the engine (weakly) for the step count and world sizes recorded in the marker."""
        self._engine = weakref.ref(engine)

    def create(self, info: CheckpointCommitInfo) -> None:
        staged = StagedTag(str(info.save_dir), str(info.tag))
        save_latest = info.save_latest if self._save_latest is None else self._save_latest
        config = dict(self.options.config)
        request = SaveRequest(staged, self._iteration(staged.tag), save_latest, config, self._topology())
        self.pending.begin(request)  # the previous save committed first
        self._staged = staged

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        staged = self._staged
        if staged is not None and _inside(staged, path):
            staged.makedirs(path)
        else:
            super().makedirs(path, exist_ok=exist_ok)  # the save directory itself, before create()

    def save(self, state_dict: Any, path: str) -> None:
        self.pending.write(state_dict, path, self.zipfile_serialization)

    def load(self, path: str, map_location: Any = None) -> Any:
        return read_checked(path, map_location, unverified_ok=self.options.unverified_ok or self.universal_load)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Sync: the save's commit (every rank, in ``save_checkpoint``); decoupled: each step's poll."""
        self._staged = None
        return self.pending.poll(blocking=not self.pending.decoupled)

    def is_decoupled(self) -> bool:
        return self.pending.decoupled

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """While something is pending, what DeepSpeed passes back to :meth:`commit` at its next step.

        ``save_latest`` is False: DeepSpeed would rewrite ``latest`` in place after the commit;
        the commit replaces it atomically itself.
        """
        if not self.pending.busy:
            return None
        return CheckpointCommitInfo(tag="", save_dir="", save_latest=False)

    def wait(self) -> None:
        """Collective: commit a pending async save and upload now (every rank calls it, e.g. before exiting)."""
        self._staged = None
        self.pending.poll(blocking=True)

    def cleanup(self) -> None:
        """``engine.destroy()`` (every rank): commit what is pending, then release the upload directory."""
        self._staged = None
        self.pending.close()

    def _iteration(self, tag: str) -> int:
        engine = self._engine() if self._engine is not None else None
        return tag_iteration(tag, int(getattr(engine, "global_steps", 0) or 0))

    def _topology(self) -> dict[str, int]:
        engine = self._engine() if self._engine is not None else None
        world = ds_dist.get_world_size() if ds_dist.is_initialized() else 1
        topology = {"world": world, "dp": world, "tp": 1, "pp": 1}
        if engine is not None:
            topology["dp"] = int(getattr(engine, "dp_world_size", world))
            topology["tp"] = int(getattr(engine, "mp_world_size", 1))
            topology["pp"] = int(getattr(engine, "num_stages", 1))
            topology["zero_stage"] = int(engine.zero_optimization_stage())
        return topology


def _inside(staged: StagedTag, path: str) -> bool:
    try:
        staged.name_of(path, allow_self=True)
    except CheckpointError:
        return False
    return True


def use(engine: Any, **options: Any) -> ShardpointCheckpointEngine:
    """Make ``engine`` (from ``deepspeed.initialize``) save and load through shardpoint; returns the checkpoint engine.

    Call it on every rank, after ``deepspeed.initialize`` and before the first
    ``save_checkpoint`` / ``load_checkpoint``. ``options`` are :class:`EngineOptions`.

    Example::

        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        use(engine, config={"num_layers": 24, "hidden_size": 2048})
        engine.load_checkpoint(args.save)              # DeepSpeed's own call, files checked
    """
    checkpoint_engine = ShardpointCheckpointEngine(getattr(engine, "_config", None), EngineOptions(**options))
    checkpoint_engine.bind(engine)
    engine.checkpoint_engine = checkpoint_engine
    original = getattr(engine, _WRAPPED, None) or engine.save_checkpoint

    @functools.wraps(original)
    def save_checkpoint(save_dir: str, tag: Any = None, client_state: Any = None, save_latest: bool = True, **kw: Any):
        current = engine.checkpoint_engine
        if not isinstance(current, ShardpointCheckpointEngine):
            return original(save_dir, tag, {} if client_state is None else client_state, save_latest, **kw)
        current._save_latest = save_latest  # the commit replaces `latest` atomically; DeepSpeed must not rewrite it
        started = time.perf_counter()
        try:
            saved = original(save_dir, tag, {} if client_state is None else client_state, False, **kw)
        finally:
            current._save_latest = None
        if not current.options.async_save:  # committed now; a decoupled engine's DeepSpeed did not call commit
            current.pending.commit_written(blocking=True)
        current.last_stall_seconds = time.perf_counter() - started
        return saved

    engine.save_checkpoint = save_checkpoint
    setattr(engine, _WRAPPED, original)
    _wrap_load(engine)
    _wrap_16bit(engine)
    return checkpoint_engine


def _wrap_16bit(engine: Any) -> None:
    """``save_16bit_model`` writes one file outside any tag: through a :class:`WholeFileEngine` for that call.

    The tag commit would refuse a path outside the tag (and DeepSpeed's ``create`` for it
    would start an empty ``global_step<N>``); the file is replaced atomically instead.
    """
    original = getattr(engine, _WRAPPED_16BIT, None) or getattr(engine, "save_16bit_model", None)
    if original is None:
        return

    @functools.wraps(original)
    def save_16bit_model(*args: Any, **kw: Any) -> Any:
        current = engine.checkpoint_engine
        if not isinstance(current, ShardpointCheckpointEngine):
            return original(*args, **kw)
        engine.checkpoint_engine = WholeFileEngine(current.zipfile_serialization)
        try:
            return original(*args, **kw)
        finally:
            engine.checkpoint_engine = current

    engine.save_16bit_model = save_16bit_model
    setattr(engine, _WRAPPED_16BIT, original)


def _loads_universal(engine: Any) -> bool:
    """The engine is configured to load a universal checkpoint (``"load_universal_checkpoint": true``).

    DeepSpeed's ``ds_to_universal`` writes those tags offline, after the save, so they never
    have a ``shardpoint.json``: refusing them would make DeepSpeed's universal workflow
    impossible. Asked for explicitly by the config, such a tag is read unchecked (a tag
    shardpoint committed is still checked), with no code run, and said so in the log.
    """
    flag = getattr(engine, "load_universal_checkpoint", None)
    if not callable(flag) or not flag():
        return False
    log.warning(
        "loading a DeepSpeed universal checkpoint: ds_to_universal writes no %s, so a tag without one is read "
        "without checksums (still without running code)",
        MARKER_NAME,
    )
    return True


def _wrap_load(engine: Any) -> None:
    """Check the tag on every rank before DeepSpeed reads it, so a damaged file stops every rank, not one.

    DeepSpeed's ranks each read their own files and then enter collectives: a rank that
    raised on its file would leave the others waiting. The check splits the tag's files
    over the ranks and agrees on the outcome (:func:`~shardpoint.integrations.deepspeed.files.check_tag`).
    """
    original = getattr(engine, _WRAPPED_LOAD, None) or engine.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kw: Any):
        current = engine.checkpoint_engine
        if not isinstance(current, ShardpointCheckpointEngine):
            return original(load_dir, tag, *args, **kw)
        current.wait()  # a pending save committed first: it may be the tag this load reads
        universal = _loads_universal(engine)
        latest = LATEST_UNIVERSAL if universal else LATEST
        check_tag(str(load_dir), tag, current.options.unverified_ok or universal, latest)
        current.universal_load = universal
        try:
            return original(load_dir, tag, *args, **kw)
        finally:
            current.universal_load = False

    engine.load_checkpoint = load_checkpoint
    setattr(engine, _WRAPPED_LOAD, original)
