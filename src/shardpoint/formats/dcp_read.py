"""Reading DCP files in one pass: checksums while reading, tensors without unpickling.

DCP's own readers ``torch.load`` every stored item from a view of its file. That costs
about 0.6 ms per item (the weights-only unpickler and the zip reader), more than
copying a megabyte, and shardpoint's checksums then needed a second pass over every
file. :class:`StreamingReads` reads each file once, front to back, hashing every byte
on the way (the gaps between wanted items too, so the whole file is checked). Items
that shardpoint wrote as contiguous tensors (``CheckpointMetadata.contiguous_items``)
are decoded by finding the tensor's bytes in the item's zip archive, with shape and
dtype from DCP's metadata: nothing is unpickled. Anything else goes through
``torch.load`` as in DCP.

A damaged byte is known only once the file's last byte is hashed, so tensors from a
damaged file may already sit in the state being loaded. The load then fails with
:class:`CorruptCheckpointError` on every rank (DCP gathers read failures), and that
state must not be trained on; ``fallback=True`` loads an older checkpoint in full.
"""

from __future__ import annotations

import io
import struct
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from shardpoint.catalog.metadata import FileRecord, listed_record
from shardpoint.errors import CorruptCheckpointError
from shardpoint.formats.dcp_metadata import DCP_METADATA
from shardpoint.formats.shares import balanced, useful_threads
from shardpoint.formats.tensor_archive import known_data_offset, known_ends
from shardpoint.parallel import devices
from shardpoint.storage.safe_io import safe_torch_load

__all__ = ["ReadBuffers", "StreamingReads", "tensor_record"]

_MIN_BUFFER = 4 << 20
_HEAD = 4096  # enough for the records torch.save writes before a tensor's bytes
_WHOLE_FILE_SHARE = 0.5  # a rank hashes a file while reading it when it reads at least this much of it
_PIECE = 1 << 20  # read and hashed at a time: stays in the CPU's cache (L2) between the two
_LOCAL_HEADER = b"PK\x03\x04"


