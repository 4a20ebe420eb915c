"""DCP's errors as shardpoint's: the first failing rank's own error, or a damaged file named on load.

DCP raises ``CheckpointException`` (a BaseException carrying every rank's traceback) on
every rank; unwrapping it in one place keeps ranks in step and lets the Checkpointer tell
a full disk from a bug, for the dist format and for the offline readers alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.distributed.checkpoint.api import CheckpointException

from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.parallel import comm

__all__ = ["dcp_errors"]


@contextmanager
def dcp_errors(directory: str, loading: bool = False) -> Iterator[None]:
    """Unwrap DCP's CheckpointException (a BaseException carrying every rank's traceback).

    DCP raises it on every rank, so re-raising here keeps all ranks in step. The first
    failing rank's own exception is re-raised, so the Checkpointer can tell a full
    disk from a bug; on load, errors that are not ours become a CorruptCheckpointError
    naming the directory.
    """
    try:
        yield
    except CheckpointException as exc:
        failures = sorted(exc.failures.items(), key=lambda item: item[0])
        first_rank, (error, _) = failures[0]
        _reraise(error, directory, loading, first_rank)
    except Exception as exc:  # noqa: BLE001 - single-rank DCP calls (no_dist) raise the error itself
        _reraise(exc, directory, loading, comm.rank())


def _reraise(error: BaseException, directory: str, loading: bool, rank: int) -> None:
    if not loading or isinstance(error, (CheckpointError, OSError)):
        raise error from None
    raise CorruptCheckpointError(
        f"cannot read {directory} (rank {rank}: {type(error).__name__}: {error}); a file is damaged"
    ) from None
