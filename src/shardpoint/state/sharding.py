"""How a rank's tensors map onto the full (global) tensors of the model.

A :class:`Shard` says "this local tensor is the box ``global_offset .. + shape`` of a
tensor whose full shape is ``global_shape``". It is Megatron's ShardedTensor idea
reduced to what a checkpoint needs. Every value a trainer hands to shardpoint (a
plain tensor, a ``Shard``, a ``DTensor``) is normalised to a ``Shard`` here, so the
formats deal with exactly one description.

The helpers cover Megatron's tensor-parallel layers, so a model describes its
shards in a line each::

    def sharded_state_dict(self):
        return {
            "layers.3.mlp.fc1.weight": sp.column_parallel(self.fc1.weight, topo),
            "layers.3.mlp.fc2.weight": sp.row_parallel(self.fc2.weight, topo),
            "layers.3.mlp.fc2.bias": self.fc2.bias,           # replicated
        }

Experts (mixture-of-experts layers) come in the two conventions checkpoints use,
both stored by global expert id so any ep / etp reads them:

* one key per expert (Megatron's ``SequentialMLP``): local expert ``i`` on ep rank
  ``r`` is global expert ``r × E_local + i`` (:func:`global_expert`), its weights split
  over expert tensor parallel (:func:`expert_column_parallel`, :func:`expert_row_parallel`);
* one stacked ``[E, ...]`` tensor per layer (torchtitan's ``GroupedExperts``, Megatron's
  ``GroupedMLP`` as 3-D weights): this rank's ``[E_local, ...]`` slice of it,
  :func:`grouped_experts`.

Replicas of an expert piece (the experts' data parallel) declare ``replica_id = edp_rank``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from shardpoint.errors import TopologyMismatchError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from shardpoint.parallel.topology import Topology

__all__ = [
    "RankLocal",
    "Shard",
    "column_parallel",
    "divide",
    "expert_column_parallel",
    "expert_row_parallel",
    "global_expert",
    "grouped_experts",
    "row_parallel",
    "shard_along",
    "to_shard",
    "vocab_parallel",
]


@dataclass
class Shard:
    """A local piece of a larger tensor.

    Args:
        tensor: the local data; loading copies into it in place.
        global_shape: shape of the full tensor.
        global_offset: index of ``tensor[0, 0, ...]`` in the full tensor.
        replica_id: 0 for the copy that is canonical; other replicas of the same box
            (e.g. data-parallel copies) may use any other value. DCP writes each box
            once whatever the replica id, and spreads that work across the replicas.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: int = 0

    def __post_init__(self) -> None:
        # built for every tensor at every save: map() and one zip keep it about 1 µs
        self.global_shape = shape = tuple(map(int, self.global_shape))
        self.global_offset = offset = tuple(map(int, self.global_offset))
        local = tuple(self.tensor.shape)
        if not (len(local) == len(shape) == len(offset)):
            raise ValueError(
                f"Shard of local shape {local} needs global_shape and global_offset of {len(local)} dims, "
                f"got {shape} and {offset}"
            )
        for dim, (size, full, start) in enumerate(zip(local, shape, offset)):
            if start < 0 or start + size > full:
                raise ValueError(
                    f"Shard of local shape {local} at offset {offset} does not fit in global shape {shape} (dim {dim})"
                )

    @property
    def is_full(self) -> bool:
        return tuple(self.tensor.shape) == self.global_shape

    def like(self, tensor: torch.Tensor) -> Shard:
        """The same box holding another tensor of the same shape (e.g. an Adam moment).

        A tensor of this shard's shape fits the box already checked, so the check is not
        repeated: it was most of the cost of staging 10,000 small tensors.
        """
        if tensor.shape != self.tensor.shape:
            return Shard(tensor, self.global_shape, self.global_offset, self.replica_id)
        same = object.__new__(Shard)
        same.__dict__.update(self.__dict__, tensor=tensor)
        return same


@dataclass
class RankLocal:
    """A tensor that belongs to this rank alone, e.g. a buffer that differs by rank.

    A plain tensor in ``sharded_state_dict()`` is declared replicated (stored once, and
    checked equal across ranks at save); wrap a rank-specific one in ``RankLocal`` and it
    is stored under this rank's own key instead, restored exactly at the same layout.
    """

    tensor: torch.Tensor


def divide(size: int, parts: int, what: str = "tensor") -> int:
    """``size // parts``, or :class:`TopologyMismatchError` naming ``what`` when it does not divide."""
    if size % parts:
        raise TopologyMismatchError(
            f"{what} has size {size}, which does not divide into {parts} parallel parts; "
            f"choose a layout whose size divides {size}"
        )
    return size // parts


def shard_along(tensor: torch.Tensor, dim: int, rank: int, parts: int, replica_id: int = 0) -> Shard:
    """Shard of ``tensor`` as part ``rank`` of ``parts`` equal pieces along ``dim``."""
    shape = list(tensor.shape)
    offset = [0] * len(shape)
    offset[dim] = shape[dim] * rank
    shape[dim] = shape[dim] * parts
    return Shard(tensor, tuple(shape), tuple(offset), replica_id)


def column_parallel(tensor: torch.Tensor, topology: Topology) -> Shard:
    """Megatron ColumnParallelLinear weight or bias: split along dim 0 over tensor parallel."""
    return shard_along(tensor, 0, topology.tp_rank, topology.tp_size, replica_id=topology.dp_rank)


def row_parallel(tensor: torch.Tensor, topology: Topology) -> Shard:
    """Megatron RowParallelLinear weight: split along dim 1 (its bias is replicated)."""
    return shard_along(tensor, 1, topology.tp_rank, topology.tp_size, replica_id=topology.dp_rank)


