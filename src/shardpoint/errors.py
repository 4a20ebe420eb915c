"""The exceptions shardpoint raises.

Every error a user can cause (a wrong path, a damaged file, a mismatched config or
layout) is a :class:`CheckpointError` subclass whose message names what is wrong,
where, and how to fix it. Library code never calls ``sys.exit`` and never uses
``assert`` for user errors, so training code can catch these and decide.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "ConcurrentSaveError",
    "ConfigMismatchError",
    "CorruptCheckpointError",
    "FrameworkMissingError",
    "MissingKeysError",
    "NotACheckpointError",
    "ShapeMismatchError",
    "ShardingError",
    "StorageError",
    "TopologyMismatchError",
    "UnsafeCheckpointError",
    "ValidationError",
]


class CheckpointError(Exception):
    """Base class of every error shardpoint raises on purpose."""


class ConfigMismatchError(CheckpointError):
    """The model config saved in the checkpoint differs from the current one."""

    def __init__(self, path: str, differences: dict[str, tuple[object, object]]):
        self.path = path
        self.differences = differences
        lines = [
            f"  {key}: saved={saved!r} current={current!r}" for key, (saved, current) in sorted(differences.items())
        ]
        super().__init__(
            f"config of checkpoint {path} differs from the current config:\n"
            + "\n".join(lines)
            + "\nFix the model arguments, or pass allow_config_mismatch=[...] naming keys that may differ."
        )


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated, or fails its checksum."""


class TopologyMismatchError(CheckpointError):
    """The checkpoint cannot be loaded at the current parallel layout."""


class MissingKeysError(CheckpointError):
    """``strict`` loading found keys missing from the checkpoint or unexpected in it."""

    def __init__(self, path: str, missing: list[str], unexpected: list[str]):
        self.path = path
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        parts = [f"checkpoint {path} does not match the state being loaded:"]
        if self.missing:
            parts.append(f"  missing from the checkpoint ({len(self.missing)}): {_preview(self.missing)}")
        if self.unexpected:
            parts.append(
                f"  in the checkpoint but not in the model ({len(self.unexpected)}): {_preview(self.unexpected)}"
            )
        parts.append("Pass strict=False to load the keys that match and skip the rest.")
        super().__init__("\n".join(parts))


class ReplicaMismatchError(CheckpointError):
    """Ranks that should hold the same value of a tensor hold different ones; the save stopped."""

    def __init__(self, disagreements: dict[str, list[list[int]]]):
        self.disagreements = disagreements
        lines = [
            f"  {key!r}: " + "; ".join(f"ranks {ranks} hold one value" for ranks in groups)
            for key, groups in sorted(disagreements.items())
        ]
        super().__init__(
            f"{len(disagreements)} tensor(s) declared replicated differ between the ranks holding them:\n"
            + "\n".join(lines[:8])
            + ("\n  ..." if len(lines) > 8 else "")
            + "\nNothing was saved and the tracker still names the previous checkpoint. Replicas that drifted "
            "apart mean the ranks trained different models (are gradients all-reduced over data parallel?); a "
            "tensor that is meant to differ by rank must not be declared replicated: describe its box with "
            "sp.Shard, or wrap it in sp.RankLocal to store it per rank."
        )


class ShapeMismatchError(CheckpointError):
    """A stored tensor's shape differs from the model's tensor of the same name."""


class StorageError(CheckpointError):
    """Reading or writing the storage failed (disk full, permission denied, ...)."""


class ConcurrentSaveError(CheckpointError):
    """Another writer committed the same checkpoint first (object storage); this save committed nothing.

    The other writer's checkpoint is left as it is: two jobs are saving into one directory.
    """


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to run code or build objects that loading never allows."""


class ValidationError(CheckpointError):
    """Forward-pass validation after load found logits differing from the saved ones."""


class ShardingError(CheckpointError):
    """The boxes the ranks declare for a tensor leave a hole in it or cover part of it twice; the save stopped."""

    def __init__(self, problems: dict[str, str]):
        self.problems = problems
        lines = [f"  {key!r}: {why}" for key, why in sorted(problems.items())]
        super().__init__(
            f"the boxes declared for {len(problems)} tensor(s) do not cover each exactly once:\n"
            + "\n".join(lines[:8])
            + ("\n  ..." if len(lines) > 8 else "")
            + "\nNothing was saved and the tracker still names the previous checkpoint. Each part of a tensor "
            "must be declared by one rank with replica_id 0 (copies of that box may use other replica ids): "
            "check the global_offset of every sp.Shard (each tensor-parallel or expert-parallel rank its own "
            "part) and that every part is declared by some rank."
        )


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path a framework was given does not exist.

    Also a ``FileNotFoundError``: that is what Lightning raises for a missing
    ``ckpt_path``, and what users' code catches.
    """


class FrameworkMissingError(CheckpointError, ModuleNotFoundError):
    """An integration was imported without its framework; the message names the extra that installs it.

    Also a ``ModuleNotFoundError`` (what code that probes for optional imports catches).
    """


class NotACheckpointError(CheckpointError):
    """The path given holds no checkpoint: it does not exist, is a file, or holds nothing shardpoint wrote.

    Raised by the offline readers and the CLI (which exits 2 for it, as for a usage error:
    nothing is damaged, the path is wrong). The message names the path and what it is;
    another tool's checkpoint is named with the command that reads or imports it.
    """


class CheckpointTimeoutError(CheckpointError):
    """A collective round passed its deadline (``Checkpointer(round_timeout=...)``): some ranks never arrived.

    Raised on every rank that did arrive; ``missing`` names the ranks that did not (a
    rank stopped, stuck in I/O or paused by a debugger), ``round`` what the round was for.
    """

    def __init__(self, message: str, missing: list[int] | None = None, round: str = ""):
        super().__init__(message)
        self.missing = list(missing or [])
        self.round = round


def _preview(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... (+{len(keys) - limit} more)" if len(keys) > limit else "")
