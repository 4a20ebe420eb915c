"""Moving one rank's files to another rank over a gloo process group: no shared filesystem.

Replication (after each local save, on the tier's own background group) and fetching
(a replacement node taking its ranks' files from peers at load, on the control
group) are the same operation: a list of :class:`Transfer` that every rank knows,
each sending one file from ``source`` to ``target`` (every file a copy's marker lists
is one transfer, with a tag of its own) as CPU ``uint8`` tensors (invariant 13: never
through the trainer's groups, never a pickled payload).

Files travel in chunks of :data:`CHUNK` bytes, in rounds: in round ``c`` every rank
posts the ``isend`` / ``irecv`` of chunk ``c`` of each of its transfers, then waits
for them. Every round-``c`` message is posted by both of its ends once they finished
round ``c - 1``, so rounds never deadlock whatever the pattern (a rank may send and
receive at once), and memory stays at one chunk per transfer, in a buffer allocated
once and reused every round (a fresh buffer per chunk cost more in page faults than
the transfer itself).

A sender that cannot read its file still sends chunks of the agreed size (zeros), so
no receiver waits for bytes that never come; the receiver hashes what arrives while
writing it (:class:`~shardpoint.catalog.integrity.HashingWriter`) and the caller
compares the digest with the sender's record, so a bad read shows up as a named
checksum failure instead of a hang.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from shardpoint.catalog.integrity import HashingWriter
from shardpoint.catalog.metadata import FileRecord
from shardpoint.parallel import comm

__all__ = ["CHUNK", "Transfer", "exchange"]

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # measured here: 4-8 MiB moves loopback gloo fastest; one buffer per transfer, reused


@dataclass(frozen=True)
class Transfer:
    """``owner``'s file ``name`` (``size`` bytes) from rank ``source`` to rank ``target``."""

    owner: int
    source: int
    target: int
    name: str
    size: int

    def chunks(self, chunk: int) -> int:
        return -(-self.size // chunk)


def exchange(
    transfers: Sequence[Transfer],
    open_source: Callable[[Transfer], AbstractContextManager[io.BufferedIOBase]],
    open_target: Callable[[Transfer], AbstractContextManager[BinaryIO]],
    group: Any,
    chunk: int = CHUNK,
) -> tuple[dict[Transfer, FileRecord], list[str]]:
    """Run this rank's part of ``transfers`` (every rank passes the same list).

    Returns the record (size and checksum) of each file this rank received, and the
    errors this rank hit reading what it sends (the receiver's checksum fails too) or
    storing what it receives.
    Ranks with no transfer return at once; nothing here is a collective of all ranks.
    """
    me = comm.rank()
    tags = {t: i for i, t in enumerate(transfers)}  # one tag per transfer: two files of one owner never cross
    sends = [t for t in transfers if t.source == me and t.target != me]
    recvs = [t for t in transfers if t.target == me and t.source != me]
    errors: list[str] = []
    with ExitStack() as stack:
        readers = {t: _open_or_none(stack, open_source, t, errors) for t in sends}
        writers = {t: _Sink(stack, open_target, t, errors) for t in recvs}
        buffers = {t: torch.empty(min(chunk, t.size), dtype=torch.uint8) for t in [*sends, *recvs]}
        rounds = max((t.chunks(chunk) for t in [*sends, *recvs]), default=0)
        for c in range(rounds):
            ops, incoming = [], []
            for t in sends:
                if c < t.chunks(chunk):
                    data = _read_chunk(readers[t], buffers[t], t, c, chunk, errors)
                    ops.append(comm.posted(dist.isend(data, t.target, group=group, tag=tags[t]), _moving(t)))
            for t in recvs:
                if c < t.chunks(chunk):
                    buffer = buffers[t][: min(chunk, t.size - c * chunk)]
                    ops.append(comm.posted(dist.irecv(buffer, t.source, group=group, tag=tags[t]), _moving(t)))
                    incoming.append((t, buffer))
            for op in ops:
                op.wait()
            for t, buffer in incoming:
                writers[t].write(buffer.numpy())
        for writer in writers.values():
            writer.flush()
    return {t: w.record() for t, w in writers.items()}, errors


class _Sink:
    """The receiving end of one transfer: hashes every byte, writes it while the disk allows.

    A file that cannot be opened or written (a full disk) keeps receiving, so the
    sender never waits on it; the failure is recorded for the caller to raise.
    """

    def __init__(
        self,
        stack: ExitStack,
        open_target: Callable[[Transfer], AbstractContextManager[BinaryIO]],
        t: Transfer,
        errors: list[str],
    ):
        self.transfer, self.errors = t, errors
        self.hashing: HashingWriter | None = None
        self.digest = HashingWriter(_Discard())
        try:
            self.hashing = HashingWriter(stack.enter_context(open_target(t)))
        except OSError as exc:
            self._fail(exc)

    def write(self, data: Any) -> None:
        if self.hashing is None:
            self.digest.write(data)
            return
        try:
            self.hashing.write(data)
        except OSError as exc:
            self.digest.size, self.digest.digest = self.hashing.size, self.hashing.digest
            self.hashing = None
            self._fail(exc)
            self.digest.write(data)

    def flush(self) -> None:
        if self.hashing is not None:
            try:
                self.hashing.flush()
            except OSError as exc:
                self._fail(exc)

    def record(self) -> FileRecord:
        return (self.hashing or self.digest).record()

    def _fail(self, exc: OSError) -> None:
        t = self.transfer
        self.errors.append(f"cannot store rank {t.owner}'s {t.name} received from rank {t.source}: {exc}")


def _moving(t: Transfer) -> str:
    return f"moving rank {t.owner}'s {t.name} from rank {t.source} to rank {t.target}"


class _Discard:
    """Where the bytes of a transfer that cannot be stored go: counted (for the record), then dropped."""

    def __init__(self) -> None:
        self.position = 0

    def write(self, data: Any, /) -> int:
        size = memoryview(data).nbytes
        self.position += size
        return size

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a discarding sink has no file descriptor")


def _open_or_none(
    stack: ExitStack,
    open_source: Callable[[Transfer], AbstractContextManager[io.BufferedIOBase]],
    t: Transfer,
    errors: list[str],
) -> io.BufferedIOBase | None:
    try:
        return stack.enter_context(open_source(t))
    except OSError as exc:
        errors.append(f"cannot read rank {t.owner}'s {t.name} to send it to rank {t.target}: {exc}")
        return None


def _read_chunk(
    reader: io.BufferedIOBase | None, buffer: torch.Tensor, t: Transfer, c: int, chunk: int, errors: list[str]
) -> torch.Tensor:
    """Chunk ``c`` of the file in ``buffer``; zeros when it cannot be read (the receiver must not hang)."""
    data = buffer[: min(chunk, t.size - c * chunk)]
    view = data.numpy().data.cast("B")
    try:
        got = reader.readinto(view) if reader is not None else 0
    except OSError as exc:
        errors.append(f"reading rank {t.owner}'s {t.name} failed: {exc}")
        got = 0
    if got != view.nbytes:
        if reader is not None and not errors:
            errors.append(f"rank {t.owner}'s {t.name} is shorter than its record ({t.size} bytes)")
        data[got:] = 0
    return data
