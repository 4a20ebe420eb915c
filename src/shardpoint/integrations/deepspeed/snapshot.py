"""A copy of one of DeepSpeed's state dicts that ``torch.save`` writes to the same bytes as the original.

An async save writes a state dict after training has moved on, so it writes a copy
taken at the save. ``copy.deepcopy`` alone does not do: DeepSpeed's optimizer states
hold tensors that are not graph leaves (views of its flat buffers), which
``Tensor.__deepcopy__`` refuses. :func:`snapshot` copies every tensor itself, each
storage once (two views of one buffer stay two views of one copied buffer, as
``torch.save`` stores them), keeping dtype, offset, size, stride, ``requires_grad``,
the ``Parameter`` type and the tensor's Python attributes; ``deepcopy`` then copies
the containers around them with those copies in its memo.

The copies are on the tensors' own devices (the bytes record the device): on a GPU an
async save holds a second copy of what it saves in GPU memory until it is written.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["snapshot"]


def snapshot(obj: Any) -> Any:
    """A deep copy of ``obj`` whose tensors are copies, storages shared as in ``obj``."""
    memo: dict[int, Any] = {}
    _copy_tensors(obj, memo, {}, set())
    return copy.deepcopy(obj, memo)


def _copy_tensors(obj: Any, memo: dict[int, Any], storages: dict[tuple, Any], seen: set[int]) -> None:
    """Put a copy of every tensor reachable from ``obj`` through containers and attributes into ``memo``."""
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), type)):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        memo[id(obj)] = _copy_tensor(obj, storages)
        return
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = obj
    else:
        items = getattr(obj, "__dict__", {}).values()
    for item in items:
        _copy_tensors(item, memo, storages, seen)


def _copy_tensor(tensor: torch.Tensor, storages: dict[tuple, Any]) -> torch.Tensor:
    storage = tensor.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes(), str(tensor.device))
    copied = storages.get(key) if storage.nbytes() else None  # empty storages share no bytes
    if copied is None:
        copied = storage.clone()
        storages[key] = copied
    with torch.no_grad():
        result = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        result.set_(copied, tensor.storage_offset(), tensor.size(), tensor.stride())
    if isinstance(tensor, torch.nn.Parameter):
        result = torch.nn.Parameter(result, requires_grad=tensor.requires_grad)
    elif tensor.requires_grad:
        result.requires_grad_(True)
    if tensor.__dict__:
        result.__dict__.update(copy.copy(tensor.__dict__))
    return result
