"""DeepSpeed's own checkpoint files, written through shardpoint's commit and read back checked.

DeepSpeed's engine decides every file name (``<save_dir>/<tag>/mp_rank_00_model_states.pt``,
``zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt``, pipeline ``layer_<nn>-model_states.pt``)
and hands each state dict to its checkpoint engine. :class:`StagedTag` keeps those names
and bytes but moves the writing into this save's own hidden directory
(``<save_dir>/.shardpoint-tmp-<tag>-<token>/``), so the tag DeepSpeed's loader opens
is either the previous, complete one or the new, complete one:

1. ``begin`` (every rank, one broadcast): rank 0 makes the staging directory
   (:func:`shardpoint.lifecycle.commit.begin`: a tag another tool wrote is refused
   before a byte is written) and every rank learns its name;
2. ``write`` (each rank, its own files): ``torch.save`` exactly as DeepSpeed's
   ``TorchCheckpointEngine`` calls it, through a hashing writer, then fsync. A failure
   is kept, not raised, so the rank reaches the commit round and every rank raises;
3. ``commit`` (every rank, a gather and a verdict): rank 0 joins every rank's
   file sizes and checksums into ``shardpoint.json``, renames the directory into
   place (:func:`shardpoint.lifecycle.commit.publish`) and only then replaces
   ``latest`` atomically.

:func:`read_checked` is the load side: the file must be listed in its tag's marker,
with the size and checksum recorded there, and is unpickled by
:func:`~shardpoint.integrations.deepspeed.unpickle.load_restricted`.
"""

from __future__ import annotations

import io
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from shardpoint._version import __version__
from shardpoint.catalog.integrity import verify_files
from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata, FileRecord
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.integrations.deepspeed.unpickle import load_restricted
from shardpoint.lifecycle import commit, faults
from shardpoint.parallel import comm
from shardpoint.storage.base import LocalStorage

__all__ = ["LATEST", "StagedTag", "check_tag", "read_checked", "tag_iteration"]

#: DeepSpeed's tracker beside the tags; it holds the tag's name
LATEST = "latest"
#: the tag file ds_to_universal writes, which DeepSpeed reads instead of ``latest`` for a universal load
LATEST_UNIVERSAL = "latest_universal"
_FORMAT = "deepspeed"
_CHUNK = 16 << 20


def tag_iteration(tag: str, fallback: int) -> int:
    """The step a tag names (``global_step120`` -> 120), else ``fallback`` (the engine's global step)."""
    found = re.search(r"([0-9]+)$", tag)
    return int(found.group(1)) if found else fallback


def _check_tag(tag: str) -> None:
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or tag.startswith("."):
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not a plain directory name; DeepSpeed writes <save_dir>/<tag>/: "
            "pass a tag without '/' that does not start with '.'"
        )


