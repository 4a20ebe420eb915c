"""The accelerator devices a rank's tensors live on, kept generic (CUDA, or none on CPU).

Two NCCL-era rules live here:

- a snapshot is complete only when *every* device its tensors came from is
  synchronised: ``torch.cuda.synchronize()`` waits for the current device only, so a
  tensor on another device could still be copying while the background thread
  hashes and writes it (a torn checkpoint with valid checksums);
- pinned host memory is allocated at its exact size (:func:`host_slab`): the caching
  host allocator behind ``pin_memory=True`` rounds every request up to a power of two,
  up to 2x the host RAM of the state on each rank;
- new threads do not inherit ``torch.cuda.set_device``: a background thread that
  touches CUDA without it works on ``cuda:0``, syncing that GPU's stream and creating a
  context there for every local rank. :func:`thread_device` captures the caller's
  device so the thread can :func:`bind` it first.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["bind", "devices_of", "host_slab", "record_event", "synchronize", "thread_device"]

log = logging.getLogger(__name__)


def devices_of(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct non-CPU devices of ``tensors``, in a stable order."""
    return sorted({t.device for t in tensors if t.device.type != "cpu"}, key=str)


def synchronize(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """Wait for all queued work on every accelerator device ``tensors`` live on; returns those devices."""
    found = devices_of(tensors)
    for device in found:
        torch.get_device_module(device.type).synchronize(device)
    return found


def record_event(device: torch.device) -> Any:
    """An event marking the work queued so far on ``device``'s current stream (None for the CPU)."""
    if device.type == "cpu":
        return None
    module = torch.get_device_module(device.type)
    event = module.Event()
    event.record(module.current_stream(device))
    return event


def thread_device() -> torch.device | None:
    """The calling thread's current CUDA device, or None where CUDA is not in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def bind(device: torch.device | None) -> None:
    """Make ``device`` current in this thread (before any CUDA work of a background thread)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def host_slab(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory as one ``uint8`` tensor; page-locked when ``pinned`` and CUDA is in use.

    CUDA's pinned memory is registered in place (``cudaHostRegister``) on a plain
    allocation of the exact size, and unregistered when the slab is freed; where that
    is not possible it falls back to ``pin_memory=True`` (rounded up by the caching
    host allocator). Without CUDA it is plain memory: copies from other accelerators
    still work, they are just not asynchronous.
    """
    slab = torch.empty(nbytes, dtype=torch.uint8)
    if not pinned or nbytes == 0 or not torch.cuda.is_available():
        return slab
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(slab.data_ptr(), nbytes, 0)) != 0:
        log.warning("cudaHostRegister of %d bytes failed; pinning through the caching host allocator", nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(slab, cudart.cudaHostUnregister, slab.data_ptr())
    return slab
