"""megatron-core's ``torch_dist`` format, read into the same global names as the legacy format.

An iteration directory holds DCP files (``.metadata``, ``__R_K.distcp``),
``metadata.json`` (``"sharded_backend": "torch_dist"``) and ``common.pt`` (args,
iteration, optimizer hyperparameters, scheduler). Differences from the legacy names,
undone here so both formats import to the same keys:

* uniform transformer layers are *stacked*: ``decoder.layers.<param>`` has a leading
  ``num_layers`` dim, split into ``decoder.layers.<i>.<param>``;
* with the local (non Transformer Engine) layer spec, layer norms are saved under
  the names Transformer Engine fuses them into (``self_attention.linear_qkv.layer_norm_*``
  for ``input_layernorm.*``, ``mlp.linear_fc1.layer_norm_*`` for ``pre_mlp_layernorm.*``);
* optimizer state is ``optimizer.state.<exp_avg|exp_avg_sq>.<param key>``, sharded
  like its parameter, and the step is ``common.pt``'s ``optimizer.state.common_step``;
* mixture-of-experts layers stack their experts over ``[layer, global expert]``; they
  are split into GPTModel's per-expert names with global ids, and the router's
  ``expert_bias`` is kept as a buffer (:mod:`.megatron_moe`).

Non-tensor objects (``ShardedObject``: RNG state, ``_extra_state``) are pickled
``torch.save`` bytes inside the DCP files; DCP would ``torch.load`` them with
``weights_only=False``, so the planner here reads them through
:func:`~shardpoint.foreign._unpickle.load_foreign` instead. DCP's ``.metadata`` is
read with the restricted unpickler.

With ``--use-distributed-optimizer`` the optimizer state is in bucket space
(``dp_reshardable``, Megatron's default) or in model space (``fully_reshardable``);
:mod:`.megatron_distopt` decodes both to per-parameter moments. Other layouts are
refused naming them; ``optimizer=False`` reads the weights of any of them.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardpoint.catalog.untrusted_json import check_member_name, read_json_object
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.foreign._types import ForeignCheckpoint, args_to_json
from shardpoint.foreign._unpickle import load_dcp_metadata_foreign, load_foreign
from shardpoint.foreign.megatron import rng_to_safe
from shardpoint.foreign.megatron_distopt import (
    MODEL_SPACE,
    decode_buckets,
    is_optimizer_key,
    settle_master,
    sharding_type,
    split_buckets,
)
from shardpoint.foreign.megatron_moe import (
    expert_parallel,
    is_buffer,
    is_expert,
    moe_rank,
    num_experts,
    refuse_moe,
    split_experts,
)
from shardpoint.foreign.structure import split_dim
from shardpoint.formats.dcp_metadata import check_stored_items
from shardpoint.offline import single_process

__all__ = ["LOCAL_SPEC_NAMES", "is_torch_dist_dir", "model_order", "read_torch_dist"]

log = logging.getLogger(__name__)

V = TypeVar("V")

_OPT = MODEL_SPACE  # optimizer.state.<exp_avg|exp_avg_sq|param>.<model key>
LOCAL_SPEC_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def is_torch_dist_dir(directory: str) -> bool:
    """True when ``directory`` holds ``metadata.json`` naming the ``torch_dist`` backend."""
    path = os.path.join(directory, "metadata.json")
    if not os.path.isfile(path):
        return False
    try:
        return read_json_object(path, "Megatron metadata.json").get("sharded_backend") == "torch_dist"
    except (OSError, CheckpointError):  # unreadable, too large, too deep, not an object: not a torch_dist dir
        return False


class _Reader(FileSystemReader):
    """DCP's reader with ``.metadata`` unpickled by the restricted unpickler, and checked against the files.

    Every stored item must lie in a file of the directory itself, within the file's real
    size, and the tensors may not claim more bytes than those files hold
    (:func:`~shardpoint.formats.dcp_metadata.check_stored_items`): the full-size tensors
    are allocated from ``.metadata``'s sizes before anything is read.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(self.path, ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = load_dcp_metadata_foreign(f.read(), path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing; the torch_dist checkpoint is incomplete") from None
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(f"{path} does not hold DCP metadata")
        check_stored_items(metadata, lambda name: _file_size(self.path, name, path), str(self.path))
        return metadata