class StreamingReads:
    """Mixin for DCP readers: each file read once, on several threads, checked and decoded.

    Set by :func:`shardpoint.formats.dist.dcp_reader`: ``thread_count``, ``expected``
    (file name -> record whose checksum is checked while reading; None: no checks),
    ``listed`` (the marker's files: no other file is opened) and ``contiguous_items``.
    After a load, ``checked`` names the files whose checksum this rank compared. Every
    item is checked against the file's real size before a buffer is sized from its length.
    """

    storage_data: dict[MetadataIndex, Any]  # set by DCP's reader, whose ``set_up_storage_reader`` this extends
    fs: Any  # the DCP reader's filesystem (local, or fsspec for object stores)
    thread_count = 1
    expected: dict[str, FileRecord] | None = None
    contiguous_items = False
    direct_reads = True  # whole tensors straight into their targets (local files; see _read_item)
    double_buffered: bool | None = None  # two pinned buffers (ReadBuffers); None: when CUDA is in use

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)  # type: ignore[misc]
        self._tensors = metadata.state_dict_metadata
        self.checked: set[str] = set()
        self.bytes_read = 0  # from the data files, by every reading thread

    def read_data(self, plan: LoadPlan, planner: Any) -> torch.futures.Future:
        self._device = devices.thread_device()  # reading threads work on the trainer's device
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        sizes = {name: sum(self._info(item).length for item in items) for name, items in per_file.items()}
        threads = useful_threads((self._info(item).length for item in plan.items), self.thread_count)
        shares = balanced(sizes, threads)
        if len(shares) == 1:
            self._read_files(shares[0], per_file, planner)
        elif shares:
            with ThreadPoolExecutor(len(shares), thread_name_prefix="shardpoint-read") as pool:
                done = [pool.submit(self._read_files, share, per_file, planner) for share in shares]
                for pending in done:
                    pending.result()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future

    def _info(self, item: ReadItem) -> Any:
        return self.storage_data[item.storage_index]

    def _read_files(self, names: list[str], per_file: dict[str, list[ReadItem]], planner: Any) -> None:
        """One thread's share, through reused buffers (fresh memory is slow to touch)."""
        device = getattr(self, "_device", None)
        devices.bind(device)
        scratch = ReadBuffers(double=device is not None if self.double_buffered is None else self.double_buffered)
        try:
            for name in names:
                self._read_file(name, per_file[name], planner, scratch)
        finally:
            scratch.drain()

    def _read_file(self, name: str, items: list[ReadItem], planner: Any, scratch: ReadBuffers) -> None:
        places: dict[tuple[int, int], list[ReadItem]] = {}
        for item in items:
            info = self._info(item)
            places.setdefault((info.offset, info.length), []).append(item)
        listed = getattr(self, "listed", None)  # SafeMetadata's, in the same reader class
        if listed is not None:
            listed_record(listed, name, str(self.path), DCP_METADATA)  # type: ignore[attr-defined]
        record = None if self.expected is None else self.expected.get(name)
        # a rank needing little of a file (resharding) reads just that; the file is checked once, after the load
        needed = sum(length for _, length in places)
        digest = xxhash.xxh3_64() if record is not None and needed >= record.size * _WHOLE_FILE_SHARE else None
        failure: Exception | None = None
        path = self.fs.concat_path(self.path, name)  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as raw:
            stream = _Counting(raw)
            _check_extent(stream, max(offset + length for offset, length in places), name)
            position = 0
            for (offset, length), wanted in sorted(places.items()):
                scratch.next()  # the other buffer, once the copies out of it are done
                if digest is not None:
                    _hash_through(stream, digest, scratch.view, offset - position, name)
                else:
                    stream.seek(offset)
                placing = wanted if failure is None else []  # after a damaged item: only hash the rest
                view = self._read_item(stream, length, placing, planner, scratch, digest, name)
                position = offset + length
                if view is not None and failure is None:
                    try:
                        self._place(view, wanted, planner, scratch)
                    except Exception as exc:  # a damaged item: the checksum names the file below
                        if digest is None:
                            raise
                        failure = exc
            if digest is not None:
                scratch.next()
                _hash_through(stream, digest, scratch.view, None, name)
        with _COUNT_LOCK:
            self.bytes_read += stream.count
        if digest is not None and record is not None:  # (a digest implies a record)
            if digest.hexdigest() != record.xxh3_64:
                raise CorruptCheckpointError(
                    f"checkpoint {self.path} is damaged: {name}: checksum mismatch (the contents changed after "  # type: ignore[attr-defined]
                    "saving). Load an earlier iteration (iteration=N or fallback=True), or run `shardpoint verify`"
                )
            self.checked.add(name)
        if failure is not None:
            raise failure

    def _read_item(
        self,
        stream: Any,
        length: int,
        wanted: list[ReadItem],
        planner: Any,
        scratch: ReadBuffers,
        digest: Any,
        name: str,
    ) -> memoryview | None:
        """Read one stored item, hashing it; return its bytes, or None when they went straight into the target.

        A whole, contiguous CPU target of the stored dtype receives the tensor's bytes
        directly from the file (found from the archive's local headers, which come
        first): one copy fewer than through the buffer. Anything else is read whole.
        """
        target = self._direct_target(wanted, planner)
        found = None
        head = min(length, _HEAD) if target is not None else 0
        buffer = scratch.view
        _read_exactly(stream, buffer[:head], name)
        if target is not None and length > 2 * _HEAD:
            item_start = stream.tell() - head
            stream.seek(item_start + length - _HEAD)
            _read_exactly(stream, buffer[head : head + _HEAD], name)
            found = self._located(buffer[:head], buffer[head : head + _HEAD], length, wanted[0])
            stream.seek(item_start + head)
        if target is None or found is None or not _direct_fits(found, target.nbytes, head, length):
            buffer = scratch.at_least(length, keep=head)
            _update(digest, buffer[:head])
            _read_exactly(stream, buffer[head:length], name, digest)
            return buffer[:length]
        start, size = found
        destination = target.reshape(-1).view(torch.uint8).numpy().data
        end = length - _HEAD  # the item's last _HEAD bytes (the tensor's last ones, the directory) are read
        destination[: head - start] = buffer[start:head]  # the tensor's first bytes came with the headers
        _update(digest, buffer[:head])
        _read_exactly(stream, destination[head - start : end - start], name, digest)
        last = buffer[head : head + _HEAD]
        destination[end - start :] = last[: start + size - end]  # not read twice: bytes read / stored is 1
        _update(digest, last)
        stream.seek(_HEAD, io.SEEK_CUR)
        planner.commit_tensor(wanted[0], target)
        return None

    def _located(self, first: memoryview, last: memoryview, length: int, item: ReadItem) -> tuple[int, int] | None:
        """Where the tensor's bytes lie in an item known by its ends: from the template, else the zip records."""
        shape, dtype = self._chunk(item.storage_index)
        start = known_ends(first, last, length, dtype, tuple(shape))
        if start is not None:
            return start, shape.numel() * dtype.itemsize
        return _storage_at_ends(first, last, length)

    def _direct_target(self, wanted: list[ReadItem], planner: Any) -> torch.Tensor | None:
        """The target of a stored item that is read whole into one contiguous CPU tensor, else None."""
        if not (self.contiguous_items and self.direct_reads) or len(wanted) != 1:
            return None
        item = wanted[0]
        if item.type == LoadItemType.BYTE_IO or self._info(item).transform_descriptors:
            return None
        shape, dtype = self._chunk(item.storage_index)
        if any(item.storage_offsets) or tuple(item.lengths) != tuple(shape):
            return None
        target = planner.resolve_tensor(item).detach()
        usable = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        return target if usable and target.shape == shape and target.numel() > 0 else None

    def _place(self, view: memoryview, items: list[ReadItem], planner: Any, scratch: ReadBuffers) -> None:
        """Decode one stored item and copy the parts that ``items`` ask for into their targets.

        Copies to an accelerator are non-blocking from the (pinned) buffer; the buffer
        is not reused before they are done (:class:`ReadBuffers`).
        """
        first = items[0]
        if first.type == LoadItemType.BYTE_IO:
            descriptors = self._info(first).transform_descriptors or ()
            for item in items:
                stream = self.transforms.transform_load_stream(item, descriptors, io.BytesIO(view))  # type: ignore[attr-defined]
                planner.load_bytes(item, io.BytesIO(stream.read()))
            return
        tensor = self._decode(view, first)
        for item in items:
            piece = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != piece.size():
                raise CorruptCheckpointError(
                    f"{self.path}: {item.storage_index.fqn} has shape {tuple(piece.shape)} in its file, "  # type: ignore[attr-defined]
                    f"expected {tuple(target.shape)}"
                )
            on_device = target.device.type != "cpu"
            target.copy_(piece, non_blocking=on_device)
            if on_device:
                scratch.copied_to(target.device)
            planner.commit_tensor(item, target)

    def _decode(self, view: memoryview, item: ReadItem) -> torch.Tensor:
        info = self._info(item)
        if info.transform_descriptors:
            stream = self.transforms.transform_load_stream(item, info.transform_descriptors, io.BytesIO(view))  # type: ignore[attr-defined]
            return safe_torch_load(io.BytesIO(stream.read()), name=self._item_name(item, info))
        if self.contiguous_items:
            shape, dtype = self._chunk(item.storage_index)
            size = shape.numel() * dtype.itemsize
            start = known_data_offset(view, dtype, tuple(shape))
            found = (start, size) if start is not None else tensor_record(view)
            if found is not None and found[1] == size and size > 0:
                raw = torch.frombuffer(view, dtype=torch.uint8, count=size, offset=found[0])
                return raw.view(dtype).view(shape)
        # a damaged item (its file's checksum matched a crafted marker) is named, whatever torch raises
        return safe_torch_load(io.BytesIO(view), name=self._item_name(item, info))

    @staticmethod
    def _item_name(item: ReadItem, info: Any) -> str:
        return f"item {item.storage_index.fqn!r} of {info.relative_path}"

    def _chunk(self, index: MetadataIndex) -> tuple[torch.Size, torch.dtype]:
        md = self._tensors[index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        chunks = md.chunks
        if index.index is not None and index.index < len(chunks) and chunks[index.index].offsets == index.offset:
            return chunks[index.index].sizes, md.properties.dtype
        for chunk in chunks:
            if chunk.offsets == index.offset:
                return chunk.sizes, md.properties.dtype
        raise CorruptCheckpointError(f"{self.path}: no stored chunk of {index.fqn} at {tuple(index.offset or ())}")  # type: ignore[attr-defined]


def tensor_record(archive: memoryview | _ArchiveEnds) -> tuple[int, int] | None:
    """Where the bytes of the single storage in a ``torch.save`` archive lie: (offset, size).

    None when the archive is not that simple (several storages, compression, damage):
    the caller then falls back to ``torch.load``.
    """
    source = archive if isinstance(archive, _ArchiveEnds) else _ArchiveEnds(archive, archive[:0], len(archive))
    try:
        records = zipfile.ZipFile(source).infolist()
    except Exception:  # noqa: BLE001 - zipfile raises many kinds on odd archives; torch.load then decides
        return None
    storages = [r for r in records if r.filename.rsplit("/", 2)[-2:-1] == ["data"]]
    if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED:
        return None
    header = storages[0].header_offset
    local = source.peek_at(header, 30)
    if local is None or local[:4] != _LOCAL_HEADER:
        return None
    name_length, extra_length = struct.unpack_from("<HH", local, 26)
    start = header + 30 + name_length + extra_length
    if start + storages[0].file_size > source.length:
        return None
    return start, storages[0].file_size


class _Counting(io.RawIOBase):
    """A read stream that counts the bytes read through it (``Loaded.bytes_read``)."""

    def __init__(self, raw: Any):
        super().__init__()
        self.raw, self.count = raw, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.raw.readinto(buffer)
        self.count += n or 0
        return n

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.count += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()


_COUNT_LOCK = threading.Lock()


class ReadBuffers:
    """A reading thread's buffers, reused for every item and grown only for an item read through them.

    Items read straight into their targets never need more than a few KiB, so loading
    a large tensor costs no buffer of its size. With ``double`` (targets on an
    accelerator) there are two *pinned* buffers: while the device copies one item out
    of one buffer (non-blocking), the next item is read into the other; :meth:`next`
    waits for a buffer's copies before it is overwritten. Before, every item went
    through unpinned memory and a blocking copy.
    """

    def __init__(self, double: bool = False) -> None:
        self.pinned = double
        self._views = [self._new(_MIN_BUFFER) for _ in range(2 if double else 1)]
        self._events: list[list[Any]] = [[] for _ in self._views]
        self._current = 0

    @property
    def view(self) -> memoryview:
        return self._views[self._current]

    def at_least(self, size: int, keep: int = 0) -> memoryview:
        """The current buffer, at least ``size`` bytes long; its first ``keep`` bytes stay as they were."""
        if size > len(self.view):
            grown = self._new(size)
            grown[:keep] = self.view[:keep]
            self._views[self._current] = grown
        return self.view

    def next(self) -> None:
        """Switch to the other buffer (if two), after the device copies out of it are done."""
        self._current = (self._current + 1) % len(self._views)
        self._wait(self._current)

    def copied_to(self, device: torch.device) -> None:
        """A copy out of the current buffer was queued on ``device``: remember it before the buffer is reused."""
        event = devices.record_event(device)
        if event is not None:
            self._events[self._current].append(event)

    def drain(self) -> None:
        """Wait for every queued copy (the targets are complete, the buffers may go)."""
        for index in range(len(self._views)):
            self._wait(index)

    def _wait(self, index: int) -> None:
        for event in self._events[index]:
            event.synchronize()
        self._events[index].clear()

    def _new(self, size: int) -> memoryview:
        if self.pinned:
            return devices.host_slab(size, pinned=True).numpy().data
        return memoryview(bytearray(size))


def _direct_fits(found: tuple[int, int], nbytes: int, head: int, length: int) -> bool:
    """The storage is the target's size, starts in the head, reaches past it and leaves room for the directory."""
    start, size = found
    return size == nbytes and start <= head < start + size and length - start - size <= _HEAD


def _storage_at_ends(head: memoryview, tail: memoryview, length: int) -> tuple[int, int] | None:
    """:func:`tensor_record` of an item known only by its first and last bytes (headers, directory)."""
    found = tensor_record(_ArchiveEnds(head, tail, length))
    if found is None or found[0] > len(head):
        return None
    return found


class _ArchiveEnds(io.RawIOBase):
    """A stored item for ``zipfile``, known by its first bytes (local headers) and last bytes (directory).

    ``zipfile`` reads only the directory and the local headers, so neither the item's
    data nor its copy is needed (a whole item is all "head"). Reading anything in
    between raises ValueError: the archive then counts as not simple.
    """

    def __init__(self, head: memoryview, tail: memoryview, length: int):
        self._head, self._tail, self.length = head, tail, length
        self._tail_start = length - len(tail)
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def peek_at(self, offset: int, size: int) -> bytes | None:
        if offset + size <= len(self._head):
            return bytes(self._head[offset : offset + size])
        if offset >= self._tail_start and offset + size <= self.length:
            return bytes(self._tail[offset - self._tail_start : offset - self._tail_start + size])
        return None

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self._position))
        data = self.peek_at(self._position, n)
        if data is None:
            raise ValueError("outside the ends of the item")
        buffer[:n] = data
        self._position += n
        return n


