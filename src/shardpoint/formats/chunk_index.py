"""``.chunk_index``: the stored chunks of a ``dist`` checkpoint as arrays, read without unpickling.

DCP's ``.metadata`` is a pickle of one object per stored chunk: at 4,096 ranks × 300
tensors, 123 MB that took rank 0 9.7 s to unpickle (``shardpoint bench --simulate-ranks``)
before a load could plan anything, and the plan then walked those objects again. The
index holds the same facts as columns, which a load turns into its plan with numpy
(:mod:`~shardpoint.formats.load_parts`), with no Python step per chunk and no pickle.
``.metadata`` stays beside it, so plain ``dcp.load`` keeps working; checkpoints without
an index (older ones, those ``dcp.save`` wrote) are planned from ``.metadata`` as before.

The file is in the safetensors format (a JSON header, then raw little-endian arrays):
a format from the package registry that shardpoint depends on already (written by its
library). A load reads the JSON header with shardpoint's strict parser and takes each
array as a view of the bytes read, its dtype, shape and byte range checked against the
file first (:func:`~shardpoint.formats.chunk_table.columns`; safetensors' loader copies every array). Its header gives
each array's byte range, so a reader could fetch only some
rows with ranged reads; today rank 0 reads the whole index once per load (the plan is
made on rank 0, :mod:`~shardpoint.formats.load_parts`), so summed over ranks a load
reads it once. ``.npz`` was the other candidate: a zip of ``.npy`` files, whose ranges
need the zip directory first.

Columns (``tensors`` keys in sorted order; ``rows`` chunks, each key's chunks in
``.metadata``'s order, so a chunk's row is its *position* in :mod:`load_parts`):

======================  ==============  ===============================================
``key_names``           uint8           the keys, UTF-8, one after another
``key_ends``            int64 [tensors] where each key's name ends in ``key_names``
``dtype``               int8 [tensors]  index into the header's ``dtypes``; -1: bytes
``shape_ends``          int64 [tensors] where each global shape ends in ``shapes``
``shapes``              int64           the global shapes, one after another
``first_row``           int64 [t + 1]   each key's rows: ``first_row[k]:first_row[k+1]``
``starts``, ``sizes``   int64 [rows, w] each chunk's offsets and sizes (padded: 0, 1)
``file``                int32 [rows]    index into the files; -1: no stored data
``offset``, ``length``  int64 [rows]    where the chunk's item lies in its file
``file_names``          uint8           the files, UTF-8 (``file_ends`` int64 [files])
======================  ==============  ===============================================

The header's ``__metadata__`` records the size and XXH3 of the ``.metadata`` written
with it and the counts of tensors and rows.

This is version 1. Saves now write version 2 (:mod:`~shardpoint.formats.chunk_rows`):
the same file without the per-chunk columns, which go to ``.chunk_rows`` as records
that each planner reads only its keys' range of. Both load: :func:`share_outline` reads
either, and the in-memory index and the checks both versions share are
:mod:`~shardpoint.formats.chunk_table`'s. The marker lists the index with its checksum
like every other file; a load refuses an index that fails it, or that records another
``.metadata`` than the marker lists (a file copied from another checkpoint), naming the
index; ``fallback=True`` then loads an older checkpoint, as for any damaged one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import safetensors.numpy
from torch.distributed.checkpoint.metadata import Metadata

from shardpoint.catalog.metadata import FileRecord, listed_record
from shardpoint.formats import chunk_rows
from shardpoint.formats.batched_writes import sync_stream
from shardpoint.formats.chunk_rows import ROWS_NAME
from shardpoint.formats.chunk_table import (
    FILE_COLUMNS,
    OUTLINE_COLUMNS,
    ChunkIndex,
    IndexReads,
    Outline,
    check_chunks,
    check_metadata_record,
    check_outline,
    check_within_files,
    columns,
    complaint,
    file_sizes,
    header,
    index_reads,
    outline_columns,
    padded,
    read,
    tensor_of,
)
from shardpoint.formats.dcp_metadata import DCP_METADATA
from shardpoint.parallel import comm

__all__ = [
    "INDEX_NAME",
    "ChunkIndex",
    "IndexReads",
    "Outline",
    "decode",
    "encode",
    "index_reads",
    "padded",
    "read",
    "share_outline",
    "tensor_of",
    "write",
]

INDEX_NAME = ".chunk_index"
_VERSION = "1"
_COLUMNS = {  # name: (dtype, ndim): the outline's, and the rows'
    **OUTLINE_COLUMNS,
    **FILE_COLUMNS,
    "starts": (np.int64, 2),
    "sizes": (np.int64, 2),
    "file": (np.int32, 1),
    "offset": (np.int64, 1),
    "length": (np.int64, 1),
}


# ----------------------------------------------------------------------------- the file, version 1
def encode(index: ChunkIndex, metadata: FileRecord) -> bytes:
    """The bytes of a version-1 ``.chunk_index`` for ``index``, beside the ``.metadata`` that ``metadata`` records.

    Saves write version 2 (:func:`~shardpoint.formats.chunk_rows.encode_split`); this
    one is kept for the checkpoints that hold it, and for tests that craft them.
    """
    arrays, found = outline_columns(index, metadata, _VERSION)
    arrays.update(
        starts=np.ascontiguousarray(index.starts, np.int64),
        sizes=np.ascontiguousarray(index.sizes, np.int64),
        file=index.file.astype(np.int32),
        offset=index.offset.astype(np.int64),
        length=index.length.astype(np.int64),
    )
    return safetensors.numpy.save(arrays, metadata=found)


def decode(data: bytes, name: str, metadata: FileRecord | None, size_of: Callable[[str], int]) -> ChunkIndex:
    """``data``, the bytes of a version-1 index, as a :class:`ChunkIndex`, every column checked before it is used.

    ``name``: the index, for messages; ``metadata``: the marker's record of ``.metadata``,
    which the index must record as the file written with it; ``size_of(file)``: the
    size of a file the index names, raising for one the marker does not list. The
    columns are views of ``data``.

    Raises:
        CorruptCheckpointError: naming ``name``: not an index, an index of another
        ``.metadata``, or a column that contradicts another or the files it names.
    """
    found = header(data, name, (_VERSION,))
    check_metadata_record(found, metadata, name)
    arrays = columns(data, name, _COLUMNS)
    outlined = check_outline(arrays, found, name, len(arrays["file"]))
    placement = (arrays["starts"], arrays["sizes"], arrays["file"], arrays["offset"], arrays["length"])
    keys, dtypes, shapes, first_row = outlined.keys, outlined.dtypes, outlined.shapes, outlined.first_row
    index = ChunkIndex(keys, dtypes, shapes, first_row, *placement, outlined.files)
    bad = complaint(name)
    check_chunks(index, outlined.counts, bad)
    check_within_files(index, file_sizes(index.files, size_of), bad)
    return index


# ----------------------------------------------------------------------------- saving and sharing
def write(writer: Any, data: bytes, name: str = INDEX_NAME) -> None:
    """Write an index file (``name``) through a DCP writer's filesystem, which records its checksum; durably."""
    path = writer.fs.concat_path(writer.path, name)
    with writer.fs.create_stream(path, "wb") as stream:
        stream.write(data)
        if getattr(writer, "sync_files", False):
            sync_stream(stream)