def _file_size(directory: Any, name: str, metadata_path: str) -> int:
    """The real size of ``name``, a data file ``.metadata`` names: a plain file of ``directory``, or refused."""
    try:
        return os.path.getsize(os.path.join(directory, check_member_name(name, metadata_path)))
    except OSError as exc:
        raise CorruptCheckpointError(f"{metadata_path} names the data file {name!r}, unreadable: {exc}") from None


class _Planner(DefaultLoadPlanner):
    """Fills full-size tensors; pickled objects go through the allow-list loader."""

    def __init__(self, where: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.where = where
        self.objects: dict[str, Any] = {}

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        self.objects[fqn] = load_foreign(value.read(), f"{self.where} (object {fqn!r})")


def read_torch_dist(directory: str, optimizer: bool = True) -> ForeignCheckpoint:
    """Read a megatron-core ``torch_dist`` iteration directory into a :class:`ForeignCheckpoint`.

    ``optimizer=False`` reads the model weights only (no optimizer key is read or decoded).
    """
    common = load_foreign(os.path.join(directory, "common.pt"))
    args = common.get("args")
    refuse_moe(directory, args, buckets=False, grouped=True)  # GroupedMLP: SequentialMLP's keys
    reader = _Reader(directory)
    metadata = reader.read_metadata()
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            state[key] = None  # a pickled object: read by the planner's load_bytes
    if optimizer:
        layout = sharding_type(directory, common, args, list(state))
    else:
        layout, state = None, {k: v for k, v in state.items() if not is_optimizer_key(k)}
    planner = _Planner(directory)
    try:
        with single_process():
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as exc:  # DCP wraps each rank's error; ours (unsafe object) is re-raised as is
        error = next(iter(exc.failures.values()))[0]
        if isinstance(error, CheckpointError):
            raise error from None
        raise CorruptCheckpointError(f"cannot read {directory} ({type(error).__name__}: {error})") from None
    local_spec = getattr(args, "transformer_impl", "") == "local"
    num_layers = int(getattr(args, "num_layers", 0) or 0)
    ckpt = ForeignCheckpoint(
        tool="megatron",
        format="torch_dist",
        path=directory,
        iteration=int(common.get("iteration", 0)),
        tp=int(getattr(args, "tensor_model_parallel_size", 1) or 1),
        pp=int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
        dp=int(getattr(args, "data_parallel_size", 1) or 1),
        ep=expert_parallel(args),
        optimizer_sharding="distributed-optimizer" if getattr(args, "use_distributed_optimizer", False) else None,
        scheduler=dict(common.get("opt_param_scheduler") or {}),
        consumed_samples=getattr(args, "consumed_train_samples", None),
        args=args_to_json(args) if args is not None else {},
        extra={
            "checkpoint_version": common.get("checkpoint_version"),
            "num_floating_point_operations_so_far": common.get("num_floating_point_operations_so_far", 0),
            "optimizer_layout": layout,
        },
    )
    buckets = split_buckets(state)
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if value is None:
            continue
        match = _OPT.match(key)
        pairs = _unstack(key if not match else match.group(2), value, num_layers, local_spec)
        for name, tensor in split_experts(pairs, num_experts(args), directory):
            if match:
                moments.setdefault(name, {})[match.group(1)] = tensor
            else:
                ckpt.params[name] = tensor
                ckpt.split_dims[name] = split_dim(name)
    ckpt.params = model_order(ckpt.params)
    ckpt.buffers = [name for name in ckpt.params if is_buffer(name)]
    groups, step = _hyperparameters(common, layout)
    if buckets:
        trained = {n: t for n, t in ckpt.params.items() if n not in ckpt.buffers}
        moments, groups = decode_buckets(directory, args, trained, buckets, planner.objects)
        step = next((g["step"] for g in groups if g.get("step") is not None), None)
    for name in ckpt.params:
        entry = moments.pop(name, {})
        settle_master(name, entry, ckpt.params[name], directory)
        if entry and step is not None:
            entry["step"] = torch.as_tensor(step).clone()
        ckpt.optimizer[name] = entry
    if moments:
        raise CorruptCheckpointError(f"{directory}: optimizer state for unknown parameters {sorted(moments)[:3]}")
    ckpt.extra["rng_state"] = _rng_states(planner.objects)
    ckpt.param_groups = _groups(groups, ckpt.params, ckpt.buffers)
    return ckpt


def _hyperparameters(common: dict, layout: str | None) -> tuple[list[dict[str, Any]], Any]:
    """The optimizer's param groups and step in ``common.pt``: a plain optimizer's, or ``fully_reshardable``'s."""
    saved = common.get("optimizer") or {}
    if layout == "fully_reshardable":  # DistributedOptimizer.state_dict(): the step is in each group
        groups = list((saved.get("optimizer") or {}).get("param_groups") or [])
        return groups, next((g["step"] for g in groups if g.get("step") is not None), None)
    return list(saved.get("param_groups") or []), (saved.get("state") or {}).get("common_step")


def _rng_states(objects: dict[str, Any]) -> dict[str, Any]:
    """``rng_state/shard_<pp>.<tp>_<pp size>.<tp size>`` objects as the legacy reader's ``{"<tp>_<pp>": [...]}``."""
    found = {}
    for key, value in objects.items():
        match = re.fullmatch(r"rng_state/shard_(\d+)\.(\d+)_\d+\.\d+", key)
        if match:
            states = value if isinstance(value, list) else [value]
            if states and isinstance(states[0], list):  # the ShardedObject wraps the legacy list once more
                states = states[0]
            found[f"{int(match.group(2))}_{int(match.group(1))}"] = rng_to_safe(states)
    return found


def _unstack(key: str, value: torch.Tensor, num_layers: int, local_spec: bool) -> list[tuple[str, torch.Tensor]]:
    """``decoder.layers.<p>`` (stacked, leading layer dim) -> ``decoder.layers.<i>.<p>``; legacy names."""
    prefix, _, rest = key.partition("layers.")
    if not rest or rest[:1].isdigit() or not prefix.endswith(("decoder.", "encoder.", "")):
        return [(key, value)]
    if value.dim() == 0 or value.shape[0] != num_layers:
        raise CorruptCheckpointError(
            f"{key}: a stacked layer tensor should have {num_layers} layers in its first dim, "
            f"has shape {tuple(value.shape)}"
        )
    rest = LOCAL_SPEC_NAMES.get(rest, rest) if local_spec else rest
    return [(f"{prefix}layers.{i}.{rest}", value[i].clone()) for i in range(num_layers)]


def model_order(params: Mapping[str, V]) -> dict[str, V]:
    """GPTModel's parameter order (embedding, layers in order, final norm, output), as the legacy format has it."""

    def rank(name: str) -> tuple:
        match = re.search(r"layers\.(\d+)\.(.*)$", name)
        if name.startswith("embedding."):
            return (0, 0, _within_embedding(name))
        if match:
            return (1, int(match.group(1)), _within_layer(match.group(2)))
        return (2 if "final" in name else 3, 0, 0)

    return dict(sorted(params.items(), key=lambda item: rank(item[0])))


def _within_embedding(name: str) -> int:
    return 0 if "word_embeddings" in name else 1


_LAYER_ORDER = [
    "input_layernorm",
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "self_attention.q_layernorm",  # --qk-layernorm: SelfAttention builds the norms after linear_qkv
    "self_attention.k_layernorm",
    "pre_mlp_layernorm",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
]


def _within_layer(rest: str) -> tuple[int, ...]:
    for i, module in enumerate(_LAYER_ORDER):
        if rest.startswith(module + "."):
            return (2 * i, 0 if rest.endswith("weight") else 1)
    in_moe = moe_rank(rest)
    if in_moe is not None:  # a MoE layer's router, experts, shared experts: after pre_mlp_layernorm
        return (2 * _LAYER_ORDER.index("pre_mlp_layernorm") + 1, *in_moe)
    return (2 * len(_LAYER_ORDER), 0)


def _groups(groups: list[dict[str, Any]], params: dict[str, torch.Tensor], buffers: list[str]) -> list[dict[str, Any]]:
    """Each optimizer group with the names of its parameters, by Megatron's rule (no weight decay: biases, 1-dim).

    Groups of a MoE model's expert optimizer (``is_expert_parallel``) hold the experts, the
    others the rest; buffers are in none.
    """
    by_expert = any(g.get("is_expert_parallel") for g in groups)
    result = []
    for group in groups:
        no_wd = float(group.get("wd_mult", 1.0)) == 0.0
        names = [
            n
            for n, t in params.items()
            if n not in buffers
            and (n.endswith(".bias") or t.dim() == 1) == no_wd
            and (not by_expert or is_expert(n) == bool(group.get("is_expert_parallel")))
        ]
        result.append({k: v for k, v in group.items() if k not in ("params", "step")} | {"param_names": names})
    return result