@dataclass
class StagedTag:
    """One save of ``<save_dir>/<tag>`` in progress on this rank (see the module docstring).

    Call order, every rank: :meth:`begin`, then :meth:`write` for each file DeepSpeed
    hands this rank (any number, zero included), then :meth:`commit`.
    """

    save_dir: str
    tag: str
    staging: str = ""
    records: dict[str, FileRecord] = field(default_factory=dict)
    error: BaseException | None = None
    started: float = field(default_factory=time.time)

    @property
    def final(self) -> str:
        return os.path.join(self.save_dir, self.tag)

    def begin(self) -> None:
        """Every rank: rank 0 creates the staging directory and broadcasts its name."""
        _check_tag(self.tag)
        storage = LocalStorage(self.save_dir)

        def make() -> str:
            commit.clean_leftovers(storage, self.save_dir)
            return commit.begin(storage, self.save_dir, self.tag)

        self.staging = comm.from_root(make, f"starting the DeepSpeed save of {self.final}")

    def name_of(self, path: str, allow_self: bool = False) -> str:
        """``path`` relative to the tag directory; a path outside it is refused (it would escape the commit)."""
        final = os.path.normpath(os.path.abspath(self.final))
        full = os.path.normpath(os.path.abspath(path))
        if allow_self and full == final:
            return ""
        if not full.startswith(final + os.sep):
            raise CheckpointError(
                f"DeepSpeed asked to write {path}, outside the tag directory {self.final} being saved; "
                "shardpoint commits only the tag directory: report this DeepSpeed code path"
            )
        return os.path.relpath(full, final).replace(os.sep, "/")

    def makedirs(self, path: str) -> None:
        """DeepSpeed makes ``<save_dir>/<tag>`` (or a folder in it) before writing: made in the staging directory."""
        os.makedirs(os.path.join(self.staging, self.name_of(path, allow_self=True)), exist_ok=True)

    def write(self, state_dict: Any, path: str, zipfile_serialization: bool) -> None:
        """Save one file as DeepSpeed's own engine would, hashing it on the way; keep a failure for the commit."""
        if self.error is not None:
            return
        try:
            name = self.name_of(path)
            faults.hit("before-data", comm.rank())
            target = os.path.join(self.staging, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            # to the path, as DeepSpeed does: torch.save names the archive's root after the file
            # (a file object gets "archive"), so only this call gives DeepSpeed's own bytes
            torch.save(state_dict, target, _use_new_zipfile_serialization=zipfile_serialization)
            self.records[name] = _hash_and_sync(target)
            faults.hit("mid-data", comm.rank())
        except Exception as exc:  # noqa: BLE001 - raised on every rank by commit()
            self.error = exc

    def commit(self, iteration: int, save_latest: bool, config: dict[str, Any], topology: dict[str, int]) -> None:
        """Every rank: agree that every file was written, then rank 0 publishes the tag and ``latest``."""
        faults.hit("after-data", comm.rank())
        storage = LocalStorage(self.save_dir)

        def publish(per_rank: list[dict[str, FileRecord]]) -> None:
            files: dict[str, FileRecord] = {}
            for rank, records in enumerate(per_rank):
                clash = sorted(set(files) & set(records))
                if clash:
                    raise CheckpointError(f"ranks wrote the same file twice in {self.final}: {clash[:3]} (rank {rank})")
                files.update(records)
            meta = CheckpointMetadata(
                iteration=iteration,
                format=_FORMAT,
                topology=topology,
                layout="neox",
                config=config,
                files=files,
                wall_time=time.time(),
                save_seconds=time.time() - self.started,
                library_version=__version__,
            )
            faults.hit("before-marker", 0)
            commit.publish(storage, self.staging, self.final, meta)
            faults.hit("before-tracker", 0)
            if save_latest:
                storage.write_atomic(os.path.join(self.save_dir, LATEST), self.tag.encode())

        try:
            comm.decide_at_root(self.records, self.error, publish, f"committing the DeepSpeed save of {self.final}")
        except BaseException:
            if comm.rank() == 0 and os.path.isdir(self.staging):
                commit.discard(storage, self.staging)
            raise


def _hash_and_sync(path: str) -> FileRecord:
    """Size and XXH3 of a file just written (read back from the page cache), made durable."""
    digest = xxhash.xxh3_64()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return FileRecord(size, digest.hexdigest())


@dataclass
class _Marker:
    meta: CheckpointMetadata
    stamp: tuple[int, int]


_MARKERS: dict[str, _Marker] = {}


def _marker_of(tag_dir: str) -> CheckpointMetadata:
    """The tag's marker, parsed once per version of the file."""
    path = os.path.join(tag_dir, MARKER_NAME)
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{tag_dir} has no {MARKER_NAME}: it is not a tag shardpoint committed (a save that did not finish, "
            "or one written by DeepSpeed's own engine). Load a committed tag, or, for a checkpoint DeepSpeed "
            "wrote itself, pass use(engine, unverified_ok=True) to read it unchecked (still without running code)"
        ) from None
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _MARKERS.get(tag_dir)
    if cached is None or cached.stamp != stamp:
        with open(path, "rb") as f:
            cached = _Marker(CheckpointMetadata.from_json(f.read(), path), stamp)
        _MARKERS[tag_dir] = cached
    return cached.meta


def _tag_dir_of(path: str) -> str:
    """The nearest directory above ``path`` holding a marker (DeepSpeed's files sit one level down), else its parent."""
    parent = os.path.dirname(os.path.abspath(path))
    probe = parent
    for _ in range(3):
        if os.path.exists(os.path.join(probe, MARKER_NAME)):
            return probe
        probe = os.path.dirname(probe)
    return parent


def read_checked(path: str, map_location: Any = None, unverified_ok: bool = False) -> Any:
    """Load one of DeepSpeed's files: listed in its tag's marker, size and checksum as recorded, no code run.

    Raises:
        CorruptCheckpointError: no marker (unless ``unverified_ok``), the file is not listed,
            or its size or checksum differs from the record: naming the file.
        UnsafeCheckpointError: the file names a class outside the allow-list.
    """
    tag_dir = _tag_dir_of(path)
    if unverified_ok and not os.path.exists(os.path.join(tag_dir, MARKER_NAME)):
        return load_restricted(path, path, map_location)
    meta = _marker_of(tag_dir)
    name = os.path.relpath(os.path.abspath(path), tag_dir).replace(os.sep, "/")
    record = meta.files.get(name)
    if record is None:
        raise CorruptCheckpointError(
            f"{path} is not listed in {os.path.join(tag_dir, MARKER_NAME)}: it was not written by the save that "
            "committed this tag, so it is not read; remove it, or load another tag"
        )
    full = os.path.abspath(path)
    if _VERIFIED.get(full) == _stamp(full):  # checked by check_tag for this load, unchanged since
        return load_restricted(path, path, map_location)
    data = _read_exact(path, record)
    return load_restricted(io.BytesIO(data), path, map_location)


#: files check_tag found whole, by absolute path, with (size, mtime) when checked: read once, not hashed twice
_VERIFIED: dict[str, tuple[int, int]] = {}


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


def check_tag(load_dir: str, tag: str | None, unverified_ok: bool = False, latest: str = LATEST) -> None:
    """Every rank: the tag DeepSpeed is about to load (``latest`` when None) is whole; else every rank raises.

    Each rank checks the size and checksum of every ``world``-th file the marker lists
    (one pass over the tag, shared), then the ranks agree and remember every file found
    whole with its size and mtime, so :func:`read_checked` then reads it once, from the
    path, without hashing it again (a file changed since is hashed again). Nothing is checked when
    there is nothing to load (DeepSpeed then says so itself) or, with ``unverified_ok``,
    when the tag has no marker. ``latest``: the file naming the tag when ``tag`` is None
    (``latest_universal`` for a universal load, as DeepSpeed reads it).
    """
    storage = LocalStorage(load_dir)

    def check() -> dict[str, tuple[int, int] | None]:
        name = tag
        if name is None:
            latest_file = os.path.join(load_dir, latest)
            if not os.path.isfile(latest_file):
                return {}
            with open(latest_file) as f:
                name = f.read().strip()
        directory = os.path.join(load_dir, name)
        if not os.path.isdir(directory) or (unverified_ok and not os.path.exists(os.path.join(directory, MARKER_NAME))):
            return {}
        meta = _marker_of(directory)
        mine = sorted(meta.files)[comm.rank() :: max(1, comm.world_size())]
        stamps = {os.path.abspath(os.path.join(directory, n)): _stamp(os.path.join(directory, n)) for n in mine}
        problems = verify_files(storage, directory, meta, names=mine)
        if problems:
            raise CorruptCheckpointError(
                f"{directory} is damaged: {'; '.join(map(str, problems))}. Load another tag (pass tag=...), "
                "or restore the files from a copy"
            )
        return stamps

    _VERIFIED.clear()
    for stamps in comm.agree_all(check, f"checking the DeepSpeed checkpoint in {load_dir}"):
        _VERIFIED.update({path: stamp for path, stamp in stamps.items() if stamp is not None})


def _read_exact(path: str, record: FileRecord) -> bytes:
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing; the checkpoint lists it ({record.size} bytes)") from None
    if size != record.size:
        raise CorruptCheckpointError(
            f"{path}: size {size} bytes, expected {record.size} (truncated or overwritten); load another tag"
        )
    with open(path, "rb") as f:
        data = f.read()
    if xxhash.xxh3_64_hexdigest(data) != record.xxh3_64:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch (the contents changed after saving); the file is damaged: "
            "load another tag, or restore the file from a copy"
        )
    return data
