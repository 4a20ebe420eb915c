"""``torch.save`` archives of single tensors, built from a template instead of pickling each one.

DCP stores every tensor item as its own ``torch.save`` archive, and plain ``dcp.load``
reads them back with ``torch.load``, so that is the format a checkpoint must keep. But
``torch.save`` of a small tensor costs about 0.1 ms of fixed work (pickling, seven zip
records, their headers) whatever its size: for a rank with thousands of small tensors
(a mixture-of-experts layer, Adam's moments of hundreds of norms) that fixed cost, not
the bandwidth, is the save time.

An archive of one tensor depends only on its dtype, shape and strides, except for the
bytes of its storage: the pickle names storage ``"0"`` of so many elements, the zip
records are stored uncompressed, and with the per-record CRC32 switched off
(:func:`shardpoint.catalog.integrity.without_zip_crc32`, which DCP's writer streams
already enter) the headers do not depend on the data either. So the archive of a tensor
is ``head + storage bytes + tail`` where ``head`` and ``tail`` come from one
``torch.save`` of zeros with the same signature, cached here. The result is byte for
byte what ``torch.save`` writes (tested on every dtype), so ``torch.load`` and
``dcp.load`` read it as usual.

Only small tensors that own exactly their storage take this path; a view into a larger
storage (which ``torch.save`` would write whole) or a large tensor (whose bandwidth
dwarfs the fixed cost, and whose template would cost a full-size save) is archived by
``torch.save`` itself.
"""

from __future__ import annotations

import io
import math
import threading
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shardpoint.catalog.integrity import crc32_is_per_thread, without_zip_crc32

#: tensors up to this size take the template path; above it ``torch.save``'s fixed cost is noise
TEMPLATE_MAX_BYTES = 1 << 20
#: signatures kept (head + tail are about 1.6 kB each)
TEMPLATE_CACHE_SIZE = 8192

_DATA_RECORD = "data/0"


@dataclass(frozen=True)
class Template:
    """The bytes of a one-tensor archive around its storage bytes."""

    head: bytes
    tail: bytes

    def size(self, nbytes: int) -> int:
        return len(self.head) + nbytes + len(self.tail)


class _Templates:
    """A bounded, thread-safe cache of templates by (dtype, shape, strides)."""

    def __init__(self, capacity: int = TEMPLATE_CACHE_SIZE):
        self.capacity = capacity
        self._cache: OrderedDict[tuple, Template] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]) -> Template:
        key = (dtype, shape, stride)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        template = build_template(dtype, shape, stride)
        with self._lock:
            self._cache[key] = template
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return template


_TEMPLATES = _Templates()


def build_template(dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]) -> Template:
    """Head and tail of ``torch.save`` of zeros of this dtype, shape and strides."""
    zeros = torch.empty_strided(shape, stride, dtype=dtype).zero_()
    buffer = io.BytesIO()
    with without_zip_crc32():
        torch.save(zeros, buffer)
    raw = buffer.getvalue()
    start = data_offset(raw)
    nbytes = zeros.untyped_storage().nbytes()
    return Template(head=raw[:start], tail=raw[start + nbytes :])


def data_offset(archive: bytes) -> int:
    """Where the storage bytes of a one-tensor archive begin (after its local zip header)."""
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/" + _DATA_RECORD))
    header = info.header_offset
    name_len = int.from_bytes(archive[header + 26 : header + 28], "little")
    extra_len = int.from_bytes(archive[header + 28 : header + 30], "little")
    return header + 30 + name_len + extra_len


def templated(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s archive is built from a template (see the module docstring)."""
    return (
        crc32_is_per_thread()
        and tensor.device.type == "cpu"
        and tensor.nbytes <= TEMPLATE_MAX_BYTES
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
        and not tensor.is_quantized
        and tensor.layout == torch.strided
        and type(tensor) is torch.Tensor
    )


def storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s storage, without a copy."""
    if tensor.is_contiguous():  # the common case, three times faster than a tensor over the storage
        return tensor.view(-1).view(torch.uint8).numpy().data
    raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return raw.numpy().data.cast("B")


def archive_parts(tensor: torch.Tensor) -> tuple[bytes, memoryview, bytes]:
    """``(head, storage bytes, tail)``: written in order, they are ``torch.save(tensor)``.

    ``tensor`` must be :func:`templated`.
    """
    template = _TEMPLATES.get(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    return template.head, storage_bytes(tensor), template.tail


def known_data_offset(archive: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
    """Where a contiguous tensor's bytes start in ``archive``, if it is the template's archive.

    The reader's fast path: instead of parsing the zip directory of every item, compare
    the archive's bytes around the data with the template of the stored dtype and shape.
    Equal, the archive is exactly what ``torch.save`` writes for such a tensor, so its
    data lies at ``len(head)``; anything else (an older torch, CRCs kept, a foreign
    writer) returns None and the caller parses the archive.
    """
    return known_ends(archive, archive[archive.nbytes - min(archive.nbytes, _TAIL_MAX) :], archive.nbytes, dtype, shape)


#: the longest template tail compared (the zip directory of a one-tensor archive is about 1 kB)
_TAIL_MAX = 4096


def known_ends(
    first: memoryview, last: memoryview, length: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> int | None:
    """:func:`known_data_offset` of an archive of ``length`` bytes known by its ``first`` and ``last`` bytes.

    A reader that streams a tensor's bytes straight into its target reads only the
    archive's ends first; this tells it where the data starts without a zip parse.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > TEMPLATE_MAX_BYTES or not crc32_is_per_thread():
        return None
    template = _TEMPLATES.get(dtype, tuple(shape), _contiguous_strides(shape))
    head, tail = template.head, template.tail
    if length != template.size(nbytes) or first.nbytes < len(head) or last.nbytes < len(tail):
        return None
    if first[: len(head)] != head or last[last.nbytes - len(tail) :] != tail:
        return None
    return len(head)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
