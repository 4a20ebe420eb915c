"""The accelerator devices a rank's tensors live on, kept generic (CUDA, or none on CPU).

Two NCCL-era rules live here:

- a snapshot is complete only when *every* device its tensors came from is
  synchronised: ``torch.cuda.synchronize()`` waits for the current device only, so a
  tensor on another device could still be copying while the background thread
  hashes and writes it (a torn checkpoint with valid checksums);
- new threads do not inherit ``torch.cuda.set_device``: a background thread that
  touches CUDA without it works on ``cuda:0``, syncing that GPU's stream and creating a
  context there for every local rank. :func:`thread_device` captures the caller's
  device so the thread can :func:`bind` it first.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["bind", "devices_of", "synchronize", "thread_device"]


def devices_of(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct non-CPU devices of ``tensors``, in a stable order."""
    return sorted({t.device for t in tensors if t.device.type != "cpu"}, key=str)


def synchronize(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """Wait for all queued work on every accelerator device ``tensors`` live on; returns those devices."""
    found = devices_of(tensors)
    for device in found:
        torch.get_device_module(device.type).synchronize(device)
    return found


def thread_device() -> torch.device | None:
    """The calling thread's current CUDA device, or None where CUDA is not in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def bind(device: torch.device | None) -> None:
    """Make ``device`` current in this thread (before any CUDA work of a background thread)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
