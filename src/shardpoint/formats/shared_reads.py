"""Each stored byte is read once per load: one rank reads each file, the others receive what they need.

Read independently, a restart at dp=64 reads the checkpoint 64 times from S3 or the
parallel filesystem (Megatron-LM's ``--ckpt-fully-parallel-load`` and PyTorch's
cooperative load planner exist for this), and every tensor-parallel rank reads the
norms and biases that all of them hold.

In the load's planning round every rank sends the boxes of its targets to their keys'
planners (:mod:`~shardpoint.formats.split_plan`; rank 0 for a checkpoint whose index is
one file); each planner finds the stored items (DCP's chunks) each rank needs of its keys
and plans their reading (:mod:`~shardpoint.formats.load_parts`), and each rank receives
its :class:`Assignment`:

1. :func:`~shardpoint.formats.read_plan.plan_reads` gives each file one reader: among the ranks that need the most of
   its bytes, the one with the fewest bytes so far (biggest files first). Data-parallel
   replicas therefore deal the files out evenly, and a file goes to a rank that needs
   most of it. A reader reads its files whole, hashing each as it streams: every byte
   read is checksummed and damage is still named by file.
2. each rank reads its files: its own items into its targets, and the whole stored
   chunk of every item that another rank needs (:meth:`Exchange.read_items`); a chunk
   that is exactly one of its own targets is read straight into it.
3. still inside the read round, :meth:`Exchange.stage` puts what each rank sends and
   receives on the route's device (:func:`route_for`), so a failure there (a GPU out of
   memory) stops every rank before any transfer is posted;
4. once every rank's reads succeeded (agreed), :meth:`Exchange.run` sends each chunk
   from its reader to the ranks that need it, point to point, in one batch in the same
   order everywhere. A chunk that is exactly a receiver's target lands in it directly;
   otherwise in a chunk-sized buffer whose overlap is copied in.

The route: when every rank's targets are on one accelerator type that the trainer's
group moves itself (CUDA on NCCL), the chunks go device to device on that group, from
the main thread; every rank joins one small all-reduce on it first, because NCCL needs
every rank in a group's first call and a batch of sends involves only some. Otherwise
(CPU targets, gloo, mixed devices) they go over the gloo control group, through host
copies of GPU tensors.

Memory: beyond its own state a rank holds the chunks it reads for others that it does
not hold itself, and the chunks it receives only in part (resharding); for replicas
neither exists. Both are bounded: :func:`~shardpoint.formats.read_plan.plan_sharing` gives no rank more than
:data:`EXCHANGE_BUFFER_BYTES` of them, and a chunk that would exceed a rank's bound is
read by each rank that needs it, as without sharing (only resharded loads far larger
than the bound read some bytes more than once). On the device route the same bound holds
for the device copies: chunks read for others move to the GPU (their host buffer is
freed), and partial receives land in GPU buffers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from shardpoint.formats.chunk_index import tensor_of
from shardpoint.parallel import comm
from shardpoint.state.sharding import Shard

__all__ = ["EXCHANGE_BUFFER_BYTES", "Assignment", "Exchange", "Route", "device_types", "route_for"]

_PEER = "__shardpoint_peer__/"  # target keys of chunks read for other ranks

#: bytes one rank may hold for a shared load beyond its own state (chunks read for others
#: that it does not hold, chunks it receives only in part)
EXCHANGE_BUFFER_BYTES = 1 << 30


def device_types(targets: Mapping[str, Shard]) -> tuple[str, ...]:
    """This rank's other part of the planning round: the device types its targets live on."""
    return tuple(sorted({shard.tensor.device.type for shard in targets.values()}))


@dataclass(frozen=True)
class Route:
    """How a shared load's chunks travel: over which group, in buffers on which device."""

    group: Any
    device: torch.device
    #: on the trainer's group (device to device under NCCL), not the control group
    trainer: bool


def route_for(types: Sequence[Sequence[str]], force: str = "auto") -> Route:
    """The route of a shared load, the same on every rank. ``types[r]``: :func:`device_types` of rank r.

    ``auto``: the trainer's group when every rank's targets are on one accelerator type
    that it moves directly (:func:`shardpoint.parallel.comm.device_group`), else the
    control group. ``"control"`` and ``"trainer"`` force one; ``"trainer"`` with CPU
    targets suits only a gloo trainer group (it is how CPU CI runs this route).
    """
    if force not in ("auto", "control", "trainer"):
        raise ValueError(f"exchange route {force!r}: use 'auto', 'control' or 'trainer'")
    kinds = set().union(*map(set, types))
    kind = next(iter(kinds)) if len(kinds) == 1 else "cpu"
    group = comm.device_group(kind)
    if force == "control" or (force == "auto" and group is None):
        return Route(comm.control_group(), torch.device("cpu"), trainer=False)
    device = torch.device("cpu")
    if kind != "cpu":  # each rank's own current device (cuda:LOCAL_RANK)
        device = torch.device(kind, torch.get_device_module(kind).current_device())
    return Route(group or dist.group.WORLD, device, trainer=True)  # forced "trainer": the default group


@dataclass
class Assignment:
    """One rank's share of a shared load, as rank 0 planned it (:mod:`~shardpoint.formats.load_parts`).

    Stored items are named by their position, which rank 0 gave every rank alike.
    """

    #: stored item -> the rank that reads its file: every item this rank needs, reads or sends
    readers: dict[int, int]
    #: stored item -> the ranks that receive it from its reader: every item this rank sends or receives
    receivers: dict[int, list[int]]
    #: stored items this rank reads itself although another rank reads their file
    direct: set[int]
    #: whether any rank receives anything (the same on every rank)
    needed: bool


