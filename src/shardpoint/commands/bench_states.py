"""The states ``shardpoint bench`` saves: synthetic GPT-like ones and ranks of real models' shapes."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "GPT_SHAPES",
    "PRESET_DTYPES",
    "PRESET_KINDS",
    "SHAPE_PRESETS",
    "is_expert_key",
    "preset_state",
    "sharded_train_state",
    "state_bytes",
    "synthetic_state",
]

GPT_SHAPES = [("attn.qkv", (3, 1)), ("attn.proj", (1, 1)), ("mlp.fc1", (4, 1)), ("mlp.fc2", (1, 4))]

# One tensor-parallel rank's tensors of a real model (Llama-like: SwiGLU, RMSNorm), per layer:
# the shapes are those of that rank; the number of layers follows --size.
SHAPE_PRESETS: dict[str, list[tuple[str, tuple[int, ...]]]] = {
    "7b-tp8": [
        ("attn.qkv", (1536, 4096)),
        ("attn.proj", (4096, 512)),
        ("mlp.fc1", (2752, 4096)),
        ("mlp.fc2", (4096, 1376)),
        ("input_norm", (4096,)),
        ("post_attn_norm", (4096,)),
    ],
    "1b-tp2": [
        ("attn.qkv", (3072, 2048)),
        ("attn.proj", (2048, 1024)),
        ("mlp.fc1", (5632, 2048)),
        ("mlp.fc2", (2048, 2816)),
        ("input_norm", (2048,)),
        ("post_attn_norm", (2048,)),
    ],
    # equal 8 MiB tensors (weight and moments): 512 MiB is 64 tensors, a rank with few, large tensors
    "uniform-8mib": [("block", (1024, 2048))],
    # one expert-parallel rank of a mixture-of-experts model: 32 local experts of three bf16
    # matrices per layer plus attention; 512 MB is 24 layers, about 7,000 items with Adam's moments.
    # Experts are whole tensors under their global id (Megatron's SequentialMLP convention):
    # at --ranks 4 that is ep=4, and the reshard phases load them at ep=2 and ep=1
    "moe": [
        ("attn.qkv", (384, 1024)),
        ("attn.proj", (1024, 128)),
        ("input_norm", (1024,)),
        *[(f"experts.{e}.{w}", (64, 512) if w != "w2" else (512, 64)) for e in range(32) for w in ("w1", "w2", "w3")],
    ],
    # 10,000 tensors of 256 fp32 values, whatever --size says: the fixed cost per item alone
    "many-small": [(f"t{i}", (256,)) for i in range(10_000)],
}
PRESET_DTYPES = {"moe": torch.bfloat16}
PRESET_KINDS = {"many-small": ("weight",)}  # others: a weight and Adam's two moments


def synthetic_state(total_bytes: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's shard of a GPT-like model's weights and Adam moments (fp32).

    The shapes depend on ``total_bytes`` only, so checkpoints written by ``world``
    ranks and by ``world // 2`` ranks hold the same global tensors.
    """
    elements_per_h2 = sum(a * b for _, (a, b) in GPT_SHAPES)
    hidden = next((h for h in (512, 256, 128) if elements_per_h2 * h * h * 12 <= total_bytes / 2), 64)
    layers = max(1, round(total_bytes / (elements_per_h2 * hidden * hidden * 12)))
    gen = torch.Generator().manual_seed(rank)
    state: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for name, (rows, cols) in GPT_SHAPES:
            shape = (rows * hidden // world, cols * hidden)
            for kind in ("weight", "exp_avg", "exp_avg_sq"):
                state[f"layers.{layer}.{name}.{kind}"] = torch.rand(shape, generator=gen)
    return state


def preset_state(preset: str, total_bytes: int, rank: int, world: int, main_world: int) -> dict[str, torch.Tensor]:
    """This rank's tensors shaped like a rank of a real tensor-parallel job (see ``SHAPE_PRESETS``).

    At ``main_world`` ranks each holds exactly the preset's shapes (split along dim 0
    of the global tensors); at other world sizes the same global tensors are split anew.
    """
    shapes = SHAPE_PRESETS[preset]
    dtype = PRESET_DTYPES.get(preset, torch.float32)
    kinds = PRESET_KINDS.get(preset, ("weight", "exp_avg", "exp_avg_sq"))
    layer_bytes = sum(math.prod(shape) for _, shape in shapes) * dtype.itemsize * len(kinds) * main_world
    layers = 1 if preset == "many-small" else max(1, round(total_bytes / layer_bytes))
    gen = torch.Generator().manual_seed(rank)
    state: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for name, shape in _rank_shapes(shapes, rank, world, main_world):
            for kind in kinds:
                state[f"layers.{layer}.{name}.{kind}"] = torch.rand(shape, generator=gen).to(dtype)
    return state


def _rank_shapes(
    shapes: list[tuple[str, tuple[int, ...]]], rank: int, world: int, main_world: int
) -> list[tuple[str, tuple[int, ...]]]:
    """This rank's names and shapes: dim 0 split anew, or whole experts renumbered (global ids) for ``world``."""
    out = [(name, (shape[0] * main_world // world, *shape[1:])) for name, shape in shapes if not is_expert_key(name)]
    experts = [(name.split(".", 2), shape) for name, shape in shapes if is_expert_key(name)]
    local = len({e for (_, e, _), _ in experts}) * main_world // world  # local experts at this world size
    for e in range(rank * local, (rank + 1) * local):
        out += [(f"experts.{e}.{w}", shape) for (_, first, w), shape in experts if first == "0"]
    return out


def is_expert_key(key: str) -> bool:
    """A whole expert's tensor, held by the one rank that owns that expert (not split over ranks)."""
    return "experts." in key


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in state.values())


def sharded_train_state(tensors: dict[str, torch.Tensor], world: int) -> Any:
    """``(topology, TrainState)`` declaring ``tensors`` as this rank's column-parallel shards of ``world`` ranks."""
    import shardpoint as sp

    topo = sp.Topology(world, 1, 1)

    class Model(torch.nn.Module):
        def sharded_state_dict(self) -> dict[str, Any]:
            return {k: t if is_expert_key(k) else sp.column_parallel(t, topo) for k, t in tensors.items()}

    return topo, sp.TrainState(Model())
