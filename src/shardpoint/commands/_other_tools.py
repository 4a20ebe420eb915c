"""Another tool's checkpoint given to a command that checks shardpoint's own: say what it is and what to run.

``verify``, ``diff`` and ``prune`` work on checkpoints shardpoint wrote (they read
``shardpoint.json``). Given a Megatron-LM, DeepSpeed / GPT-NeoX or Hugging Face
directory they would report every iteration as a partial save; instead they stop with
:class:`~shardpoint.errors.NotACheckpointError` (exit 2) naming the tool and the
commands that do read it (``inspect``, ``convert --from ...``).
"""

from __future__ import annotations

import os

from shardpoint.errors import NotACheckpointError

__all__ = ["refuse_other_tool"]

_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def refuse_other_tool(path: str, command: str) -> None:
    """Raise :class:`NotACheckpointError` when local ``path`` is another tool's checkpoint; else return.

    Remote paths and anything unrecognised pass through, so shardpoint's own readers
    decide (and explain) as before.
    """
    if "://" in path or not os.path.isdir(path):
        return
    if os.path.isfile(os.path.join(path, "config.json")) and any(
        os.path.exists(os.path.join(path, name)) for name in _HF_WEIGHTS
    ):
        raise NotACheckpointError(
            f"{path} is a Hugging Face model directory, not a checkpoint shardpoint wrote, so `shardpoint {command}` "
            f"has nothing of its own to check there; import it with `shardpoint convert --from hf {path} DST`"
        )
    from shardpoint.foreign import detect, find_foreign  # torch and the foreign readers: only when asked

    directory = find_foreign(path)
    if directory is None:
        return
    kind = detect(directory, strict=False) or "unknown"
    tool = "deepspeed" if kind == "deepspeed" else "megatron"
    name = "DeepSpeed / GPT-NeoX" if tool == "deepspeed" else "Megatron-LM"
    raise NotACheckpointError(
        f"{path} is a {name} checkpoint ({kind}), not one shardpoint wrote, so `shardpoint {command}` has nothing "
        f"of its own to check there: `shardpoint inspect {path}` reads it, and "
        f"`shardpoint convert --from {tool} {path} DST` imports it as a shardpoint checkpoint"
    )
