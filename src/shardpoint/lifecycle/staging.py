"""Host staging: every tensor reaches host memory once, into one reused slab, before it is hashed and written.

A GPU tensor must be on the host before it can be checksummed or written. Done per
tensor, that costs twice over: the replica check copied it (``.cpu()``) and DCP
copied it again, into fresh unpinned memory each time, with one device sync per
parameter; an async snapshot allocated one pinned buffer per tensor, which the
caching host allocator rounds up to a power of two (up to 2x the state in host RAM).

:class:`HostStaging` instead lays the tensors out in one slab (pinned at its exact
size, see :func:`shardpoint.parallel.devices.host_slab`), kept across saves while the
structure (keys, shapes, dtypes, devices) stays the same:

- each tensor is copied into its slot with a non-blocking copy (one ``_foreach_copy_``
  per source device: at 10,000 small tensors a ``copy_`` call each cost more than their
  bytes), then every device the tensors came from is synchronised once: the snapshot is
  complete before anyone reads it;
- 0-d tensors (Adam's ``step``) of one device and dtype sit next to each other and move
  in one copy of their stacked values, not one sync each;
- hashing and writing read the slots in place. Each slot is a tensor whose storage is
  exactly its own bytes, so ``torch.save`` and DCP write it without another copy (DCP
  clones any tensor whose storage is larger than itself).

Sync saves stage only tensors that are not on the CPU (the CPU ones are read where
they are); async saves stage everything, since the trainer changes its tensors as soon
as the save returns. The slab is the state's size plus at most 15 bytes of alignment
per slot: :attr:`HostStaging.nbytes` is what ``shardpoint bench`` reports.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardpoint.parallel import devices
from shardpoint.state.train_state import FlatState

__all__ = ["HostStaging"]

ALIGN = 16  # bytes; every slot starts at a multiple (any dtype's alignment)
_RANK_LOCAL = "rank_local:"  # slot names of rank-local tensors, apart from global keys


@dataclass(frozen=True)
class _Slot:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class HostStaging:
    """One host slab carved into a slot per tensor, reused while the state's structure is unchanged.

    A slot is reused by the next save, so the caller must be done with the previous
    staged state (its writer joined) before staging again; the save pipeline ensures it.
    """

    def __init__(self) -> None:
        self._signature: tuple | None = None
        self._slab: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._batches: list[tuple[list[str], torch.Tensor]] = []  # 0-d keys and the one region they fill
        self.allocations = 0  # slabs allocated so far: one per structure

    @property
    def nbytes(self) -> int:
        """Host bytes held for staging (0 when nothing needed it)."""
        return 0 if self._slab is None else self._slab.nbytes

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie in the slab."""
        if self._slab is None or tensor.nbytes == 0:
            return False
        start = self._slab.data_ptr()
        return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= start + self._slab.nbytes

    def stage(self, flat: FlatState, *, everything: bool) -> FlatState:
        """``flat`` with its tensors on the host: device tensors always, CPU ones too when ``everything``.

        With ``everything`` the result is a snapshot the trainer may change right after
        this returns (small state deep-copied too); without, CPU tensors are the trainer's own.
        """

        def staged(tensor: torch.Tensor) -> bool:
            return everything or tensor.device.type != "cpu"

        sources = {key: s.tensor.detach() for key, s in flat.tensors.items() if staged(s.tensor)}
        sources.update({_RANK_LOCAL + key: t.detach() for key, t in flat.rank_local.items() if staged(t)})
        if not sources and not everything:
            return flat
        self._prepare(sources)
        self._copy_in(sources)
        views = self._views
        tensors = {k: s.like(views[k]) if k in views else s for k, s in flat.tensors.items()}
        own = {k: views.get(_RANK_LOCAL + k, t) for k, t in flat.rank_local.items()}
        common, per_rank = flat.common, flat.per_rank
        if everything:
            common, per_rank = copy.deepcopy(common), copy.deepcopy(per_rank)
        return FlatState(tensors, common, per_rank, own, set(flat.shared_if_equal), frozen=set(flat.frozen))

    def _prepare(self, sources: Mapping[str, torch.Tensor]) -> None:
        """Lay out and allocate a new slab when the structure changed; else keep the current one."""
        signature = tuple((k, t.dtype, tuple(t.shape), t.device) for k, t in sources.items())
        if signature == self._signature:
            return
        slots, batches = _layout(sources)
        total = max((s.offset + s.nbytes for s in slots.values()), default=0)
        self._views, self._batches, self._slab = {}, [], None  # the old slab goes before the new one comes
        self._slab = devices.host_slab(total, pinned=any(t.device.type != "cpu" for t in sources.values()))
        raw = self._slab.numpy().data if total else memoryview(b"")
        self._views = {key: _carve(raw, slot) for key, slot in slots.items()}
        for keys in batches:
            first, size = slots[keys[0]], slots[keys[0]].nbytes * len(keys)
            region = _carve(raw, _Slot(first.offset, size, first.dtype, (len(keys),)))
            self._batches.append((keys, region))
        self._signature = signature
        self.allocations += 1

    def _copy_in(self, sources: Mapping[str, torch.Tensor]) -> None:
        """Copy every source into its slot, each 0-d batch in one copy; then wait for every device once."""
        in_flight = []  # stacked scalars stay alive until the devices are synchronised
        batched: set[str] = set()
        with torch.no_grad():
            for keys, region in self._batches:
                stacked = torch.stack([sources[k] for k in keys])
                region.copy_(stacked, non_blocking=stacked.device.type != "cpu")
                in_flight.append(stacked)
                batched.update(keys)
            by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for key, source in sources.items():
                if key not in batched:
                    slots, froms = by_device.setdefault(source.device, ([], []))
                    slots.append(self._views[key])
                    froms.append(source)
            for device, (slots, froms) in by_device.items():
                # one call per device: a copy_ per tensor costs more than the bytes of a small one
                torch._foreach_copy_(slots, froms, non_blocking=device.type != "cpu")
        devices.synchronize(sources.values())
        in_flight.clear()


def _layout(sources: Mapping[str, torch.Tensor]) -> tuple[dict[str, _Slot], list[list[str]]]:
    """Slots in one slab, and the batches of 0-d tensors (one device and dtype, side by side) moved at once."""
    slots: dict[str, _Slot] = {}
    batches: list[list[str]] = []
    offset = 0
    for keys in _scalar_groups(sources).values():
        offset = _aligned(offset)
        for key in keys:
            size = sources[key].element_size()
            slots[key] = _Slot(offset, size, sources[key].dtype, ())
            offset += size
        if len(keys) > 1:
            batches.append(keys)
    for key, tensor in sources.items():
        if key not in slots:
            offset = _aligned(offset)
            slots[key] = _Slot(offset, tensor.nbytes, tensor.dtype, tuple(tensor.shape))
            offset += tensor.nbytes
    return slots, batches


def _scalar_groups(sources: Mapping[str, torch.Tensor]) -> dict[tuple[str, torch.dtype], list[str]]:
    groups: dict[tuple[str, torch.dtype], list[str]] = {}
    for key, tensor in sources.items():
        if tensor.dim() == 0:
            groups.setdefault((str(tensor.device), tensor.dtype), []).append(key)
    return groups


def _carve(raw: memoryview, slot: _Slot) -> torch.Tensor:
    """A tensor on the slot's bytes whose storage is exactly those bytes (so writers never clone it)."""
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=slot.dtype)
    piece = torch.frombuffer(raw[slot.offset : slot.offset + slot.nbytes], dtype=torch.uint8)
    return piece.view(slot.dtype).view(slot.shape)


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN
