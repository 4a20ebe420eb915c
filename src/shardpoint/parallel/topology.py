"""Where this process sits in a tensor × pipeline × data parallel job, and, for its experts, in ep × etp.

Megatron orders ranks with tensor parallel fastest, then data parallel, then
pipeline parallel: ``rank = tp_rank + tp_size * (dp_rank + dp_size * pp_rank)``.
The checkpoint layout (``mp_rank_TT_PPP``) and the rule "data-parallel rank 0
writes the legacy files" both follow from these coordinates, so they live here
and nowhere else.

Mixture-of-experts layers are laid out on the same ranks a second way (Megatron's
``expert_decoder_rank_generator``, order ``tp-ep-dp-pp``): within a pipeline stage the
``tp_size × dp_size`` ranks (``dp`` includes context parallelism) are split into
expert tensor parallel (``etp``, fastest), expert parallel (``ep``) and the experts'
own data parallel (``edp``, the rest)::

    index in stage = tp_rank + tp_size * dp_rank = etp_rank + etp * (ep_rank + ep * edp_rank)

so experts are partitioned over an ep group carved out of dp (and tp, when ``etp < tp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from shardpoint.errors import TopologyMismatchError
from shardpoint.parallel import comm

__all__ = ["Topology"]


@dataclass(frozen=True, init=False)
class Topology:
    """Parallel sizes and this process's coordinates.

    Args:
        tp_size: tensor-parallel size.
        pp_size: pipeline-parallel size.
        dp_size: data-parallel size (of the dense layers; context parallel included). Omitted,
            it is the world size over tp × pp when a process group exists (as Megatron
            computes it), else 1.
        rank: this process's global rank; defaults to the initialised process
            group's rank, or 0 without one.
        ep_size: expert-parallel size: the experts of a layer are split over ep ranks.
        etp_size: expert-tensor-parallel size (Megatron's ``expert_tensor_parallel_size``);
            defaults to ``tp_size``. ``etp_size × ep_size`` must divide ``tp_size × dp_size``.

    Example:
        >>> topo = Topology(tp_size=2, pp_size=2, dp_size=2, rank=5)
        >>> (topo.tp_rank, topo.dp_rank, topo.pp_rank), topo.mp_rank_name
        ((1, 0, 1), 'mp_rank_01_001')
        >>> moe = Topology(tp_size=1, dp_size=4, ep_size=2, rank=3)
        >>> (moe.ep_rank, moe.edp_rank, moe.edp_size)
        (1, 1, 2)
    """

    # every field is an int once constructed: __init__ resolves the arguments that may be None
    tp_size: int
    pp_size: int
    dp_size: int
    rank: int
    ep_size: int
    etp_size: int
    _groups: dict[str, Any] = field(repr=False, compare=False)

    def __init__(
        self,
        tp_size: int = 1,
        pp_size: int = 1,
        dp_size: int | None = None,
        rank: int | None = None,
        ep_size: int = 1,
        etp_size: int | None = None,
    ) -> None:
        """Written out (not generated) so that the arguments may be None while the attributes are always ints."""
        etp = tp_size if etp_size is None else etp_size  # Megatron's default
        dp = _inferred_dp(tp_size, pp_size) if dp_size is None else dp_size
        sizes = {"tp_size": tp_size, "pp_size": pp_size, "dp_size": dp, "ep_size": ep_size, "etp_size": etp}
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology {name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_groups", {})
        object.__setattr__(self, "rank", rank if rank is not None else dist.get_rank() if _initialized() else 0)
        self._validate()

    def _validate(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise TopologyMismatchError(
                f"rank {self.rank} is outside tp={self.tp_size} x pp={self.pp_size} x dp={self.dp_size} "
                f"= {self.world_size} ranks"
            )
        if (self.tp_size * self.dp_size) % (self.ep_size * self.etp_size):
            raise TopologyMismatchError(
                f"etp={self.etp_size} x ep={self.ep_size} does not divide the {self.tp_size * self.dp_size} ranks "
                f"of a pipeline stage (tp={self.tp_size} x dp={self.dp_size}); experts are split over ranks of the "
                "stage: choose ep_size and etp_size whose product divides tp_size x dp_size"
            )
        if _initialized() and dist.get_world_size() != self.world_size:
            raise TopologyMismatchError(
                f"tp={self.tp_size} x pp={self.pp_size} x dp={self.dp_size} = {self.world_size} ranks, "
                f"but the process group has {dist.get_world_size()}; choose sizes whose product is the world size"
            )

    @classmethod
    def from_groups(
        cls,
        *,
        tp_group: Any = None,
        pp_group: Any = None,
        dp_group: Any = None,
        ep_group: Any = None,
        etp_group: Any = None,
        edp_group: Any = None,
    ) -> Topology:
        """Build a topology from existing process groups (``None`` means size 1).

        The coordinates come from each group's own rank, so any rank order the
        trainer chose is respected for naming; the groups are reused for the
        collectives shardpoint needs (e.g. gathering ZeRO state over ``dp_group``).
        Experts (Megatron's ``get_expert_model_parallel_group`` and friends): without
        ``etp_group`` the experts' tensor parallel is ``tp_group``'s; without ``edp_group``
        every expert replica declares replica id 0 (identical boxes are replicas anyway).
        """
        groups = {"tp": tp_group, "pp": pp_group, "dp": dp_group, "ep": ep_group, "edp": edp_group}
        groups["etp"] = etp_group if etp_group is not None else tp_group
        sizes = {name: dist.get_world_size(g) if g is not None else 1 for name, g in groups.items()}
        coords = {name: dist.get_rank(g) if g is not None else 0 for name, g in groups.items()}
        rank = dist.get_rank() if _initialized() else 0
        topo = cls(sizes["tp"], sizes["pp"], sizes["dp"], rank=rank, ep_size=sizes["ep"], etp_size=sizes["etp"])
        object.__setattr__(topo, "_coords", coords)
        # the trainer's groups name the coordinates; shardpoint's traffic goes over gloo mirrors of them
        topo._groups["trainer_dp"] = dp_group
        return topo

    @classmethod
    def from_mesh(cls, mesh: Any) -> Topology:
        """The topology of a named ``DeviceMesh`` (FSDP2 / DTensor jobs), e.g. names ``("dp", "tp")``.

        An unnamed 1-D mesh (FSDP2's usual ``init_device_mesh("cuda", (world,))``) is data parallel.

        ``tp`` and ``pp`` are read by name (also Lightning's ``tensor_parallel`` and
        ``pipeline_parallel``); the one remaining dimension (``dp``, ``fsdp``, ``dp_shard``,
        Lightning's ``data_parallel``, ...) is data parallel. Meshes with several
        data-parallel dimensions need them flattened into one, as Accelerate and torchtitan
        do (``dp`` of ``dp_replicate`` × ``dp_shard``, ``dp_cp`` with context parallelism):
        that flattened dimension is used.

        An ``ep`` dimension splits the experts, carved out of data parallel as Megatron
        does (experts' tensor parallel is ``tp``): e.g. names ``("dp", "ep", "tp")`` give
        ``ep_size`` from ``ep``, the experts' data parallel from ``dp`` and the dense
        layers' data parallel ``dp × ep``.
        """
        names = tuple(mesh.mesh_dim_names or ())
        if "ep" in names:
            return _from_expert_mesh(cls, mesh, names)
        if not names and mesh.ndim == 1:  # FSDP2's usual init_device_mesh("cuda", (world,)): data parallel
            return cls.from_groups(dp_group=mesh.get_group(0))
        if len(names) != mesh.ndim:
            raise ValueError(
                f"Topology.from_mesh needs the names of a {mesh.ndim}-D mesh's dimensions, e.g. "
                "init_device_mesh(..., mesh_dim_names=('dp', 'tp')); only a 1-D mesh may be unnamed (data parallel)"
            )
        roles = {n: _MESH_ROLES.get(n, "dp") for n in names}
        # a data-parallel dimension of size 1 holds no parallelism (transformers' dp_replicate=1)
        data = [n for n in names if roles[n] == "dp" and mesh.size(names.index(n)) > 1]
        flat = _flattened(mesh, data) if len(data) > 1 else None
        if len(data) > 1 and flat is None:
            raise ValueError(
                f"mesh dimensions {data} are all data parallel; flatten them into one "
                f"(mesh[{tuple(data)!r}]._flatten('dp')) and pass a mesh with one data-parallel dimension"
            )
        groups = {role: mesh.get_group(name) for name, role in roles.items() if role != "dp"}
        if data:
            groups["dp"] = flat.get_group() if flat is not None else mesh.get_group(data[0])
        return cls.from_groups(tp_group=groups.get("tp"), pp_group=groups.get("pp"), dp_group=groups.get("dp"))

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    def _coord(self, name: str) -> int:
        coords = getattr(self, "_coords", None)
        if coords is not None:
            return coords[name]
        if name == "tp":
            return self.rank % self.tp_size
        if name == "dp":
            return (self.rank // self.tp_size) % self.dp_size
        return self.rank // (self.tp_size * self.dp_size)

    @property
    def edp_size(self) -> int:
        """The experts' data-parallel size: the ranks of a stage holding the same expert piece."""
        return self.tp_size * self.dp_size // (self.ep_size * self.etp_size)

    def _expert_coord(self, name: str) -> int:
        coords = getattr(self, "_coords", None)
        if coords is not None and name in coords:
            return coords[name]
        index = self.tp_rank + self.tp_size * self.dp_rank  # within the stage, Megatron's tp-ep-dp order
        if name == "etp":
            return index % self.etp_size
        if name == "ep":
            return (index // self.etp_size) % self.ep_size
        return index // (self.etp_size * self.ep_size)

    @property
    def ep_rank(self) -> int:
        """Which part of each expert layer's experts this rank holds (``ep_rank × E_local`` is its first)."""
        return self._expert_coord("ep")

    @property
    def etp_rank(self) -> int:
        return self._expert_coord("etp")

    @property
    def edp_rank(self) -> int:
        """This rank's index among the ranks that hold the same expert pieces (0: the canonical copy)."""
        return self._expert_coord("edp")

    @property
    def tp_rank(self) -> int:
        return self._coord("tp")

    @property
    def dp_rank(self) -> int:
        return self._coord("dp")

    @property
    def pp_rank(self) -> int:
        return self._coord("pp")

    @property
    def mp_rank_name(self) -> str:
        """Megatron's directory name: ``mp_rank_TT`` or ``mp_rank_TT_PPP`` with pipelining."""
        return mp_rank_name(self.tp_rank, self.pp_rank, self.pp_size)

    def rank_of(self, *, tp: int, pp: int, dp: int) -> int:
        """Global rank of the given coordinates in Megatron's order."""
        return tp + self.tp_size * (dp + self.dp_size * pp)

    def describe(self) -> dict[str, int]:
        """The sizes as stored in ``shardpoint.json`` (``ep``/``etp`` only where experts are split)."""
        sizes = {"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size}
        if self.ep_size > 1 or self.etp_size != self.tp_size:
            sizes.update(ep=self.ep_size, etp=self.etp_size)
        return sizes

    def dp_group(self) -> Any:
        """This rank's data-parallel group for shardpoint's own traffic: gloo, created on first use.

        Never the trainer's (NCCL) group: with :meth:`from_groups` the members are read
        from the trainer's group and mirrored on gloo. Creating groups is collective:
        every rank must call this the same number of times, which the Checkpointer
        guarantees by calling it from collective code only.
        """
        if "dp" not in self._groups:
            trainer = self._groups.get("trainer_dp")
            if "dp_members" in self._groups:  # read from a device mesh
                members = self._groups["dp_members"]
            elif trainer is not None:
                mine = sorted(dist.get_process_group_ranks(trainer))
                members = sorted({tuple(m) for m in comm.all_gather(mine)})
            else:
                members = [
                    [self.rank_of(tp=t, pp=p, dp=d) for d in range(self.dp_size)]
                    for p in range(self.pp_size)
                    for t in range(self.tp_size)
                ]
            self._groups["dp"] = self._build_groups([list(m) for m in members])
        return self._groups["dp"]

    def _build_groups(self, members: list[list[int]]) -> Any:
        if not _initialized() or all(len(m) == 1 for m in members):
            return None
        mine = None
        for ranks in members:
            group = comm.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine


# mesh dimension names that are not data parallel: the usual short ones and Lightning's ModelParallelStrategy's
_MESH_ROLES = {"tp": "tp", "pp": "pp", "tensor_parallel": "tp", "pipeline_parallel": "pp"}


def _flattened(mesh: Any, data: list[str]) -> Any:
    """The dimension a framework flattened all of ``data`` into (Accelerate, torchtitan: ``dp``, ``dp_cp``), or None.

    Flattened dimensions are looked up by those usual names; only one spanning every
    rank of ``data`` (its size is their product, each being > 1) is the data-parallel one.
    """
    size = math.prod(mesh.size(mesh.mesh_dim_names.index(n)) for n in data)
    for name in ("dp", "dp_cp", "dp_shard_cp"):
        try:
            sub = mesh[name]
        except KeyError:
            continue
        if sub.ndim == 1 and sub.size() == size:
            return sub
    return None


def _from_expert_mesh(cls: type[Topology], mesh: Any, names: tuple[str, ...]) -> Topology:
    """:meth:`Topology.from_mesh` of a mesh with an ``ep`` dimension: dense dp is every data dimension × ep."""
    roles = {n: _MESH_ROLES.get(n, "ep" if n == "ep" else "dp") for n in names}
    if len(names) != mesh.ndim or sum(role == "tp" for role in roles.values()) > 1:
        raise ValueError(f"Topology.from_mesh needs named dimensions with at most one tp, got {names}")
    sizes = {n: mesh.size(i) for i, n in enumerate(names)}
    coord = dict(zip(names, mesh.get_coordinate()))
    by_role = {role: [n for n in names if roles[n] == role] for role in ("tp", "pp", "ep", "dp")}
    dense_dp = [n for n in names if roles[n] in ("dp", "ep")]  # in mesh order: ep carved out of dp

    def size(role: str) -> int:
        return math.prod(sizes[n] for n in by_role[role])

    def flat(dims: list[str]) -> int:  # row-major index over ``dims``
        index = 0
        for n in dims:
            index = index * sizes[n] + coord[n]
        return index

    tp = size("tp")
    topo = cls(tp, size("pp"), size("dp") * size("ep"), rank=dist.get_rank(), ep_size=size("ep"), etp_size=tp)
    coords = {"tp": flat(by_role["tp"]), "pp": flat(by_role["pp"]), "dp": flat(dense_dp)}
    coords.update(ep=flat(by_role["ep"]), etp=coords["tp"], edp=flat(by_role["dp"]))
    object.__setattr__(topo, "_coords", coords)
    others = [names.index(n) for n in names if n not in dense_dp]
    ranks = mesh.mesh.permute(*others, *(names.index(n) for n in dense_dp)).reshape(-1, topo.dp_size)
    topo._groups["dp_members"] = [list(map(int, row)) for row in ranks.tolist()]
    return topo


def mp_rank_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _inferred_dp(tp_size: Any, pp_size: Any) -> int:
    """dp as Megatron computes it: the world size over tp × pp (1 without a process group).

    Raises:
        TopologyMismatchError: tp × pp does not divide the world size.
    """
    if not _initialized():
        return 1
    world = dist.get_world_size()
    if not isinstance(tp_size, int) or not isinstance(pp_size, int) or tp_size < 1 or pp_size < 1:
        return 1  # the size checks below name the bad value
    if world % (tp_size * pp_size):
        raise TopologyMismatchError(
            f"tp={tp_size} x pp={pp_size} does not divide the {world} ranks of the process group, so dp cannot "
            "be inferred; choose tp and pp whose product divides the world size, or give dp_size"
        )
    return world // (tp_size * pp_size)
