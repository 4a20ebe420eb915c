"""Google Cloud Storage (``gs://bucket/prefix``) through ``gcsfs``.

Credentials come from Google's usual sources (``GOOGLE_APPLICATION_CREDENTIALS``, the
gcloud configuration, the metadata server); ``GOOGLE_CLOUD_PROJECT`` names the project.
``STORAGE_EMULATOR_HOST`` points the client at an emulator (anonymous unless credentials
are set). The plain ``gcsfs.core.GCSFileSystem`` is used, not the zonal/HNS extension
that newer gcsfs installs by default: that one opens gRPC channels (Storage Control) for
every bucket, which emulators do not serve, and shardpoint needs none of it.

gcsfs retries each request itself (429, 5xx, connection errors, with backoff) inside the
bounded, logged retries of :class:`~shardpoint.storage.object_store.ObjectStorage`.
"""

from __future__ import annotations

import os
from typing import Any

from shardpoint.errors import StorageError
from shardpoint.storage.object_store import WRITE_BLOCK, error_module_is, transient_default

__all__ = ["SETTINGS_HINT", "filesystem", "is_client_error", "is_transient"]

SETTINGS_HINT = (
    "check the credentials (GOOGLE_APPLICATION_CREDENTIALS or gcloud auth), the project (GOOGLE_CLOUD_PROJECT), "
    "the bucket, and STORAGE_EMULATOR_HOST for an emulator"
)
_CLIENTS = ("gcsfs", "google", "aiohttp")


def filesystem(block_size: int = WRITE_BLOCK) -> Any:
    """A fresh gcsfs filesystem: no listing cache, ``block_size`` parts and read-ahead."""
    try:
        from gcsfs.core import GCSFileSystem
    except ImportError:
        raise StorageError("gs:// paths need the gcsfs package: pip install 'shardpoint[gcs]'") from None
    emulated = bool(os.environ.get("STORAGE_EMULATOR_HOST")) and not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    token = os.environ.get("SHARDPOINT_GCS_TOKEN") or ("anon" if emulated else None)
    timeout = float(os.environ.get("SHARDPOINT_GCS_TIMEOUT", "60"))
    return GCSFileSystem(
        token=token,
        project=os.environ.get("GOOGLE_CLOUD_PROJECT", ""),
        skip_instance_cache=True,
        use_listings_cache=False,
        block_size=block_size,
        requests_timeout=timeout,
    )


def is_client_error(exc: BaseException) -> bool:
    return error_module_is(exc, _CLIENTS)


def is_transient(exc: BaseException) -> bool:
    """Connection trouble, timeouts, 429 and 5xx (gcsfs's ``HttpError.code``); never a 4xx refusal."""
    code = getattr(exc, "code", None)
    if isinstance(code, int) and (code == 429 or code >= 500):
        return True
    return transient_default(exc)