def share_outline(reader: Any, listed: Mapping[str, FileRecord]) -> tuple[Metadata, ChunkIndex | None]:
    """Collective: rank 0 reads and checks the index; every rank gets its :class:`Outline` in one broadcast.

    ``reader``: a DCP reader (its ``fs`` and ``path``); ``listed``: the marker's files.
    Returns the outline as DCP metadata without chunks, and on rank 0 the whole index
    (None elsewhere). Version 2 is read as its head, then every key's rows in one
    ranged read of ``.chunk_rows``, each key checked against its checksum. A failure
    on rank 0 is raised on every rank, as the same class. Nothing is unpickled on any rank.
    """
    where = str(reader.path)
    name = f"{where}/{INDEX_NAME}"
    kept: dict[str, ChunkIndex] = {}

    def read_and_check() -> Outline:
        record = listed_record(listed, INDEX_NAME, where, "the dist format")
        path = reader.fs.concat_path(reader.path, INDEX_NAME)
        data = read(lambda: reader.fs.create_stream(path, "rb"), record, name)
        size_of = chunk_rows.sized(dict(listed), where)
        if header(data, name, (_VERSION, chunk_rows.VERSION))["version"] == _VERSION:
            if ROWS_NAME in listed:  # nothing would read (and check) them: a version-2 head was replaced
                raise complaint(name)(f"it is of version 1, which has no {ROWS_NAME} beside it")
            kept["index"] = decode(data, name, listed.get(DCP_METADATA), size_of)
        else:  # a version-2 head is planned by key across ranks (formats.split_plan), which needs its rows listed
            raise complaint(name)(f"it is of version 2, whose rows the marker does not list ({ROWS_NAME})")
        return kept["index"].outline

    outline = comm.from_root(read_and_check, "reading the chunk index")
    return outline.metadata(), kept.get("index")
