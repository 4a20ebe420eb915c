"""S3-compatible object storage (AWS S3, MinIO, Ceph, GCS's S3 API) through ``s3fs``.

Credentials and endpoint come from the standard AWS environment and config
(``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...), nothing new. botocore retries each request
(``standard`` mode) inside the bounded, logged retries of
:class:`~shardpoint.storage.object_store.ObjectStorage`.
"""

from __future__ import annotations

import os
from typing import Any

from shardpoint.errors import StorageError
from shardpoint.storage.object_store import WRITE_BLOCK, error_module_is, transient_default

__all__ = ["SETTINGS_HINT", "filesystem", "is_client_error", "is_transient", "s3_filesystem", "s3_options"]

SETTINGS_HINT = "check the endpoint (AWS_ENDPOINT_URL), credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and bucket"
_CLIENTS = ("botocore", "aiobotocore", "aiohttp", "s3fs")


def s3_options(block_size: int = WRITE_BLOCK) -> dict[str, Any]:
    """s3fs constructor options: retries, timeouts, no listing caches (other ranks change the store).

    ``SHARDPOINT_S3_TIMEOUT`` (seconds, default 60) bounds each request and
    ``SHARDPOINT_S3_RETRIES`` (default 6) counts botocore's attempts, with exponential backoff.
    ``block_size`` is the multipart part size for writers and the read-ahead for readers.
    """
    timeout = float(os.environ.get("SHARDPOINT_S3_TIMEOUT", "60"))
    attempts = int(os.environ.get("SHARDPOINT_S3_RETRIES", "6"))
    return {
        "skip_instance_cache": True,
        "use_listings_cache": False,
        "default_block_size": block_size,
        "config_kwargs": {
            "retries": {"max_attempts": attempts, "mode": "standard"},
            "connect_timeout": min(timeout, 10),
            "read_timeout": timeout,
        },
    }


def filesystem(block_size: int = WRITE_BLOCK) -> Any:
    """A fresh s3fs filesystem with :func:`s3_options`."""
    try:
        import s3fs
    except ImportError:
        raise StorageError("s3:// paths need the s3fs package: pip install 'shardpoint[s3]'") from None
    options = s3_options(block_size)
    fs = s3fs.S3FileSystem(**options)
    fs.retries = options["config_kwargs"]["retries"]["max_attempts"]  # s3fs's own retry loop, on top of botocore
    return fs


s3_filesystem = filesystem


def is_client_error(exc: BaseException) -> bool:
    return error_module_is(exc, _CLIENTS)


def is_transient(exc: BaseException) -> bool:
    """Connection trouble, timeouts, throttling and 5xx; never a missing object, a refusal or bad credentials."""
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) if hasattr(exc, "response") else ""
    if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError", "503", "500"):
        return True
    return transient_default(exc)
