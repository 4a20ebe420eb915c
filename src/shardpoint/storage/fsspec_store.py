"""Any other fsspec filesystem (``memory://``, ``hdfs://``, ``hf://``, ...) as shardpoint storage.

Lightning, and users' scripts, take any fsspec URL. :class:`~shardpoint.storage.object_store.ObjectStorage`
serves them the way it serves an object store: data written in place under the
checkpoint's prefix, then ``shardpoint.json`` with the filesystem's create-only write
(``pipe_file(mode="create")``), then the tracker; a prefix without a marker is never
loaded. What such a filesystem cannot promise is said once per scheme, as a warning
naming the guarantee (:func:`warn_once`): fsspec's generic create-only write checks and
then writes (two writers of one prefix could both commit) unless the filesystem
implements its own, and fsspec does not say whether a finished write is durable
(``memory://`` is gone with the process). The dedicated backends for ``s3://``, ``gs://``
and ``az://`` keep their conditional writes and retries.

This module is the "store" :func:`~shardpoint.storage.object_store.store_of` returns for
such a URL: the same four names as :mod:`~shardpoint.storage.s3`, bound to one URL.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from shardpoint.errors import StorageError
from shardpoint.storage.object_store import WRITE_BLOCK, error_module_is, transient_default

__all__ = ["FsspecStore", "is_fsspec_url", "warn_once"]

log = logging.getLogger(__name__)

_WARNED: set[str] = set()


def is_fsspec_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL whose scheme fsspec knows (other than ``file://``)."""
    text = os.fspath(path)
    if "://" not in text:
        return False
    import fsspec

    scheme = text.split("://", 1)[0].lower()
    return scheme != "file" and (scheme in fsspec.registry or scheme in fsspec.available_protocols())


class FsspecStore:
    """The store of one generic fsspec URL: its filesystem, error classes and settings hint."""

    def __init__(self, url: str):
        self.url = url
        self.scheme = url.split("://", 1)[0].lower()
        self.SETTINGS_HINT = (
            f"check the {self.scheme}:// URL and the options fsspec reads for it (its environment variables "
            "or configuration)"
        )

    def filesystem(self, block_size: int = WRITE_BLOCK) -> Any:
        """fsspec's filesystem for the URL, fresh (not fsspec's cached instance: other ranks change the store)."""
        import fsspec

        try:
            cls = fsspec.get_filesystem_class(self.scheme)
            options = cls._get_kwargs_from_urls(self.url)
        except (ImportError, ValueError) as exc:
            raise StorageError(f"{self.url}: fsspec cannot open {self.scheme}:// here ({exc})") from exc
        try:
            return cls(skip_instance_cache=True, **options)
        except TypeError:  # a filesystem that takes no such option
            return cls(**options)

    def is_client_error(self, exc: BaseException) -> bool:
        return error_module_is(exc, ("fsspec",))

    def is_transient(self, exc: BaseException) -> bool:
        return transient_default(exc)


def warn_once(url: str, fs: Any) -> None:
    """Warn, once per scheme and process, of the commit guarantees ``fs`` cannot give (see the module docstring)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in _WARNED:
        return
    _WARNED.add(scheme)
    from fsspec.spec import AbstractFileSystem

    generic_create = type(fs).pipe_file is AbstractFileSystem.pipe_file
    exclusive = (
        f"its create-only write is fsspec's check-then-write ({type(fs).__name__} has none of its own), so two "
        "writers of one checkpoint directory could both commit"
        if generic_create
        else f"whether {type(fs).__name__}'s create-only write is atomic is the filesystem's own affair"
    )
    log.warning(
        "%s: shardpoint serves %s:// through fsspec's generic interface: the marker is written last and the tracker "
        "after it, but %s, and fsspec does not say whether a finished write is durable%s; for those guarantees use "
        "a local path or s3://, gs://, az://",
        url,
        scheme,
        exclusive,
        " (memory:// lasts as long as this process)" if scheme == "memory" else "",
    )
