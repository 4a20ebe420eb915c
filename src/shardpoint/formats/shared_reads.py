"""Replicas read their share and pass it on: each stored byte is read once per load, not once per replica.

Data-parallel replicas load identical tensors. Read independently, a restart at dp=64
reads the checkpoint 64 times from S3 or the parallel filesystem (Megatron-LM's
``--ckpt-fully-parallel-load`` and PyTorch's cooperative load planner exist for this).

Ranks whose targets are identical (same keys, boxes, shapes and dtypes: a *replica
group*, found from one signature per rank in the load's planning round) split the
reading instead:

1. :func:`assign` gives every target key to one member, deterministically from what
   every member already knows (the checkpoint's metadata and the shared targets), so no
   message is needed. Keys go with their file: the files are dealt out biggest first to
   the member with the fewest bytes so far, and a key to the member holding the file
   with most of its bytes. A member therefore reads whole files, hashing each as it
   streams (damage is still named by file), and the members read about equal shares.
2. each member reads only its keys (DCP's reader on that subset);
3. after every member's reads succeeded (agreed), :func:`exchange` sends each key's
   tensor from its reader to the other members, point to point on the control group,
   straight from and into the target tensors: no buffer beyond one host copy of a
   device tensor at a time.

A rank alone in its group (tensor- or pipeline-parallel peers, a resharded load with
no identical peer) reads as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from shardpoint.parallel import comm
from shardpoint.state.sharding import Shard

__all__ = ["assign", "exchange", "replica_group", "signature"]


def signature(targets: Mapping[str, Shard]) -> str:
    """A digest of what a rank reads: every target's key, box, shape and dtype."""
    digest = xxhash.xxh3_128()
    for key in sorted(targets):
        shard = targets[key]
        digest.update(repr((key, shard.global_offset, tuple(shard.tensor.shape), str(shard.tensor.dtype))).encode())
    return digest.hexdigest()


def replica_group(signatures: Sequence[str], rank: int) -> list[int]:
    """The ranks (sorted) whose targets are identical to ``rank``'s."""
    return [r for r, s in enumerate(signatures) if s == signatures[rank]]


def assign(key_files: Mapping[str, Mapping[str, int]], members: Sequence[int]) -> dict[str, int]:
    """Which member reads each key; ``key_files[key]`` is ``{file: bytes of the key in it}``.

    Every member computes the same answer from the same inputs.
    """
    file_bytes: dict[str, int] = {}
    for files in key_files.values():
        for name, size in files.items():
            file_bytes[name] = file_bytes.get(name, 0) + size
    load = dict.fromkeys(members, 0)
    reader_of_file: dict[str, int] = {}
    for name in sorted(file_bytes, key=lambda n: (-file_bytes[n], n)):
        member = min(members, key=lambda m: (load[m], m))
        reader_of_file[name] = member
        load[member] += file_bytes[name]
    owners = {}
    for key, files in key_files.items():
        biggest = max(sorted(files), key=lambda n: files[n]) if files else None
        owners[key] = reader_of_file[biggest] if biggest is not None else members[0]
    return owners


def exchange(targets: Mapping[str, Shard], owners: Mapping[str, int], members: Sequence[int]) -> None:
    """Send each key this rank read to the other members; receive the rest into this rank's targets.

    Point-to-point over the control group, one batch: every member posts its sends and
    receives for all keys (in the same sorted order), then waits for all of them.
    """
    me = comm.rank()
    group = comm.control_group()
    ops, landing = [], []
    for key in sorted(targets):
        tensor = targets[key].tensor.detach()
        if tensor.numel() == 0:
            continue
        owner = owners[key]
        if owner == me:
            payload = _sendable(tensor)
            ops += [dist.P2POp(dist.isend, payload, peer, group) for peer in members if peer != me]
        else:
            buffer = _sendable(tensor) if tensor.device.type != "cpu" or not tensor.is_contiguous() else tensor
            ops.append(dist.P2POp(dist.irecv, buffer, owner, group))
            if buffer is not tensor:
                landing.append((tensor, buffer))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    with torch.no_grad():
        for tensor, buffer in landing:
            tensor.copy_(buffer)


def _sendable(tensor: torch.Tensor) -> Any:
    """A contiguous CPU tensor with ``tensor``'s values (the control group is gloo)."""
    return tensor.detach().to("cpu").contiguous()
