"""Local-first mode: save to local disk as usual, then copy to the ``upload_to`` store in the background.

This is GPT-NeoX's S3 upload made safe. Each rank uploads the files it wrote (so
node-local disks work, see :mod:`shardpoint.lifecycle.node_local`), in a background thread,
never blocking training. The remote checkpoint is committed the way a direct save to
that store is (:mod:`shardpoint.lifecycle.commit`), so a remote checkpoint of the same
name (a rollback that saves an iteration again, a re-saved release) stays loadable
until the new one is complete:

1. **begin** (every rank, in the save): rank 0 creates this upload's own staging
   directory, ``.shardpoint-tmp-<name>-<token>/`` (:func:`commit.begin`), and broadcasts
   its name over shardpoint's control group, so every rank uploads into the same one.
2. **upload** (every rank, in the background): its files into the staging directory.
3. **commit** (at the next ``maybe_save``/``save``/``close``, once the ranks agree that
   every upload is done): rank 0 publishes the staging directory with the marker it
   built from the records every rank sent it (never read from another rank's disk):
   a rename on a filesystem, a create-only claim and server-side copies on an object
   store (:func:`commit.publish`); then the tracker, then remote retention.

A kill at any moment leaves the remote tracker naming a committed checkpoint; what
the dead upload staged is removed by a later job (:func:`commit.clean_leftovers`, by
age on an object store, so a live job's upload is never taken for a dead one's).

**Two writers.** On an object store the claim decides: of two jobs uploading the same
iteration, one commits and the other gets :class:`~shardpoint.ConcurrentSaveError` on
every rank. A local or network-mounted path (a cluster's shared filesystem) is written
by one job at a time, as a direct save is: rank 0 takes the directory's writer lock
(:mod:`shardpoint.storage.lock`) at its first upload and holds it until ``close()``;
a second job's upload is refused with ``ConcurrentSaveError`` on every rank.

A failed upload is reported (a warning naming the error) and started again into the
same staging directory; objects already uploaded with the right size are skipped, so
an interrupted upload resumes where it stopped. One that fails ``max_attempts`` times
removes its staging directory and raises :class:`~shardpoint.StorageError`.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from shardpoint.catalog.layout import Layout
from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.errors import CheckpointError, CheckpointTimeoutError, ConcurrentSaveError, StorageError
from shardpoint.lifecycle import commit, faults
from shardpoint.lifecycle.async_save import BackgroundWrite
from shardpoint.lifecycle.policy import PreservationPolicy
from shardpoint.lifecycle.retention import apply_retention
from shardpoint.parallel import comm
from shardpoint.storage.base import LocalStorage, Storage, open_storage
from shardpoint.storage.lock import DirectoryLock, LockedError

__all__ = ["RemoteMirror"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Upload:
    local_dir: str
    name: str
    files: list[str]
    iteration: int | None
    marker: bytes  # the full shardpoint.json (rank 0; other ranks may hold a partial one)
    update_tracker: bool = True
    attempts: int = 0
    writer: BackgroundWrite | None = None
    staging: str | None = None  # this upload's own directory on the store, the same on every rank
    base: str | None = None  # rank 0: the remote checkpoint's marker digest when the save began

    def started(self) -> BackgroundWrite:
        """The copy in the background (:meth:`RemoteMirror._launch` starts one before anything polls)."""
        if self.writer is None:
            raise CheckpointError(f"the upload of {self.name} is polled but was never started")
        return self.writer

    def staged(self) -> str:
        """This upload's directory on the store (:meth:`RemoteMirror._launch` names it before any file is copied)."""
        if self.staging is None:
            raise CheckpointError(f"the upload of {self.name} has no staging directory on the store")
        return self.staging