class Exchange:
    """One rank's part of a shared load: what it reads, what it sends, what it receives.

    ``metadata`` holds the stored items this rank needs, reads or sends (its part, not
    the whole file); ``position`` names each by its position in ``assignment``.
    """

    def __init__(
        self,
        items: Sequence[ReadItem],
        targets: Mapping[str, Shard],
        metadata: Metadata,
        position: Mapping[MetadataIndex, int],
        route: Route,
        assignment: Assignment,
    ):
        self.rank = comm.rank()
        self.targets, self.metadata, self.route = targets, metadata, route
        self.index = {at: index for index, at in position.items()}
        self.readers, self.receivers = assignment.readers, assignment.receivers
        self.direct, self.any_received = assignment.direct, assignment.needed
        self.mine: dict[int, list[ReadItem]] = {}
        for item in items:
            self.mine.setdefault(position[item.storage_index], []).append(item)
        self.chunks: dict[int, torch.Tensor] = {}  # what this rank sends, by stored item
        self.incoming: dict[int, torch.Tensor] = {}  # where what it receives lands (stage)
        self.landing: list[int] = []  # received into a buffer, copied into its targets after

    def reader_of(self, at: int) -> int:
        return self.readers[at]

    def read_items(self) -> tuple[list[ReadItem], dict[str, Shard]]:
        """This rank's reads (its items in its files, whole chunks for others) and the extra targets they fill."""
        plan: list[ReadItem] = []
        extra: dict[str, Shard] = {}
        for at, wanted in self.mine.items():
            if self.reader_of(at) == self.rank or at in self.direct:
                plan += wanted
        for at, _ in self._transfers():
            if self.reader_of(at) != self.rank:
                continue
            whole = self._whole_target(at)
            if whole is not None:
                self.chunks[at] = whole
                continue
            index = self.index[at]
            sizes, dtype = self._chunk(at)
            key = f"{_PEER}{len(extra)}"
            self.chunks[at] = buffer = torch.empty(sizes, dtype=dtype)
            global_shape = tuple(tensor_of(self.metadata.state_dict_metadata[index.fqn], index.fqn).size)
            extra[key] = Shard(buffer, global_shape, tuple(index.offset or ()))
            zeros = torch.Size([0] * len(sizes))
            plan.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(key, index.offset), zeros, index, zeros, sizes))
        return plan, extra

    def needed(self) -> bool:
        """Whether any rank receives something (every rank gets the same answer)."""
        return self.any_received

    def stage(self) -> None:
        """Put what this rank sends and receives on the route's device, before any rank posts a transfer.

        Called inside the read round: a failure here (a GPU out of memory) then stops
        every rank, where under NCCL a rank waiting on a transfer that never comes hangs.
        """
        device = self.route.device
        for at, ranks in self._transfers():
            if self.reader_of(at) == self.rank:
                self.chunks[at] = self.chunks[at].detach().to(device).contiguous()
            elif self.rank in ranks:
                whole = self._whole_target(at)
                if whole is None or whole.device != device:
                    sizes, dtype = self._chunk(at)
                    whole = torch.empty(sizes, dtype=dtype, device=device)
                    self.landing.append(at)
                self.incoming[at] = whole

    def run(self, resolve: Any) -> None:
        """Send what this rank read for others, receive what others read for it; ``resolve``: item -> target view."""
        group = self.route.group
        if self.route.trainer:  # NCCL: a group's first call must include every rank, and a batch need not
            dist.all_reduce(torch.zeros(1, device=self.route.device), group=group)
        ops = []
        for at, ranks in self._transfers():
            if at in self.chunks:
                ops += [dist.P2POp(dist.isend, self.chunks[at], peer, group) for peer in ranks]
            elif at in self.incoming:
                ops.append(dist.P2POp(dist.irecv, self.incoming[at], self.reader_of(at), group))
        comm.exchange(ops, "sending the chunks of a shared load")
        with torch.no_grad():
            for at in self.landing:
                chunk = self.incoming[at]
                for item in self.mine[at]:
                    resolve(item).copy_(narrow_tensor_by_index(chunk, item.storage_offsets, item.lengths))

    def _transfers(self) -> list[tuple[int, list[int]]]:
        """The stored items that travel and their receivers, in the order every rank uses."""
        return [(at, ranks) for at, ranks in sorted(self.receivers.items()) if ranks]

    def _whole_target(self, at: int) -> torch.Tensor | None:
        return _whole_target(self.mine.get(at, []), self.index[at], self.targets, self.metadata)

    def _chunk(self, at: int) -> tuple[torch.Size, torch.dtype]:
        return _chunk(self.metadata, self.index[at])


def _whole_target(
    wanted: Sequence[ReadItem], index: MetadataIndex, targets: Mapping[str, Shard], metadata: Metadata
) -> torch.Tensor | None:
    """The target of ``wanted`` (a rank's items of one stored chunk) if it is exactly the chunk, else None.

    Exactly: the same box, dtype and a contiguous tensor, so the chunk is read, sent and
    received straight into it.
    """
    if len(wanted) != 1:
        return None
    item = wanted[0]
    sizes, dtype = _chunk(metadata, index)
    target = targets.get(item.dest_index.fqn)
    if target is None or any(item.storage_offsets) or any(item.dest_offsets) or item.lengths != sizes:
        return None
    tensor = target.tensor.detach()
    usable = tensor.shape == sizes and tensor.dtype == dtype and tensor.is_contiguous()
    return tensor if usable else None


def _chunk(metadata: Metadata, index: MetadataIndex) -> tuple[torch.Size, torch.dtype]:
    md = tensor_of(metadata.state_dict_metadata[index.fqn], index.fqn)
    for chunk in md.chunks:
        if chunk.offsets == index.offset:
            return chunk.sizes, md.properties.dtype
    raise KeyError(index)
