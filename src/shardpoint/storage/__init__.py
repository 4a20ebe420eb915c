"""Layer 1, storage: where the bytes live, and nothing about what they mean.

:mod:`~shardpoint.storage.base` is the small storage interface with local files,
:mod:`~shardpoint.storage.object_store` object storage over fsspec, with one small module
per cloud (:mod:`~shardpoint.storage.s3`, :mod:`~shardpoint.storage.gcs`, :mod:`~shardpoint.storage.azure`),
:mod:`~shardpoint.storage.safe_io` reading pickles without running code from them, and
:mod:`~shardpoint.storage.lock` the save directory's writer lock.

May import: :mod:`shardpoint.errors` only. Anything that knows a checkpoint's layout
or marker (upload, node-local copies) belongs to :mod:`shardpoint.lifecycle`.
"""
