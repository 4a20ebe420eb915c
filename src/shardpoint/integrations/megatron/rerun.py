"""Megatron's rerun state machine (``megatron.core.rerun_state_machine``), saved and restored as Megatron does.

What megatron-core 0.16.1's ``save_checkpoint`` stores: ``state_dict(data_iterator,
ckpt_format)``, which is None unless the machine is in the middle of a rerun (its
state is not ``NOT_RUNNING_YET``: a result failed validation and the step is to be
rerun from this checkpoint, possibly on another node). So nothing is saved in the
default ``--rerun-mode disabled``, nor in the other modes while no rerun is pending.
Megatron keeps it per rank (a ``ShardedObject`` keyed by rank and world size) and
restores it only at the same world size, tp, pp and dp, never in a finetune or from a
release checkpoint, and then only when the saved state is not ``NOT_RUNNING_YET``;
the machine itself ignores it when this run's mode is ``disabled``.

Here each rank's state is one entry of the objects table (:mod:`.objects`), under a
key naming its rank and layout (:func:`rerun_key`), so a load at another layout finds
none, as Megatron's. Its enums (``RerunMode``, ``RerunState``, ``RerunDiagnostic``) and
named tuples (``Call``, ``Caller``) are written as plain values and rebuilt from a fixed
list of Megatron's classes: the table is unpickled weights-only, and nothing in it
names a class to build.
"""

from __future__ import annotations

import io
import logging
from enum import Enum
from typing import Any

import torch

from shardpoint.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["RERUN_PREFIX", "plain", "rebuilt", "rerun_key", "rerun_state", "restore_rerun_state"]

log = logging.getLogger(__name__)

RERUN_PREFIX = "rerun_state_machine"
_ENUM = "__megatron_enum__"
_CALL = "__megatron_call__"


def rerun_key() -> str:
    """This rank's entry: its rank, the world size and the tp/pp/dp sizes (Megatron restores only at the same)."""
    from megatron.core import parallel_state as ps

    sizes = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
    )
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return f"{RERUN_PREFIX}/rank_{rank}_of_{world}/tp{sizes[0]}_pp{sizes[1]}_dp{sizes[2]}"


def rerun_state(data_iterator: Any) -> dict[str, bytes]:
    """``{rerun_key(): bytes}`` when the machine has a rerun pending (Megatron saves it then), else ``{}``."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    # "torch_dist": shardpoint stores ShardedObjects, the format Megatron saves this state in
    saved = get_rerun_state_machine().state_dict(data_iterator=data_iterator, ckpt_format="torch_dist")
    if saved is None:
        return {}
    saved = dict(saved, sharded=saved["sharded"].data)  # the ShardedObject's payload: this rank's own
    buffer = io.BytesIO()
    torch.save(plain(saved), buffer)
    return {rerun_key(): buffer.getvalue()}


def restore_rerun_state(saved: dict[str, Any] | None, where: str) -> bool:
    """Give the machine this rank's saved state when Megatron would; True when it was handed over.

    ``saved``: the checkpoint's objects table (:func:`.objects.saved_objects`), or None.
    The caller skips finetunes and release checkpoints, as Megatron does.
    """
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    value = (saved or {}).get(rerun_key())
    if value is None:
        return False
    machine = get_rerun_state_machine()
    state = rebuilt(value)
    if not machine.validate_state_dict(state):
        return False
    machine.load_state_dict(state)  # ignored by the machine itself in --rerun-mode disabled
    log.info("megatron: rerun state machine restored from %s (iteration %s)", where, state.get("current_iteration"))
    return True


def _class(name: Any) -> Any:
    """One of the only classes a saved rerun state may rebuild, by name.

    Raises:
        UnsafeCheckpointError: any other name.
    """
    from megatron.core import rerun_state_machine as rsm

    allowed = {c.__name__: c for c in (rsm.RerunMode, rsm.RerunState, rsm.RerunDiagnostic, rsm.Call, rsm.Caller)}
    if name not in allowed:
        raise UnsafeCheckpointError(
            f"the saved rerun state machine names {name!r}, not one of Megatron's {sorted(allowed)}: refused; "
            "load another checkpoint"
        )
    return allowed[name]


def plain(value: Any) -> Any:
    """Enums and named tuples as tagged plain values (weights-only unpickling builds no class)."""
    if isinstance(value, Enum):
        return {_ENUM: type(value).__name__, "name": value.name}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {_CALL: type(value).__name__, "fields": [plain(v) for v in value]}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


def rebuilt(value: Any) -> Any:
    """:func:`plain` undone, with Megatron's classes looked up in :func:`_classes` only."""
    if isinstance(value, dict) and _ENUM in value:
        members = _class(value[_ENUM]).__members__
        if value.get("name") not in members:
            raise CorruptCheckpointError(f"the saved rerun state machine has {value!r}, no member of its enum")
        return members[value["name"]]
    if isinstance(value, dict) and _CALL in value:
        return _class(value[_CALL])(*(rebuilt(v) for v in value["fields"]))
    if isinstance(value, dict):
        return {k: rebuilt(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(rebuilt(v) for v in value)
    return value