def _check_extent(stream: Any, end: int, name: str) -> None:
    """Refuse to read items ending past the file's real size, before any buffer is sized from their lengths."""
    stream.seek(0, io.SEEK_END)
    size = stream.tell()
    stream.seek(0)
    if end > size:
        raise CorruptCheckpointError(
            f"{name}: DCP's {DCP_METADATA} places stored bytes up to byte {end}, past the file's {size} bytes "
            "(truncated, or the metadata is damaged or crafted); nothing was read from it"
        )


def _read_exactly(stream: Any, view: memoryview, name: str, digest: Any = None) -> None:
    """Fill ``view`` from ``stream``; hash each piece while it is still in the CPU's cache."""
    done = 0
    while done < len(view):
        n = stream.readinto(view[done : done + _PIECE] if digest is not None else view[done:])
        if not n:
            raise CorruptCheckpointError(f"{name}: ends early (truncated while being read)")
        _update(digest, view[done : done + n])
        done += n


def _update(digest: Any, view: memoryview) -> None:
    if digest is not None:
        digest.update(view)


def _hash_through(stream: Any, digest: Any, buffer: memoryview, count: int | None, name: str) -> None:
    """Read and hash ``count`` bytes (None: to the end of the file) through ``buffer``."""
    while count is None or count > 0:
        view = buffer[:_PIECE] if count is None else buffer[: min(count, _PIECE)]
        n = stream.readinto(view)
        if not n:
            if count is None:
                return
            raise CorruptCheckpointError(f"{name}: ends early (truncated while being read)")
        digest.update(view[:n])
        if count is not None:
            count -= n
