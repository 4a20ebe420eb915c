"""Frozen tensors stored once: a save refers to the bytes an earlier checkpoint of the run already holds.

Fine-tuning over a frozen base (adapters, a frozen vision encoder, frozen embeddings)
used to write the base again at every save. Now a save of the ``dist`` format writes a
frozen tensor's item only when its bytes changed since the last checkpoint this
process committed; otherwise the item's storage record in ``.metadata`` points into
the file that holds those bytes, ``../<earlier checkpoint>/__0_0.distcp`` at the same
offset. Every checkpoint stays complete: ``dcp.load``, ``load``, ``verify`` and the
CLI read the referred range as their own, and the marker lists the referred file with
its checksum, so a flipped byte in it is named by every checkpoint that uses it.
References always name the checkpoint that wrote the bytes, never a reference to a
reference, so one deleted checkpoint never breaks a chain
(:mod:`shardpoint.lifecycle.references` keeps the files kept checkpoints refer to).

Deciding "unchanged" costs no pass over the trained state:

* only *frozen* tensors are candidates: model parameters with ``requires_grad=False``, or
  in no group of an optimizer over the model's own parameters (``FlatState.frozen``,
  :func:`shardpoint.state.train_state.frozen_keys`); trained parameters and optimizer
  state are written as before, with nothing added to their cost;
* a candidate's bytes are hashed (xxh3-128, 18-34 GB/s on one core here) and compared
  with the hash recorded when its stored bytes were written. A version counter alone is
  not proof: writes through ``.data`` or numpy do not bump it, and an EMA or a
  hand-edited weight would be silently stale. Equal 128-bit hashes of the same item
  box are.

Only what this process wrote is referred to (hashes are kept in memory, per item box):
the first save after a restart writes the frozen part once more.

Object stores resolve no ``../`` in a key, and plain ``dcp.load`` must still read every
checkpoint there. So on object storage a save copies the files holding its unchanged
items server-side (S3 ``CopyObject``, GCS rewrite, Azure copy-blob:
:meth:`StoredItems.copy_into`) into itself as ``shared-<writer>-<file>``: none of those
bytes go through the client again, every checkpoint holds its own files (so retention
there needs no references), and the next save copies from the newest one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo  # the storage record DCP's readers expect
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from shardpoint.catalog.metadata import FileRecord, sibling_path

__all__ = ["StoredItem", "StoredItems", "copy_name", "referred_records", "referred_results", "tensor_digest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredItem:
    """Where the bytes of one frozen item box are stored, and their hash.

    ``path`` is relative to the save directory's parent (``iter_0000010/__0_0.distcp``):
    the checkpoint that wrote the bytes.
    """

    digest: str
    path: str
    offset: int
    length: int
    record: FileRecord

    def name_in(self, dir_name: str) -> str:
        """The name the checkpoint ``dir_name`` gives this item's file: its own, or ``../<writer>/<file>``."""
        own = self.path.removeprefix(f"{dir_name}/")
        return own if own != self.path else sibling_path(self.path)


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes, with its dtype and shape (equal bytes of another shape are another item)."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    # reshape(-1) first: a 0-dim tensor has no last dimension to reinterpret as bytes
    # (``view(torch.uint8)`` raises on it), and a frozen scalar (a temperature, a
    # ``logit_scale``) must hash like any other tensor.
    data = data.contiguous().reshape(-1)
    hasher = xxhash.xxh3_128(f"{data.dtype}{tuple(tensor.shape)}".encode())
    if data.numel():
        hasher.update(data.view(torch.uint8).numpy().data)
    return hasher.hexdigest()


