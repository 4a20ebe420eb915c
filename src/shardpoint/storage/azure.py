"""Azure Blob Storage (``az://container/prefix``, also ``abfs://``) through ``adlfs``.

Credentials come from Azure's usual sources: ``AZURE_STORAGE_CONNECTION_STRING``, or
``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_SAS_TOKEN``,
or ``DefaultAzureCredential`` (managed identity, ``az login``, ``AZURE_CLIENT_*``) when only
the account name is set. A connection string's ``BlobEndpoint`` points at an emulator
(Azurite).

The Azure SDK retries each request itself (exponential, on 408/429/5xx and connection
errors) inside the bounded, logged retries of
:class:`~shardpoint.storage.object_store.ObjectStorage`.
"""

from __future__ import annotations

import os
from typing import Any

from shardpoint.errors import StorageError
from shardpoint.storage.object_store import WRITE_BLOCK, error_module_is, transient_default

__all__ = ["SETTINGS_HINT", "filesystem", "is_client_error", "is_transient"]

SETTINGS_HINT = (
    "check the account and credentials (AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
    "a key, SAS token or az login) and that the container exists"
)
_CLIENTS = ("adlfs", "azure", "aiohttp")


def filesystem(block_size: int = WRITE_BLOCK) -> Any:
    """A fresh adlfs filesystem: no listing cache, ``block_size`` blocks and read-ahead."""
    try:
        from adlfs import AzureBlobFileSystem
    except ImportError:
        raise StorageError("az:// paths need the adlfs package: pip install 'shardpoint[azure]'") from None
    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False, "blocksize": block_size}
    if not (os.environ.get("AZURE_STORAGE_CONNECTION_STRING") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")):
        raise StorageError(
            "az:// paths need an Azure Storage account: set AZURE_STORAGE_CONNECTION_STRING, or "
            "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or az login"
        )
    if os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") and not (
        os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
        or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
        or os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    ):
        options["anon"] = False  # DefaultAzureCredential
    return AzureBlobFileSystem(**options)


def is_client_error(exc: BaseException) -> bool:
    return error_module_is(exc, _CLIENTS)


def is_transient(exc: BaseException) -> bool:
    """Connection trouble, timeouts, 408/429/5xx (``status_code`` of the SDK's errors); never a refusal."""
    code = getattr(exc, "status_code", None)
    if isinstance(code, int) and (code in (408, 429) or code >= 500):
        return True
    return transient_default(exc)