def vocab_parallel(tensor: torch.Tensor, topology: Topology) -> Shard:
    """VocabParallelEmbedding weight: split along the vocabulary, dim 0."""
    return column_parallel(tensor, topology)


def global_expert(local_index: int, num_local_experts: int, topology: Topology) -> int:
    """Megatron's global id of this rank's local expert ``local_index``: ``ep_rank × E_local + local_index``.

    Example:
        >>> topo = sp.Topology(dp_size=4, ep_size=4, rank=2)
        >>> [f"mlp.experts.{sp.global_expert(i, 2, topo)}.fc1.weight" for i in range(2)]
        ['mlp.experts.4.fc1.weight', 'mlp.experts.5.fc1.weight']
    """
    if not 0 <= local_index < num_local_experts:
        raise ValueError(f"local expert {local_index} is not one of this rank's {num_local_experts}")
    return topology.ep_rank * num_local_experts + local_index


def expert_column_parallel(tensor: torch.Tensor, topology: Topology) -> Shard:
    """One expert's ColumnParallelLinear weight or bias (``linear_fc1``): dim 0 split over expert tensor parallel."""
    return shard_along(tensor, 0, topology.etp_rank, topology.etp_size, replica_id=topology.edp_rank)


def expert_row_parallel(tensor: torch.Tensor, topology: Topology) -> Shard:
    """One expert's RowParallelLinear weight (``linear_fc2``): dim 1 split over expert tensor parallel."""
    return shard_along(tensor, 1, topology.etp_rank, topology.etp_size, replica_id=topology.edp_rank)


def grouped_experts(tensor: torch.Tensor, topology: Topology, etp_dim: int | None = None) -> Shard:
    """This rank's ``[E_local, ...]`` slice of a stacked ``[E, ...]`` expert tensor: dim 0 over ep.

    ``etp_dim``: the dimension split over expert tensor parallel as well (e.g. 1 for a
    ``[E, ffn, hidden]`` up-projection, 2 for ``[E, hidden, ffn]``); None when each
    etp rank holds all of it (a bias of the row-parallel projection).
    """
    shape, offset = list(tensor.shape), [0] * tensor.dim()
    for dim, rank, parts in ((0, topology.ep_rank, topology.ep_size), (etp_dim, topology.etp_rank, topology.etp_size)):
        if dim is not None:
            offset[dim] = shape[dim] * rank
            shape[dim] *= parts
    return Shard(tensor, tuple(shape), tuple(offset), topology.edp_rank)


def to_shard(value: Any, key: str) -> Shard:
    """Normalise a tensor, ``Shard`` or ``DTensor`` to a ``Shard``."""
    if isinstance(value, Shard):
        return value
    dtensor_cls = _dtensor_class()
    if dtensor_cls is not None and isinstance(value, dtensor_cls):
        return _dtensor_to_shard(value)
    if isinstance(value, torch.Tensor):
        return Shard(value, tuple(value.shape), (0,) * value.dim())
    raise TypeError(
        f"state value {key!r} is a {type(value).__name__}; shardpoint stores tensors, sp.Shard and DTensor "
        f"values under model/optimizer keys (put other state in TrainState.extra)"
    )


def flatten_shards(
    values: Mapping[str, Any], prefix: str, rank_local: dict[str, torch.Tensor] | None = None
) -> dict[str, Shard]:
    """``{prefix + key: Shard}`` for a (possibly nested) mapping of tensor-like values.

    :class:`RankLocal` values go to ``rank_local`` (a TypeError when it is not given).
    """
    flat: dict[str, Shard] = {}
    for key, value in values.items():
        full_key = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_shards(value, full_key + ".", rank_local))
        elif value is None:
            continue
        elif isinstance(value, RankLocal) and rank_local is not None:
            rank_local[full_key] = value.tensor
        else:
            flat[full_key] = to_shard(value, full_key)
    return flat


def boxes_overlap(
    offset_a: Sequence[int], shape_a: Sequence[int], offset_b: Sequence[int], shape_b: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection of two boxes as ``(offset, shape)`` in global coordinates, or None."""
    lo = [max(a, b) for a, b in zip(offset_a, offset_b)]
    hi = [min(a + sa, b + sb) for a, sa, b, sb in zip(offset_a, shape_a, offset_b, shape_b)]
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - low for low, h in zip(lo, hi))


def copy_overlap(dst: Shard, src_tensor: torch.Tensor, src_offset: Sequence[int]) -> int:
    """Copy the part of ``src_tensor`` (placed at ``src_offset``) that falls in ``dst``; returns elements copied."""
    box = boxes_overlap(dst.global_offset, dst.tensor.shape, src_offset, src_tensor.shape)
    if box is None:
        return 0
    offset, shape = box
    dst_view, src_view = dst.tensor, src_tensor
    for dim, (start, size) in enumerate(zip(offset, shape)):
        dst_view = dst_view.narrow(dim, start - dst.global_offset[dim], size)
        src_view = src_view.narrow(dim, start - src_offset[dim], size)
    with torch.no_grad():
        dst_view.copy_(src_view)
    return dst_view.numel()


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    cls = _dtensor_class()
    return cls is not None and isinstance(value, cls)


def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def _dtensor_to_shard(value: Any) -> Shard:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = value.to_local()
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    replica_id = 0
    coord = value.device_mesh.get_coordinate() or []
    for mesh_dim, placement in enumerate(value.placements):
        if placement.is_replicate():
            replica_id = replica_id * value.device_mesh.size(mesh_dim) + coord[mesh_dim]
    if local.numel() == 0:
        offset = tuple(0 for _ in offset)
    return Shard(local, tuple(value.shape), tuple(offset), replica_id)
