"""Loading a checkpoint from the object store, reading what this node kept locally from its own disk.

In node-local mode (:mod:`shardpoint.lifecycle.node_local`) each node keeps the files its ranks
wrote. Which files a rank reads on a load is the format's business (a ``dist`` load
reads ``.metadata``, ``common.pt``, its RNG file and whichever shard files hold the
boxes it needs, wherever DCP's deduplication put them), so the choice is made per
file, not per rank: :class:`NodeView` is a read-only storage over
``shardpoint-node://<token>`` that serves a file from the node's local copy when
that copy may be used, and from the object store otherwise. DCP reaches it through
fsspec (a protocol registered here), so the format code needs no change.

A local file may be used only when its node's copy is committed (it has a node
marker), the marker's record for the file equals the remote marker's record (same
size and checksum: the copy belongs to the checkpoint the remote tracker names, not
to an older save of the same iteration), its size on disk matches and, when checksums
are verified, its contents hash to the record. Anything else (a node that was
replaced and has nothing, a wiped or damaged disk) reads from the object store.
"""

from __future__ import annotations

import io
import logging
import posixpath
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import fsspec
from fsspec import AbstractFileSystem

from shardpoint.catalog.integrity import checksum_file
from shardpoint.catalog.metadata import CheckpointMetadata
from shardpoint.errors import StorageError
from shardpoint.lifecycle.node_local import NodeLocal, read_node_marker
from shardpoint.parallel import comm
from shardpoint.storage.base import Storage

__all__ = ["PROTOCOL", "NodeView", "open_view"]

log = logging.getLogger(__name__)

PROTOCOL = "shardpoint-node"
_VIEWS: dict[str, NodeView] = {}  # token -> view, for the fsspec filesystem (which is built from a URL)


@dataclass
class NodeView:
    """Read-only storage for one checkpoint directory: local files where usable, remote ones otherwise.

    Attributes:
        local: the node's local storage, ``local_dir`` its copy of the checkpoint.
        remote: the object store, ``remote_dir`` the checkpoint there.
        local_files: names (relative to the checkpoint) served from ``local_dir``.
        opened: how many files were opened from each side (``{"local": n, "remote": m}``).
    """

    local: Storage
    local_dir: str
    remote: Storage
    remote_dir: str
    local_files: frozenset[str]
    token: str = field(default_factory=lambda: secrets.token_hex(8))
    opened: dict[str, int] = field(default_factory=lambda: {"local": 0, "remote": 0})
    is_local = False
    supports_rename = False

    @property
    def root(self) -> str:
        return f"{PROTOCOL}://{self.token}"

    def resolve(self, path: str) -> tuple[Storage, str, bool]:
        """``(storage, real path, is local)`` for a path under :attr:`root`."""
        name = path.removeprefix(self.root).lstrip("/")
        if name in self.local_files:
            return self.local, self.local.join(self.local_dir, name), True
        return self.remote, self.remote.join(self.remote_dir, name) if name else self.remote_dir, False

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def exists(self, path: str) -> bool:
        storage, real, _ = self.resolve(path)
        return storage.exists(real)

    def is_dir(self, path: str) -> bool:
        storage, real, _ = self.resolve(path)
        return storage.is_dir(real)

    def listdir(self, path: str) -> list[str]:
        storage, real, _ = self.resolve(path)
        return storage.listdir(real)

    def size(self, path: str) -> int:
        storage, real, _ = self.resolve(path)
        return storage.size(real)

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    def open_read(self, path: str) -> io.BufferedIOBase:
        storage, real, local = self.resolve(path)
        self.opened["local" if local else "remote"] += 1
        return storage.open_read(real)

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        raise StorageError(f"{path}: a node view is read-only")
        yield  # pragma: no cover

    def write_atomic(self, path: str, data: bytes) -> None:
        raise StorageError(f"{path}: a node view is read-only")

    def write_new(self, path: str, data: bytes) -> None:
        raise StorageError(f"{path}: a node view is read-only")

    def makedirs(self, path: str) -> None:
        raise StorageError(f"{path}: a node view is read-only")

    def remove(self, path: str) -> None:
        raise StorageError(f"{path}: a node view is read-only")

    def publish_dir(self, tmp: str, final: str) -> None:
        raise StorageError(f"{final}: a node view is read-only")

    def free_bytes(self, path: str) -> int | None:
        return None

    def close(self) -> None:
        """Forget the view (its URL stops resolving)."""
        _VIEWS.pop(self.token, None)


def open_view(node: NodeLocal, remote: Storage, remote_dir: str, meta: CheckpointMetadata, verify: bool) -> NodeView:
    """Collective: the view of ``remote_dir`` for this rank, with this node's usable local files.

    With ``verify`` the node's ranks checksum its local files (each a share) and a
    file that fails on any rank is read from the object store instead.
    """
    name = posixpath.basename(remote_dir.rstrip("/"))
    local_dir = node.storage.join(node.root, name)
    candidates = sorted(_candidates(node, local_dir, meta))
    share = candidates[node.ranks.index(node.rank) :: len(node.ranks)] if verify else []
    bad = [n for n in share if checksum_file(node.storage, node.storage.join(local_dir, n)) != meta.files[n].xxh3_64]
    rejected = {n for part in comm.all_gather((node.leader, bad)) if part[0] == node.leader for n in part[1]}
    for n in sorted(rejected):
        log.warning("local copy of %s/%s fails its checksum; reading it from %s", local_dir, n, remote_dir)
    view = NodeView(node.storage, local_dir, remote, remote_dir, frozenset(set(candidates) - rejected))
    _VIEWS[view.token] = view
    _register_protocol()
    log.info("%s: %d of %d files from the local copy %s", remote_dir, len(view.local_files), len(meta.files), local_dir)
    return view


def _candidates(node: NodeLocal, local_dir: str, meta: CheckpointMetadata) -> set[str]:
    """Files of this node's committed copy that match the remote marker's records and sizes."""
    marker = read_node_marker(node.storage, local_dir)
    if marker is None:
        return set()
    usable = set()
    for name, record in marker.files.items():
        if meta.files.get(name) != record:
            continue
        path = node.storage.join(local_dir, name)
        if node.storage.exists(path) and node.storage.size(path) == record.size:
            usable.add(name)
    return usable


def _register_protocol() -> None:
    if PROTOCOL not in fsspec.registry:
        fsspec.register_implementation(PROTOCOL, _NodeViewFileSystem, clobber=True)


def _view_of(path: str) -> NodeView:
    token = path.removeprefix(f"{PROTOCOL}://").split("/", 1)[0]
    view = _VIEWS.get(token)
    if view is None:
        raise StorageError(f"{path}: no such node view in this process (it was closed)")
    return view


class _NodeViewFileSystem(AbstractFileSystem):
    """fsspec filesystem over :class:`NodeView` URLs, so DCP's ``FsspecReader`` reads through the view."""

    protocol = PROTOCOL
    cachable = False

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path)
        return text if text.startswith(f"{PROTOCOL}://") else f"{PROTOCOL}://{text}"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> io.BufferedIOBase:
        if "r" not in mode:
            raise StorageError(f"{path}: a node view is read-only")
        return _view_of(path).open_read(path)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return _view_of(path).exists(path)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        view = _view_of(path)
        if view.is_dir(path):
            return {"name": path, "size": 0, "type": "directory"}
        return {"name": path, "size": view.size(path), "type": "file"}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        names = [posixpath.join(path, n) for n in _view_of(path).listdir(path)]
        return [self.info(n) for n in names] if detail else names
