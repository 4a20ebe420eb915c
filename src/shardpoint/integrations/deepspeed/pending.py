"""Engine mode after DeepSpeed has handed over a save's files: async writes, the commit, the upload, retention.

DeepSpeed's ``save_checkpoint`` calls its checkpoint engine's ``create``, then ``save``
per file, then (for an engine that is not *decoupled*) ``commit``. A decoupled engine
is committed later instead: at every optimizer step DeepSpeed asks ``get_commit_info()``
and, while it returns something, calls ``commit`` on every rank (a natural collective
point, the same on every rank). :class:`PendingSaves` uses that hook:

* **async** (``async_save=True``): ``save`` copies the state dict
  (:func:`~shardpoint.integrations.deepspeed.snapshot.snapshot`: every storage once, so
  the file is byte-identical to a synchronous one) and writes the copy on a thread. At each step
  the ranks agree whether every rank's files are written (one small gather on
  shardpoint's own gloo group); only then is the tag committed and ``latest`` moved. A
  kill before that leaves ``latest`` on the previous tag; the staging directory it
  leaves is removed by the next save;
* **upload** (``upload_to=``): after each commit every rank uploads the files it wrote
  in the background (:class:`~shardpoint.lifecycle.upload.RemoteMirror`, committed
  remotely at a later step once every rank is done: GPT-NeoX's S3 upload without
  the wait on rank 0);
* **retention** (``keep_last=N``): after each commit rank 0 deletes, on a thread, the
  committed tags no policy keeps (never the one ``latest`` names, never a tag
  DeepSpeed wrote itself: those have no ``shardpoint.json``).

Every rank calls :meth:`PendingSaves.poll` at the same points (``create`` of the next
save, each step's ``commit``, a load, ``wait``/``engine.destroy()``), so the gathers
match. A failure of a background write is raised there, on every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from shardpoint.catalog.layout import LAYOUTS
from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.errors import CheckpointError
from shardpoint.integrations.deepspeed.files import StagedTag
from shardpoint.integrations.deepspeed.snapshot import snapshot
from shardpoint.lifecycle.async_save import BackgroundWrite
from shardpoint.lifecycle.policy import preservation_policies
from shardpoint.lifecycle.retention import BackgroundRetention
from shardpoint.lifecycle.upload import RemoteMirror
from shardpoint.parallel import comm
from shardpoint.storage.base import LocalStorage

__all__ = ["LAYOUT", "PendingSaves", "SaveRequest"]

log = logging.getLogger(__name__)

#: DeepSpeed's default tags (``global_step<N>``) and ``latest``: how retention and the upload name tags
LAYOUT = LAYOUTS["neox"]


@dataclass
class SaveRequest:
    """One save between ``create`` and its commit: the staged tag, how to commit it, its writer threads."""

    staged: StagedTag
    iteration: int
    save_latest: bool
    config: dict[str, Any]
    topology: dict[str, int]
    writers: list[BackgroundWrite] = field(default_factory=list)

    def written(self) -> bool:
        return all(w.done() for w in self.writers)


class PendingSaves:
    """The engine-mode saves not yet committed, and the uploads and deletions after each commit.

    Args:
        async_save: write each file on a thread from a copy of its state dict.
        upload_to: a store prefix (``s3://``, ``gs://``, ``az://``) or a shared directory.
        keep_last: keep the newest N committed tags in the save directory (and remotely).
    """

    def __init__(self, *, async_save: bool = False, upload_to: str | None = None, keep_last: int | None = None):
        self.async_save = async_save
        self.policies = preservation_policies(keep_last, None, None)
        self.mirror = RemoteMirror(upload_to, LAYOUT, self.policies) if upload_to else None
        self._request: SaveRequest | None = None
        self._retention: dict[str, BackgroundRetention] = {}

    @property
    def decoupled(self) -> bool:
        """Whether DeepSpeed must call ``commit`` at its steps (something finishes in the background)."""
        return self.async_save or self.mirror is not None

    @property
    def busy(self) -> bool:
        return self._request is not None or (self.mirror is not None and self.mirror.busy)

    def begin(self, request: SaveRequest) -> None:
        """Every rank, in ``create``: finish what is pending, start the staged tag, hold ``request`` till its commit."""
        self.poll(blocking=True)
        if (self.policies or self.mirror is not None) and LAYOUT.parse_dir_name(request.staged.tag) is None:
            raise CheckpointError(
                f"tag {request.staged.tag!r}: keep_last and upload_to name tags as DeepSpeed does by default, "
                "global_step<N>; pass tag=None (or tag=f'global_step{step}') to save_checkpoint"
            )
        if self.mirror is not None and comm.rank() == 0:
            self.mirror.prepare(request.staged.tag)
        request.staged.begin()  # a refused tag leaves nothing pending
        self._request = request

    def write(self, state_dict: Any, path: str, zipfile_serialization: bool) -> None:
        """One of DeepSpeed's files: written now, or (async) copied now and written on a thread."""
        request = self._request
        if request is None:
            raise CheckpointError(f"DeepSpeed saved {path} before create(); call engine.save_checkpoint()")
        if not self.async_save:
            request.staged.write(state_dict, path, zipfile_serialization)
            return
        copied = snapshot(state_dict)  # tensors and containers: training changes them from the next step

        def work() -> None:
            request.staged.write(copied, path, zipfile_serialization)

        request.writers.append(BackgroundWrite(work).start())

    def poll(self, blocking: bool) -> bool:
        """Collective: commit the pending save once every rank's files are written, then the upload; True when idle."""
        if not self.commit_written(blocking):
            return False
        if self.mirror is not None and self.mirror.busy:
            return self.mirror.poll(blocking)
        return True

    def commit_written(self, blocking: bool) -> bool:
        """Collective: commit the pending save once every rank has written its files (``blocking``: wait for them)."""
        request = self._request
        if request is None:
            return True
        if not blocking and not all(comm.all_gather(request.written(), what="asking whether the save is written")):
            return False
        for writer in request.writers:
            writer.wait()
        self._request = None  # committed or failed: never twice
        retention = self._retention.get(request.staged.save_dir)
        if retention is not None:
            retention.wait()  # no deletion runs while the tracker changes
        request.staged.commit(request.iteration, request.save_latest, request.config, request.topology)
        self._after_commit(request)
        return True

    def _after_commit(self, request: SaveRequest) -> None:
        staged = request.staged
        if self.policies and comm.rank() == 0:
            retention = self._retention.get(staged.save_dir)
            if retention is None:
                retention = BackgroundRetention(LocalStorage(staged.save_dir), staged.save_dir, LAYOUT, self.policies)
                self._retention[staged.save_dir] = retention
            retention.start()
        if self.mirror is not None:
            marker = b""
            if comm.rank() == 0:  # rank 0 wrote it; the mirror commits rank 0's copy only
                with open(os.path.join(staged.final, MARKER_NAME), "rb") as f:
                    marker = f.read()
            self.mirror.start(staged.final, sorted(staged.records), request.iteration, marker, request.save_latest)

    def close(self) -> None:
        """Collective: commit what is pending, wait for deletions, release the upload directory's lock."""
        try:
            self.poll(blocking=True)
        finally:
            for retention in self._retention.values():
                retention.wait()
            if self.mirror is not None:
                self.mirror.close()
