"""What the Hugging Face integrations share: Accelerate's objects as shardpoint sees them.

The ``Trainer`` runs on an ``accelerate.Accelerator``, so both integrations meet the same
wrappers (``AcceleratedOptimizer``), the same device meshes, and the same question of
whether a ``checkpoint-N`` / ``checkpoint_N`` directory is one of ours. Nothing here
imports a framework: the objects are used through the attributes they have.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from shardpoint.catalog.integrity import verify_files
from shardpoint.catalog.layout import Layout
from shardpoint.catalog.metadata import MARKER_NAME
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.lifecycle.commit import read_marker
from shardpoint.parallel.topology import Topology
from shardpoint.storage.base import open_storage
from shardpoint.storage.fsspec_store import is_fsspec_url
from shardpoint.storage.object_store import is_object_url

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "FIXED_OPTIONS",
    "StateGroup",
    "accelerator_topology",
    "checked_options",
    "is_shardpoint_checkpoint",
    "locate",
    "unwrap_optimizer",
    "verify_recorded",
]

# Checkpointer arguments an integration decides itself: the framework names the
# directories and decides when to save
FIXED_OPTIONS = ("layout", "save_interval", "save_interval_minutes")


def checked_options(options: Mapping[str, Any] | None, owner: str) -> dict[str, Any]:
    """``checkpointer_options`` as a dict, refusing the arguments the framework decides.

    Raises:
        ValueError: an option in :data:`FIXED_OPTIONS` was given; the message says what decides it instead.
    """
    options = dict(options or {})
    fixed = sorted(set(options) & set(FIXED_OPTIONS))
    if fixed:
        raise ValueError(
            f"{owner}: checkpointer_options may not set {fixed}: the framework names the checkpoint "
            "directories and decides when to save (its own save_steps / when you call save_state)"
        )
    return options


def unwrap_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside Accelerate's ``AcceleratedOptimizer`` (or the optimizer itself).

    The wrapper's ``step`` adds gradient-accumulation and scaler logic; shardpoint reads
    and fills the state of the optimizer that owns it.
    """
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "param_groups") else optimizer


def accelerator_topology(accelerator: Any) -> Topology:
    """The layout of an Accelerate job: its device mesh when it built one, else data parallel over all processes.

    Accelerate builds a mesh for FSDP2 and tensor parallelism (``ParallelismConfig``);
    DDP and single-process jobs have none.
    """
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is not None:
        return Topology.from_mesh(mesh)
    return Topology(1, 1, accelerator.num_processes)


def is_shardpoint_checkpoint(path: str | os.PathLike[str] | None) -> TypeIs[str | os.PathLike[str]]:
    """Whether ``path`` (local, an object store or other fsspec URL) is a committed shardpoint checkpoint (marker)."""
    if path is None:
        return False
    text = os.fspath(path)
    if "://" in text:
        served = is_object_url(text) or is_fsspec_url(text)
        return served and open_storage(text).exists(text.rstrip("/") + "/" + MARKER_NAME)
    return os.path.isfile(os.path.join(text, MARKER_NAME))


def locate(path: str | os.PathLike[str], layout: Layout) -> tuple[str, int]:
    """``(save directory, iteration)`` of a checkpoint directory named as ``layout`` names them.

    Raises:
        CheckpointError: the name is not one ``layout`` gives (e.g. a renamed directory).
    """
    path = os.path.abspath(os.fspath(path))
    iteration = layout.parse_dir_name(os.path.basename(path))
    if iteration is None:
        example = layout.dir_name(100)
        raise CheckpointError(
            f"{path} holds a shardpoint checkpoint but is not named like one ({example}); "
            "give its original name back, or pass its save directory"
        )
    return os.path.dirname(path), iteration


def verify_recorded(directory: str, names: Iterable[str]) -> None:
    """Check size and checksum of the files ``names`` of a committed checkpoint, where its marker lists them.

    For files a framework reads itself before shardpoint's load runs (``trainer_state.json``):
    a flipped byte in JSON can still parse, into a wrong step.

    Raises:
        CorruptCheckpointError: naming each damaged file.
    """
    storage = open_storage(directory)
    meta = read_marker(storage, directory)
    problems = verify_files(storage, directory, meta, [n for n in names if n in meta.files])
    if problems:
        raise CorruptCheckpointError(
            f"checkpoint {directory} is damaged: " + "; ".join(map(str, problems)) + ". Resume from an earlier "
            "checkpoint (pass its directory), or run `shardpoint verify` on the save directory for a report"
        )


class StateGroup:
    """Several objects with ``state_dict``/``load_state_dict`` saved as one, under their names.

    Loading requires the same names: objects registered in another number or order would
    otherwise receive each other's state.
    """

    def __init__(self, objects: Mapping[str, Any], what: str):
        self.objects = dict(objects)
        self.what = what

    def __bool__(self) -> bool:
        return bool(self.objects)

    def state_dict(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.objects.items()}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        if set(saved) != set(self.objects):
            raise CheckpointError(
                f"the checkpoint holds {self.what} {sorted(saved)}, this job has {sorted(self.objects)}; "
                "prepare and register the same objects in the same order as the run that saved it"
            )
        for name, obj in self.objects.items():
            obj.load_state_dict(saved[name])