class RemoteMirror:
    """Copies committed local checkpoints to ``remote_root`` and commits them there.

    Args:
        remote_root: ``s3://bucket/prefix`` (or ``gs://``, ``az://``), or a local path such as
            a shared filesystem's mount.
        layout: names the remote tracker as the local one.
        policies: retention applied to the remote root after each remote commit.
        max_attempts: uploads of one checkpoint before the failure is raised.
    """

    def __init__(self, remote_root: str, layout: Layout, policies: Sequence[PreservationPolicy], max_attempts: int = 5):
        self.storage: Storage = open_storage(remote_root)
        self.root = self.storage.root
        self.layout = layout
        self.policies = list(policies)
        self.max_attempts = max_attempts
        self.local = LocalStorage("/")
        self.last_upload_seconds = 0.0
        self._pending: _Upload | None = None
        self._prepared: tuple[str, str | None] | None = None  # rank 0: (name, base) of the save being written
        # a filesystem has no claims: one job writes it at a time, as with direct saves (rank 0 holds the lock)
        self._lock = DirectoryLock(self.root) if self.storage.supports_rename and comm.rank() == 0 else None
        if comm.rank() == 0:
            self._clean_at_start()

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def start(
        self, local_dir: str, files: Sequence[str], iteration: int | None, marker: bytes, update_tracker: bool = True
    ) -> None:
        """Collective: begin uploading this rank's ``files`` of the committed checkpoint ``local_dir``.

        ``marker`` is the checkpoint's ``shardpoint.json``; rank 0's is committed after
        every rank's files, then the tracker (unless ``update_tracker`` is False).

        Raises:
            ConcurrentSaveError: (every rank) another job is writing the local ``upload_to`` directory.
        """
        name = local_dir.rstrip("/").rsplit("/", 1)[-1]
        files = sorted(f for f in files if f != MARKER_NAME)
        self._pending = upload = _Upload(local_dir, name, files, iteration, marker, update_tracker)
        self._launch(upload)

    def prepare(self, name: str) -> None:
        """Rank 0, as a save of ``name`` begins: note which remote checkpoint its upload may replace.

        The upload begins only after the local save, so a checkpoint of the same name that
        another job commits meanwhile would otherwise look like the one this save replaces:
        two writers of one iteration would both commit. The upload commits only over the
        checkpoint noted here (a create-only claim on it on object stores, a check under
        the writer lock on a filesystem); a store it cannot read now is noted as unknown.
        """
        try:
            base: str | None = commit.marker_digest(self.storage, self.storage.join(self.root, name))
        except (OSError, CheckpointError) as exc:
            log.warning("could not read %s/%s before saving it (%s); its upload checks it later", self.root, name, exc)
            base = None
        self._prepared = (name, base)

    def close(self) -> None:
        """Release the writer lock of a local ``upload_to`` directory (after the last :meth:`poll`)."""
        if self._lock is not None:
            self._lock.release()

    def _launch(self, upload: _Upload) -> None:
        """Collective (from :meth:`start` and a retry): begin the upload if not begun yet, then copy in background."""
        upload.attempts += 1
        if upload.staging is None:
            try:
                upload.staging = _from_root(lambda: self._begin(upload), f"preparing the upload of {upload.name}")
            except (ConcurrentSaveError, CheckpointTimeoutError):
                self._pending = None
                raise
            except CheckpointError as exc:  # the store is unreachable now: counts as a failed attempt
                upload.writer = BackgroundWrite(_raising(exc)).start()
                return
        upload.writer = BackgroundWrite(lambda: self._copy_files(upload)).start()

    def _begin(self, upload: _Upload) -> str:
        """Rank 0: this upload's staging directory (a local directory's writer lock first)."""
        name = upload.name
        if upload.base is None and self._prepared is not None and self._prepared[0] == name:
            upload.base = self._prepared[1]
        if self._lock is not None and not self._lock.held:
            try:
                self._lock.acquire()
            except LockedError as exc:
                raise ConcurrentSaveError(
                    f"{exc} (upload_to={self.root}); this upload of {name} committed nothing, the local checkpoint "
                    "is committed"
                ) from None
            commit.clean_leftovers(self.storage, self.root)  # nobody else writes here while the lock is held
        return commit.begin(self.storage, self.root, name, upload.base)

    def _copy_files(self, upload: _Upload) -> int:
        copied = 0
        faults.hit("during-upload", comm.rank())
        for folder in sorted({posixpath.dirname(name) for name in upload.files} - {""}):
            self.storage.makedirs(self.storage.join(upload.staged(), folder))  # a filesystem needs them
        for name in upload.files:
            source = self.local.join(upload.local_dir, name)
            target = self.storage.join(upload.staged(), name)
            size = self.local.size(source)
            if upload.attempts > 1 and self.storage.exists(target) and self.storage.size(target) == size:
                continue  # uploaded by an earlier, interrupted attempt of this upload
            with open(source, "rb") as src, self.storage.open_write(target) as dst:
                while chunk := src.read(64 << 20):
                    dst.write(chunk)
            copied += size
        return copied

    def poll(self, blocking: bool) -> bool:
        """Collective: commit the upload remotely once every rank's part is done; True when none is pending.

        Raises:
            ConcurrentSaveError: (every rank) another job committed the same checkpoint first.
            StorageError: the upload failed ``max_attempts`` times.
        """
        upload = self._pending
        if upload is None:
            return True
        writer = upload.started()
        if blocking:
            writer.wait()
        elif not all(comm.all_gather(writer.done())):
            return False
        writer.wait()
        errors = [e for e in comm.all_gather(_describe(writer.error)) if e]
        if errors:
            return self._retry(upload, errors, blocking)
        self.last_upload_seconds = writer.seconds
        self._pending = None  # committed or failed: never committed twice
        _from_root(lambda: self._commit(upload), f"committing the upload of {upload.name}")
        return True

    def _retry(self, upload: _Upload, errors: list[str], blocking: bool) -> bool:
        if upload.attempts >= self.max_attempts:
            self._pending = None
            if comm.rank() == 0 and upload.staging is not None:
                self._discard(upload.staging)
            raise StorageError(
                f"uploading {upload.name} to {self.root} failed {upload.attempts} times ({errors[0]}); the local "
                "checkpoint is intact and committed, the remote tracker still names the previous upload"
            )
        log.warning(
            "upload of %s to %s failed (%s); retrying (attempt %d of %d)",
            upload.name,
            self.root,
            errors[0],
            upload.attempts + 1,
            self.max_attempts,
        )
        self._launch(upload)
        return self.poll(blocking) if blocking else False

    def _commit(self, upload: _Upload) -> None:
        """Rank 0: the staged upload published (marker last), then the tracker, then remote retention."""
        final = self.storage.join(self.root, upload.name)
        meta = CheckpointMetadata.from_json(upload.marker, self.storage.join(final, MARKER_NAME))
        try:
            if self._lock is not None and upload.base not in (None, commit.marker_digest(self.storage, final)):
                raise _replaced(final)  # a filesystem has no claim; the lock keeps the check and rename together
            commit.publish(self.storage, upload.staged(), final, meta)
        except BaseException:
            self._discard(upload.staged())  # this upload's own directory (kept when it won its claim)
            raise
        if upload.update_tracker:
            commit.write_tracker(self.storage, self.root, self.layout, upload.iteration)
        apply_retention(self.storage, self.root, self.layout, self.policies)
        log.info("uploaded %s to %s", upload.name, self.root)

    def _discard(self, staging: str) -> None:
        try:
            commit.discard(self.storage, staging)
        except (OSError, CheckpointError) as exc:  # the store may be what failed: a later job removes it by age
            log.warning("could not remove %s, left by a failed upload: %s", staging, exc)

    def _clean_at_start(self) -> None:
        """Rank 0: remove what dead uploads left, never what a live job is writing.

        On an object store :func:`commit.clean_leftovers` leaves young staging prefixes alone;
        a filesystem is cleaned only when no job holds its writer lock.
        """
        if self._lock is None:
            commit.clean_leftovers(self.storage, self.root)
        elif self.storage.is_dir(self.root) and self._lock.try_acquire():
            try:
                commit.clean_leftovers(self.storage, self.root)
            finally:
                self._lock.release()


def _from_root(step: Callable[[], T], what: str) -> T:
    """:func:`comm.from_root`, with a ConcurrentSaveError on rank 0 raised as one on every rank.

    Every rank of the job that lost a race learns that it lost (not only that rank 0 failed),
    so a caller can tell "another job saved this" from a broken save everywhere.
    """

    def guarded() -> tuple[Any, str | None]:
        try:
            return step(), None
        except ConcurrentSaveError as exc:
            return None, str(exc)

    result, concurrent = comm.from_root(guarded, what)
    if concurrent is not None:
        raise ConcurrentSaveError(concurrent)
    return result


def _replaced(final: str) -> ConcurrentSaveError:
    return ConcurrentSaveError(
        f"{final} was committed by another job while this one was saving it; this upload committed nothing and "
        "the remote tracker was not moved by it (the local checkpoint is committed). Two jobs are saving into the "
        "same upload_to directory: give each its own"
    )


def _raising(error: BaseException) -> Callable[[], None]:
    def work() -> None:
        raise error

    return work


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"[:300]
