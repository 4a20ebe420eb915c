"""Each stored byte is read once per load: one rank reads each file, the others receive what they need.

Read independently, a restart at dp=64 reads the checkpoint 64 times from S3 or the
parallel filesystem (Megatron-LM's ``--ckpt-fully-parallel-load`` and PyTorch's
cooperative load planner exist for this), and every tensor-parallel rank reads the
norms and biases that all of them hold.

In the load's planning round every rank also sends the stored items (DCP's chunks) it
needs. Then, identically on every rank and without another message:

1. :func:`plan_reads` gives each file one reader: among the ranks that need the most of
   its bytes, the one with the fewest bytes so far (biggest files first). Data-parallel
   replicas therefore deal the files out evenly, and a file goes to a rank that needs
   most of it. A reader reads its files whole, hashing each as it streams: every byte
   read is checksummed and damage is still named by file.
2. each rank reads its files: its own items into its targets, and the whole stored
   chunk of every item that another rank needs (:meth:`Exchange.read_items`); a chunk
   that is exactly one of its own targets is read straight into it.
3. once every rank's reads succeeded (agreed), :meth:`Exchange.run` sends each chunk
   from its reader to the ranks that need it, point to point on the control group, in
   one batch in the same order everywhere. A chunk that is exactly a receiver's target
   lands in it directly; otherwise in a chunk-sized buffer whose overlap is copied in.

Memory: beyond its own state a rank holds the chunks it reads for others that it does
not hold itself, and the chunks it receives only in part (resharding); for replicas
neither exists. GPU targets go through host copies (the control group is gloo).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from shardpoint.parallel import comm
from shardpoint.state.sharding import Shard

__all__ = ["Exchange", "plan_reads"]

_PEER = "__shardpoint_peer__/"  # target keys of chunks read for other ranks


def plan_reads(needs: Sequence[Mapping[MetadataIndex, int]], files: Mapping[MetadataIndex, str]) -> dict[str, int]:
    """The reader of each file. ``needs[r]``: stored item -> its bytes, for what rank r reads."""
    wanted: dict[str, dict[int, int]] = {}  # file -> rank -> bytes of it the rank needs
    for rank, items in enumerate(needs):
        for index, nbytes in items.items():
            per_rank = wanted.setdefault(files[index], {})
            per_rank[rank] = per_rank.get(rank, 0) + nbytes
    size = {name: max(per_rank.values()) for name, per_rank in wanted.items()}
    load = [0] * len(needs)
    readers = {}
    for name in sorted(wanted, key=lambda n: (-size[n], n)):
        most = max(wanted[name].values())
        reader = min((r for r, b in wanted[name].items() if b == most), key=lambda r: (load[r], r))
        readers[name] = reader
        load[reader] += size[name]
    return readers


class Exchange:
    """One rank's part of a shared load: what it reads, what it sends, what it receives."""

    def __init__(
        self,
        items: Sequence[ReadItem],
        targets: Mapping[str, Shard],
        needs: Sequence[Mapping[MetadataIndex, int]],
        metadata: Metadata,
    ):
        storage = metadata.storage_data
        self.rank = comm.rank()
        self.files = {index: storage[index].relative_path for rank_needs in needs for index in rank_needs}
        self.readers = plan_reads(needs, self.files)
        self.needers: dict[MetadataIndex, list[int]] = {}
        for rank, rank_needs in enumerate(needs):
            for index in rank_needs:
                self.needers.setdefault(index, []).append(rank)
        self.targets, self.metadata = targets, metadata
        self.mine: dict[MetadataIndex, list[ReadItem]] = {}
        for item in items:
            self.mine.setdefault(item.storage_index, []).append(item)
        self.chunks: dict[MetadataIndex, torch.Tensor] = {}  # what this rank sends, by stored item

    def reader_of(self, index: MetadataIndex) -> int:
        return self.readers[self.files[index]]

    def read_items(self) -> tuple[list[ReadItem], dict[str, Shard]]:
        """This rank's reads (its items in its files, whole chunks for others) and the extra targets they fill."""
        plan, extra = [], {}
        for index, wanted in self.mine.items():
            if self.reader_of(index) == self.rank:
                plan += wanted
        for index, ranks in sorted(self.needers.items(), key=lambda kv: _order(kv[0])):
            if self.reader_of(index) != self.rank or ranks == [self.rank]:
                continue
            whole = self._whole_target(index)
            if whole is not None:
                self.chunks[index] = whole
                continue
            sizes, dtype = self._chunk(index)
            key = f"{_PEER}{len(extra)}"
            self.chunks[index] = buffer = torch.empty(sizes, dtype=dtype)
            global_shape = tuple(self.metadata.state_dict_metadata[index.fqn].size)
            extra[key] = Shard(buffer, global_shape, tuple(index.offset))
            zeros = torch.Size([0] * len(sizes))
            plan.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(key, index.offset), zeros, index, zeros, sizes))
        return plan, extra

    def needed(self) -> bool:
        """Whether any rank receives something (every rank gets the same answer)."""
        return any(any(r != self.reader_of(index) for r in ranks) for index, ranks in self.needers.items())

    def run(self, resolve: Any) -> None:
        """Send what this rank read for others, receive what others read for it; ``resolve``: item -> target view."""
        group = comm.control_group()
        ops, landing = [], []
        for index, ranks in sorted(self.needers.items(), key=lambda kv: _order(kv[0])):
            reader = self.reader_of(index)
            if reader == self.rank:
                payload = _host(self.chunks[index]) if any(r != self.rank for r in ranks) else None
                ops += [dist.P2POp(dist.isend, payload, peer, group) for peer in ranks if peer != self.rank]
            elif self.rank in ranks:
                whole = self._whole_target(index)
                if whole is not None and whole.device.type == "cpu":
                    buffer = whole
                else:
                    sizes, dtype = self._chunk(index)
                    buffer = torch.empty(sizes, dtype=dtype)
                ops.append(dist.P2POp(dist.irecv, buffer, reader, group))
                if buffer is not whole:
                    landing.append((index, buffer))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        with torch.no_grad():
            for index, chunk in landing:
                for item in self.mine[index]:
                    resolve(item).copy_(narrow_tensor_by_index(chunk, item.storage_offsets, item.lengths))

    def _whole_target(self, index: MetadataIndex) -> torch.Tensor | None:
        """This rank's target if it is exactly the stored chunk (same box, dtype, contiguous), else None."""
        wanted = self.mine.get(index, [])
        if len(wanted) != 1:
            return None
        item = wanted[0]
        sizes, dtype = self._chunk(index)
        target = self.targets.get(item.dest_index.fqn)
        if target is None or any(item.storage_offsets) or any(item.dest_offsets) or item.lengths != sizes:
            return None
        tensor = target.tensor.detach()
        usable = tensor.shape == sizes and tensor.dtype == dtype and tensor.is_contiguous()
        return tensor if usable else None

    def _chunk(self, index: MetadataIndex) -> tuple[torch.Size, torch.dtype]:
        md = self.metadata.state_dict_metadata[index.fqn]
        for chunk in md.chunks:
            if chunk.offsets == index.offset:
                return chunk.sizes, md.properties.dtype
        raise KeyError(index)


def _order(index: MetadataIndex) -> tuple:
    return index.fqn, tuple(index.offset or ())


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``tensor``'s values (the control group is gloo)."""
    return tensor.detach().to("cpu").contiguous()
