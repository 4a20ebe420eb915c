"""Local-first mode: save to local disk as usual, then copy to object storage in the background.

This is GPT-NeoX's S3 upload made safe. Each rank uploads the files it wrote (so
node-local disks work, see :mod:`shardpoint.lifecycle.node_local`), in a background thread,
never blocking training. The remote tracker moves only when every rank's upload is
complete: at the next ``maybe_save``/``save``/``close`` the ranks agree that all
uploads are done, then rank 0 uploads ``shardpoint.json`` (the marker it built from
the records every rank sent it, never read from another rank's disk) and then the
tracker. A failed upload is reported
(a warning naming the error) and started again; objects already uploaded with the
right size are skipped, so an interrupted upload resumes where it stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from shardpoint.catalog.layout import Layout
from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.errors import StorageError
from shardpoint.lifecycle import commit, faults
from shardpoint.lifecycle.async_save import BackgroundWrite
from shardpoint.lifecycle.policy import PreservationPolicy
from shardpoint.lifecycle.retention import apply_retention
from shardpoint.parallel import comm
from shardpoint.storage.base import LocalStorage, Storage, open_storage

__all__ = ["RemoteMirror"]

log = logging.getLogger(__name__)


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


class RemoteMirror:
    """Copies committed local checkpoints to ``remote_root`` and commits them there.

    Args:
        remote_root: ``s3://bucket/prefix``.
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
        if comm.rank() == 0:
            commit.clean_leftovers(self.storage, self.root)

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def start(
        self, local_dir: str, files: Sequence[str], iteration: int | None, marker: bytes, update_tracker: bool = True
    ) -> None:
        """Begin uploading this rank's ``files`` of the committed checkpoint ``local_dir`` (every rank).

        ``marker`` is the checkpoint's ``shardpoint.json``; rank 0's is uploaded after
        every rank's files, then the tracker (unless ``update_tracker`` is False).
        """
        name = local_dir.rstrip("/").rsplit("/", 1)[-1]
        files = sorted(f for f in files if f != MARKER_NAME)
        self._pending = _Upload(local_dir, name, files, iteration, marker, update_tracker)
        self._launch()

    def _launch(self) -> None:
        upload = self._pending
        upload.attempts += 1
        upload.writer = BackgroundWrite(lambda: self._copy_files(upload)).start()

    def _copy_files(self, upload: _Upload) -> int:
        if upload.attempts == 1 and comm.rank() == 0:
            # a remote checkpoint of the same name (a rollback, a re-saved release) stops being
            # committed before its objects are overwritten; the new marker comes last
            self.storage.remove(self.storage.join(self.root, upload.name, MARKER_NAME))
        copied = 0
        # every rank marks the prefix as a shardpoint save in progress before its first object, so an
        # upload that dies is removed by clean_leftovers (and nothing another tool wrote ever is)
        note = self.storage.join(self.root, upload.name, commit.IN_PROGRESS_NAME)
        self.storage.write_atomic(note, f"upload of {upload.name}".encode())
        faults.hit("during-upload", comm.rank())
        for name in upload.files:
            source = self.local.join(upload.local_dir, name)
            target = self.storage.join(self.root, upload.name, name)
            size = self.local.size(source)
            if upload.attempts > 1 and self.storage.exists(target) and self.storage.size(target) == size:
                continue  # uploaded by an earlier, interrupted attempt of this upload
            with open(source, "rb") as src, self.storage.open_write(target) as dst:
                while chunk := src.read(64 << 20):
                    dst.write(chunk)
            copied += size
        return copied

    def poll(self, blocking: bool) -> bool:
        """Collective: commit the upload remotely once every rank's part is done; True when none is pending."""
        upload = self._pending
        if upload is None:
            return True
        if blocking:
            upload.writer.wait()
        elif not all(comm.all_gather(upload.writer.done())):
            return False
        upload.writer.wait()
        errors = [e for e in comm.all_gather(_describe(upload.writer.error)) if e]
        if errors:
            return self._retry(upload, errors, blocking)
        self.last_upload_seconds = upload.writer.seconds
        outcome = comm.agree(lambda: self._commit(upload) if comm.rank() == 0 else None, "committing the upload")
        self._pending = None
        return outcome is None

    def _retry(self, upload: _Upload, errors: list[str], blocking: bool) -> bool:
        if upload.attempts >= self.max_attempts:
            self._pending = None
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
        self._launch()
        return self.poll(blocking) if blocking else False

    def _commit(self, upload: _Upload) -> None:
        """Rank 0: marker after every data object, tracker after the marker, then remote retention."""
        prefix = self.storage.join(self.root, upload.name)
        commit.write_marker(self.storage, prefix, upload.marker)
        self.storage.remove(self.storage.join(prefix, commit.IN_PROGRESS_NAME))
        if upload.update_tracker:
            commit.write_tracker(self.storage, self.root, self.layout, upload.iteration)
        apply_retention(self.storage, self.root, self.layout, self.policies)
        log.info("uploaded %s to %s", upload.name, self.root)


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"[:300]