class StoredItems:
    """The frozen items of the last checkpoint this process committed: what the next save may refer to.

    A save asks :meth:`split` which items of its plan are unchanged, writes the rest,
    and reports what it wrote with :meth:`written`; the pipeline calls :meth:`commit`
    once the checkpoint is committed (or :meth:`discard` when the save failed), so a
    save never refers to bytes of a checkpoint that does not exist.
    """

    def __init__(self) -> None:
        self._committed: dict[tuple[str, tuple[int, ...]], StoredItem] = {}
        self._pending: dict[tuple[str, tuple[int, ...]], StoredItem] = {}
        self._digests: dict[tuple[str, tuple[int, ...]], str] = {}
        self.dir_name = ""  # the final name of the checkpoint being saved
        self.referred_bytes = 0  # of the last save, this rank
        self.hashed_bytes = 0

    def begin(self, dir_name: str) -> None:
        """A save into ``dir_name`` starts (the checkpoint's final name, beside the earlier ones)."""
        self.dir_name = dir_name
        self._pending, self._digests, self.referred_bytes, self.hashed_bytes = {}, {}, 0, 0

    def split(self, plan: SavePlan, planner: Any, frozen: set[str]) -> tuple[SavePlan, dict[Any, StoredItem]]:
        """The plan of items to write, and the items whose stored bytes are referred to instead (by index).

        Bytes stored in the directory this save replaces (a second save of one
        iteration, a framework's fixed checkpoint name) are written again: that
        directory goes away when this save commits.
        """
        refer: dict[Any, StoredItem] = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.index.fqn not in frozen:
                continue
            tensor = planner.resolve_data(item)
            box = _box(item.index)
            self._digests[box] = digest = tensor_digest(tensor)
            self.hashed_bytes += tensor.nbytes
            stored = self._committed.get(box)
            if stored is not None and stored.digest == digest and not stored.path.startswith(self.dir_name + "/"):
                refer[item.index] = stored
                self._pending[box] = stored
                self.referred_bytes += stored.length
        if not refer:
            return plan, refer
        return dataclasses.replace(plan, items=[i for i in plan.items if i.index not in refer]), refer

    def copy_into(self, refer: dict[Any, StoredItem], copy: Callable[[str, str], None]) -> dict[Any, StoredItem]:
        """Copy the files ``refer`` points into into this save (``copy(source path, own name)``); the items there.

        For stores where a checkpoint cannot refer to another's files (see the module
        docstring); the next save refers to (and copies) these copies. Items whose file
        could not be copied are left out: the caller writes them.
        """
        names = {stored.path: copy_name(stored.path) for stored in refer.values()}
        for path, name in sorted(names.items()):
            try:
                copy(path, name)
            except Exception as exc:  # noqa: BLE001 - deleted meanwhile, refused, ...: its items are written instead
                log.warning("could not copy %s into %s (%s); writing its frozen items again", path, self.dir_name, exc)
                del names[path]
        copied = {
            index: dataclasses.replace(stored, path=f"{self.dir_name}/{names[stored.path]}")
            for index, stored in refer.items()
            if stored.path in names
        }
        for index in refer.keys() - copied.keys():
            self._pending.pop(_box(index), None)
        self._pending.update((_box(index), stored) for index, stored in copied.items())
        return copied

    def written(self, results: list[WriteResult], records: dict[str, FileRecord]) -> None:
        """Note the frozen items this save wrote (``records``: its files, by name in its directory)."""
        for result in results:
            box = _box(result.index)
            digest = self._digests.get(box)
            info = result.storage_data
            if digest is None or info.relative_path not in records:
                continue
            path = f"{self.dir_name}/{info.relative_path}"
            self._pending[box] = StoredItem(digest, path, info.offset, info.length, records[info.relative_path])

    def commit(self) -> None:
        self._committed, self._pending = self._pending, {}

    def discard(self) -> None:
        self._pending = {}


def referred_results(refer: dict[Any, StoredItem], dir_name: str) -> list[WriteResult]:
    """DCP write results whose storage records point into the earlier checkpoints' files (or their copies)."""
    return [
        WriteResult(
            index=index,
            size_in_bytes=stored.length,
            storage_data=_StorageInfo(stored.name_in(dir_name), stored.offset, stored.length),
        )
        for index, stored in refer.items()
    ]


def referred_records(refer: dict[Any, StoredItem], dir_name: str) -> dict[str, FileRecord]:
    """The marker's records of the files referred to, under the names the checkpoint gives them."""
    return {stored.name_in(dir_name): stored.record for stored in refer.values()}


def copy_name(path: str) -> str:
    """A copied file's name in the copying checkpoint: ``shared-<the checkpoint that wrote it>-<its file>``.

    A copy of a copy keeps the name, so names never grow and two files never collide.
    """
    writer, _, name = path.partition("/")
    return name if name.startswith("shared-") else f"shared-{writer}-{name}"


def _box(index: Any) -> tuple[str, tuple[int, ...]]:
    return index.fqn, tuple(index.offset or ())
