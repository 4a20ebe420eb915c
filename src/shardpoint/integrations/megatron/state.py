"""megatron-core's training objects seen as a :class:`~shardpoint.TrainState`.

* The model: each chunk's ``sharded_state_dict()`` (``ShardedTensor`` boxes with the
  global layer axis of stacked layers prepended, ``ShardedTensorFactory`` such as the
  SwiGLU split) becomes :class:`~shardpoint.state.sharding.Shard` values under the
  model's own parameter names with *global* layer and expert numbers:
  ``decoder.layers.<global layer>.self_attention.linear_qkv.weight``. These are the names
  ``shardpoint convert --from megatron`` gives a Megatron checkpoint, so a live
  checkpoint, an imported one and the CLI agree. ``ShardedObject`` values (Transformer
  Engine's ``_extra_state``) are stored as bytes beside the tensors (:mod:`.objects`).
* The distributed optimizer: each data-parallel rank owns a contiguous range of each
  parameter's flattened gradient buffer, which is not a box of the parameter. The
  ranges are summed over the optimizer's data-parallel group into whole tensor-parallel
  pieces (the parameter's own box), declared as data-parallel replicas, so the moments
  are stored as ``optimizer.state.<param>.exp_avg`` like any optimizer's and reshard
  with their parameter; a load copies each rank's range back. fp32 master weights of
  bf16/fp16 parameters are stored as ``<param>.master_param`` (the converter's name).
  Without ``--use-distributed-optimizer`` the same names hold the state of megatron-core's
  plain optimizers (:mod:`.plain_optimizer`); :func:`optimizer_state` picks the view.
* The tensor-parallel RNG tracker and the CUDA generator: per-rank state
  (``TrainState.stateful``), restored at the same layout only, as Megatron does.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from shardpoint.state.sharding import Shard
from shardpoint.state.train_state import find_param, param_shard_index

from .plain_optimizer import OptimizerAdapter, PlainOptimizerState, inner_optimizers, is_distributed, is_plain, refuse
from .vocab import VOCAB_KEYS, VocabPadding, fill_state

__all__ = ["DistributedOptimizerState", "MegatronModel", "MegatronRng", "optimizer_state", "unwrap"]

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / Float16Module wrappers (each keeps it in ``.module``)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _storage(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride())


def _is_main(replica_id: Any) -> bool:
    return all(r == 0 for r in replica_id) if isinstance(replica_id, tuple) else replica_id == 0


def _globalize(name: str, prepended: tuple[int, ...]) -> str:
    """Replace the first ``len(prepended)`` numbers of ``name`` (local layer, local expert) by the global ones."""
    numbers = iter(prepended)

    def swap(match: re.Match) -> str:
        return str(next(numbers, match.group(0)))

    return _NUMBER.sub(swap, name, count=len(prepended))


def _leaves(value: Any) -> Any:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


class MegatronModel(torch.nn.Module):
    """The model chunks of a Megatron job, with ``sharded_state_dict()`` in shardpoint's terms.

    A module (not only a view) so that ``parameters()`` reaches the chunks' parameters.
    """

    def __init__(self, chunks: list[torch.nn.Module], vocab: VocabPadding | None = None):
        """``vocab``: a load whose checkpoint has another padded vocabulary (see :mod:`.vocab`)."""
        super().__init__()
        self.chunks = torch.nn.ModuleList([unwrap(c) for c in chunks])
        self.vocab = vocab
        # a vocabulary parameter's storage -> (key, its shard clipped to the saved rows, or None: no saved row here)
        self.resized: dict[tuple, tuple[str, Shard | None]] = {}
        self._skipped_logged = False

    def sharded_state_dict(self) -> dict[str, Shard]:
        shards: dict[str, Shard] = {}
        self.resized.clear()
        if self.vocab is not None:
            self.vocab.reset()
        skipped = []
        for chunk in self.chunks:
            names = {_storage(t): n for n, t in [*chunk.named_parameters(), *chunk.named_buffers()] if t is not None}
            megatron_module: Any = chunk  # a Megatron MegatronModule; torch's Module type does not know the method
            for value in _leaves(megatron_module.sharded_state_dict()):
                kind = type(value).__name__
                if kind == "ShardedTensorFactory":
                    self._add_factory(value, names, shards)
                elif kind == "ShardedTensor" and value.prepend_axis_num == 0:
                    self._add(value, value.key, shards)  # Megatron's global key (a tied output layer: the embedding's)
                elif kind == "ShardedTensor":  # a stacked layer's piece: its parameter's name, numbered globally
                    self._add(value, names.get(_storage(value.data), value.key), shards)
                elif kind != "ShardedObject":  # objects: see .objects
                    skipped.append(getattr(value, "key", kind))
        if skipped and not self._skipped_logged:
            self._skipped_logged = True
            log.info("megatron: not stored (no tensor data in them): %s", ", ".join(sorted(set(skipped))[:8]))
        return shards

    def _add(self, sh: Any, name: str, shards: dict[str, Shard], suffix: str = "") -> None:
        if sh.flattened_range is not None:
            raise NotImplementedError(f"{sh.key}: ShardedTensor.flattened_range is not supported")
        n = sh.prepend_axis_num
        key = _globalize(name, tuple(sh.global_offset[:n])) + suffix
        replica = 0 if _is_main(sh.replica_id) else 1
        shard = Shard(sh.data, sh.global_shape[n:], sh.global_offset[n:], replica)
        if self.vocab is not None and key in VOCAB_KEYS and shard.global_shape[0] != self.vocab.saved_rows:
            clipped = self.vocab.shard(key, shard)
            self.resized[_storage(sh.data)] = (key, clipped)
            if clipped is None:
                return
            shard = clipped
        shards[key] = shard

    def _add_factory(self, factory: Any, names: dict, shards: dict[str, Shard]) -> None:
        """A factory (SwiGLU's [gate; up] split) stores its pieces under ``<param>_w``, ``<param>_v`` ..."""
        name = names.get(_storage(factory.data), factory.key)
        for piece in _leaves(factory.build()):
            suffix = piece.key[len(factory.key) :] if piece.key.startswith(factory.key) else "." + piece.key
            self._add(piece, name, shards, suffix)


def optimizer_state(
    optimizer: Any, model: MegatronModel | None = None
) -> DistributedOptimizerState | PlainOptimizerState:
    """shardpoint's view of a Megatron optimizer: distributed (``--use-distributed-optimizer``) or not.

    ``model``: the view of the model whose shards the state follows (its vocabulary
    tensors may be clipped to a checkpoint's rows, see :mod:`.vocab`).

    Raises:
        UnsupportedOptimizerError: another optimizer, or a chain mixing both kinds (before any write).
    """
    inner = inner_optimizers(optimizer)
    if all(is_distributed(opt) for opt in inner):
        return DistributedOptimizerState(optimizer, model)
    if all(is_plain(opt) for opt in inner):
        return PlainOptimizerState(optimizer, model)
    raise refuse(optimizer)


class DistributedOptimizerState(OptimizerAdapter):
    """megatron-core's (chained) ``DistributedOptimizer`` as a shardpoint distributed optimizer.

    ``sharded_state_dict(model_shards)`` and ``load_sharded_state_dict(loaded)`` are the
    two calls :func:`~shardpoint.state.train_state.collect` and the load pipeline make.
    """

    def __init__(self, optimizer: Any, model: MegatronModel | None = None):
        self.optimizer = optimizer
        self.model = model
        self.inner = inner_optimizers(optimizer)
        if not all(is_distributed(opt) for opt in self.inner):
            raise refuse(optimizer)
        self._targets: list[tuple[Any, torch.nn.Parameter, dict[str, torch.Tensor], Any]] = []
        self._padded: list[tuple[torch.nn.Parameter, dict[str, torch.Tensor], int]] = []  # rows past the saved
        self._steps_loaded: dict[str, Shard] = {}

    def sharded_state_dict(self, model_shards: dict[str, Shard]) -> dict[str, Shard]:
        index = {**param_shard_index(model_shards), **(self.model.resized if self.model is not None else {})}
        out: dict[str, Shard] = {}
        self._targets, self._padded = [], []
        for opt in self.inner:
            self._ensure_state(opt)
            out.update(self._gathered(opt, index))
        return out

    def _gathered(self, opt: Any, index: dict) -> dict[str, Shard]:
        """Each parameter's state as whole tensor-parallel pieces (summed over the DP group)."""
        group = opt.data_parallel_group
        dp_rank = torch.distributed.get_rank(group)
        params = [p for buffer in opt.buffers for p in buffer.params]  # the same on every DP rank, in one order
        owned = [p for p in params if p in opt.model_param_group_index_map]  # those with a range here
        names = self._state_names(opt, owned, params)
        total = sum(p.numel() for p in params)
        flat = {n: torch.zeros(total, dtype=torch.float32, device=params[0].device) for n in names} if params else {}
        offset, views = 0, []
        for p in params:
            rng = opt._get_model_param_range_map(p)["param"] if p in opt.model_param_group_index_map else None
            if rng is not None:
                tensors = opt._get_main_param_and_optimizer_states(p)
                for n in names:
                    src = tensors["param"] if n == "master_param" else tensors[n]
                    flat[n][offset + rng.start : offset + rng.end].copy_(src.view(-1))
            views.append((p, offset, rng))
            offset += p.numel()
        for n in names:
            torch.distributed.all_reduce(flat[n], group=group)
        out = {}
        for p, start, rng in views:
            key, shard = find_param(index, p)
            full = {n: flat[n][start : start + p.numel()].view(p.shape) for n in names}
            kept = p.shape[0] if shard is None or shard.tensor.shape == p.shape else shard.tensor.shape[0]
            if shard is None or kept < p.shape[0]:  # a vocabulary clipped to a checkpoint's rows
                self._padded.append((p, full, 0 if shard is None else kept))
            for n, t in full.items():
                if shard is not None:
                    out[f"{key}.{n}"] = Shard(
                        t[:kept], shard.global_shape, shard.global_offset, dp_rank or shard.replica_id
                    )
            if rng is not None:
                self._targets.append((opt, p, full, rng))
        out.update(self._steps(opt, index, views, dp_rank))
        return out

    def _steps(self, opt: Any, index: dict, views: list, dp_rank: int) -> dict[str, Shard]:
        """Adam's step per parameter (a scalar every holder agrees on), as the converter stores it."""
        step = next((opt._get_main_param_and_optimizer_states(p).get("step") for p, _, r in views if r), None)
        if step is None:
            return {}
        scalar = step.detach().reshape(()).to(torch.float32)
        out = {}
        for p, _, _ in views:
            key, shard = find_param(index, p)
            if shard is None:
                continue
            main = dp_rank == 0 and shard.replica_id == 0 and not any(shard.global_offset)
            out[f"{key}.step"] = Shard(scalar.clone(), (), (), 0 if main else 1)
        self._steps_loaded = out
        return out

    @staticmethod
    def _state_names(opt: Any, owned: list[torch.nn.Parameter], params: list[torch.nn.Parameter]) -> list[str]:
        if not owned:
            return []
        tensors = opt._get_main_param_and_optimizer_states(owned[0])
        names = [n for n, t in tensors.items() if n not in ("param", "step") and isinstance(t, torch.Tensor)]
        if any(p.dtype != torch.float32 for p in params):
            names.append("master_param")  # fp32 master weights beside bf16/fp16 parameters
        return sorted(names)

    @staticmethod
    def _ensure_state(opt: Any) -> None:
        """Adam's moments exist only after a step: create them (zeros) so a load has targets."""
        inner = opt.optimizer
        if all(inner.state.get(p) for g in inner.param_groups for p in g["params"]):
            return
        opt._init_optimizer_states_with_dummy_values()

    def load_sharded_state_dict(self, loaded: dict[str, Shard]) -> None:
        """Copy each rank's range of the loaded whole pieces back into the optimizer.

        Rows past a checkpoint's vocabulary are filled first: the model's (see
        :meth:`.vocab.VocabPadding.fill_model`), then moments zero and master copies from them.
        """
        if self.model is not None and self.model.vocab is not None:  # on every tp rank, padded here or not
            self.model.vocab.fill_model()
        for p, full, kept in self._padded:
            for n, t in full.items():
                fill_state(t, kept, p.data, master=n == "master_param")
        step = next(iter(self._steps_loaded.values()), None)
        for opt, p, full, rng in self._targets:
            tensors = opt._get_main_param_and_optimizer_states(p)
            if step is not None and isinstance(tensors.get("step"), torch.Tensor):
                tensors["step"].copy_(step.tensor.to(tensors["step"].dtype).reshape(tensors["step"].shape))
            for n, t in full.items():
                dst = tensors["param"] if n == "master_param" else tensors[n]
                dst.view(-1).copy_(t.reshape(-1)[rng.start : rng.end])


class MegatronRng:
    """The tensor-parallel RNG tracker's states and this rank's CUDA generator (per rank)."""

    def state_dict(self) -> dict[str, Any]:
        from megatron.core import tensor_parallel

        state: dict[str, Any] = {"tracker": dict(tensor_parallel.get_cuda_rng_tracker().get_states())}
        try:
            state["cuda"] = torch.cuda.get_rng_state()
        except (RuntimeError, AssertionError, AttributeError):  # no CUDA generator on this machine
            pass
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
        if "cuda" in state:
            try:
                torch.cuda.set_rng_state(state["cuda"])
            except (RuntimeError, AssertionError, AttributeError):
                log.warning("megatron: the saved CUDA RNG state was not restored (no CUDA generator here)")
