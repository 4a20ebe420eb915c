"""A GPT-2 split over tensor-parallel ranks and pipeline stages, Megatron style.

The architecture is GPT-2's, so a checkpoint exports to Hugging Face's
``GPT2LMHeadModel`` with identical logits: learned position embeddings, pre-LayerNorm
blocks, tanh-approximated GELU ("gelu_new"), a final LayerNorm, and the output head
tied to the word embedding.

One :class:`GPTModel` is one pipeline stage of one tensor-parallel rank: stage ``p``
holds layers ``p * L/pp .. (p+1) * L/pp - 1`` (their *global* numbers), the first
stage the embeddings, the last stage the final LayerNorm and the head. With more
than one stage the last stage keeps its own copy of the word embedding for the head;
the trainer all-reduces its gradient with the first stage's (the embedding group),
so the two copies stay equal, and both report it under the one global key
``embedding.word_embeddings.weight`` — the last stage's copy as a non-canonical
replica — so a checkpoint holds it once and any pipeline size can load it.

The attention's fused QKV weight is ordered head by head (``[heads, q|k|v, head_dim]``
rows), Megatron's order: a tensor-parallel rank's contiguous rows are then exactly
the q, k and v of its own heads, whatever the tp size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

import shardpoint as sp
from shardpoint.demo.cross_entropy import vocab_parallel_cross_entropy
from shardpoint.demo.parallel import ParallelState
from shardpoint.demo.rng_tracker import RNGTracker
from shardpoint.demo.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    master_init,
)

__all__ = ["WORD_EMBEDDINGS", "GPTConfig", "GPTModel"]

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape and regularisation.

    Args:
        num_layers: transformer blocks (divided over the pipeline stages).
        hidden_size: width of the residual stream.
        num_attention_heads: heads (divided over the tensor-parallel ranks).
        seq_length: context length, also the number of position embeddings.
        vocab_size: 256: one token per byte.
        ffn_hidden_size: MLP width (0: four times ``hidden_size``).
        hidden_dropout: dropout on embeddings and on each block's two outputs.
        attention_dropout: dropout on attention probabilities.
        layernorm_epsilon: LayerNorm's epsilon (GPT-2 uses 1e-5).
        init_std: standard deviation of the initial weights.
    """

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 64
    vocab_size: int = 256
    ffn_hidden_size: int = 0
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.ffn_hidden_size == 0:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {getattr(self, name)}")

    def check_layout(self, tp: int, pp: int) -> None:
        """Raise TopologyMismatchError, naming the size, if the model does not split over ``tp`` x ``pp``."""
        sp.divide(self.num_attention_heads, tp, "num_attention_heads")
        sp.divide(self.ffn_hidden_size, tp, "ffn_hidden_size")
        sp.divide(self.vocab_size, tp, "vocab_size")
        sp.divide(self.num_layers, pp, "num_layers")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def checkpoint_config(self) -> dict[str, Any]:
        """The arguments that define the tensors: stored in and checked against each checkpoint.

        Dropout is left out on purpose: a run may resume with another dropout.
        """
        return {k: v for k, v in asdict(self).items() if not k.endswith("dropout")}


class _LayerNorm(torch.nn.LayerNorm):
    """A replicated LayerNorm that knows its global key."""

    def __init__(self, key: str, cfg: GPTConfig, ps: ParallelState):
        super().__init__(cfg.hidden_size, eps=cfg.layernorm_epsilon, device=ps.device)
        self.key = key

    def sharded_state_dict(self) -> dict[str, Any]:
        return {f"{self.key}.weight": self.weight, f"{self.key}.bias": self.bias}


class ParallelAttention(torch.nn.Module):
    """Causal self-attention over this tp rank's heads."""

    def __init__(self, key: str, cfg: GPTConfig, ps: ParallelState, rng: RNGTracker, seed: int):
        super().__init__()
        h, out_std = cfg.hidden_size, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.cfg, self.rng = cfg, rng
        self.local_heads = sp.divide(cfg.num_attention_heads, ps.tp_size, "num_attention_heads")
        self.linear_qkv = ColumnParallelLinear(
            f"{key}.linear_qkv", master_init(f"{key}.linear_qkv.weight", (3 * h, h), cfg.init_std, seed), ps
        )
        self.linear_proj = RowParallelLinear(
            f"{key}.linear_proj", master_init(f"{key}.linear_proj.weight", (h, h), out_std, seed), ps
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.linear_qkv(x).view(batch, seq, self.local_heads, 3, self.cfg.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [batch, heads, seq, head_dim]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.cfg.head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        probs = self.rng.dropout(
            scores.softmax(dim=-1), self.cfg.attention_dropout, self.training, tensor_parallel=True
        )
        context = (probs @ v).transpose(1, 2).reshape(batch, seq, self.local_heads * self.cfg.head_dim)
        return self.linear_proj(context)

    def sharded_state_dict(self) -> dict[str, Any]:
        return {**self.linear_qkv.sharded_state_dict(), **self.linear_proj.sharded_state_dict()}


class ParallelMLP(torch.nn.Module):
    """``fc2(gelu_tanh(fc1(x)))`` with fc1 column- and fc2 row-parallel."""

    def __init__(self, key: str, cfg: GPTConfig, ps: ParallelState, seed: int):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.linear_fc1 = ColumnParallelLinear(
            f"{key}.linear_fc1", master_init(f"{key}.linear_fc1.weight", (f, h), cfg.init_std, seed), ps
        )
        self.linear_fc2 = RowParallelLinear(
            f"{key}.linear_fc2", master_init(f"{key}.linear_fc2.weight", (h, f), out_std, seed), ps
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))

    def sharded_state_dict(self) -> dict[str, Any]:
        return {**self.linear_fc1.sharded_state_dict(), **self.linear_fc2.sharded_state_dict()}


class TransformerLayer(torch.nn.Module):
    """A pre-LayerNorm GPT-2 block; ``number`` is its global index across all stages."""

    def __init__(self, number: int, cfg: GPTConfig, ps: ParallelState, rng: RNGTracker, seed: int):
        super().__init__()
        key = f"decoder.layers.{number}"
        self.cfg, self.rng = cfg, rng
        self.input_layernorm = _LayerNorm(f"{key}.input_layernorm", cfg, ps)
        self.self_attention = ParallelAttention(f"{key}.self_attention", cfg, ps, rng, seed)
        self.pre_mlp_layernorm = _LayerNorm(f"{key}.pre_mlp_layernorm", cfg, ps)
        self.mlp = ParallelMLP(f"{key}.mlp", cfg, ps, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.cfg.hidden_dropout
        x = x + self.rng.dropout(self.self_attention(self.input_layernorm(x)), p, self.training)
        return x + self.rng.dropout(self.mlp(self.pre_mlp_layernorm(x)), p, self.training)

    def sharded_state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in (self.input_layernorm, self.self_attention, self.pre_mlp_layernorm, self.mlp):
            out.update(part.sharded_state_dict())
        return out


class Embedding(torch.nn.Module):
    """Vocabulary-parallel word embeddings plus replicated learned position embeddings."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState, rng: RNGTracker, seed: int):
        super().__init__()
        self.cfg, self.rng = cfg, rng
        self.word_embeddings = VocabParallelEmbedding(
            "embedding.word_embeddings",
            master_init(WORD_EMBEDDINGS, (cfg.vocab_size, cfg.hidden_size), cfg.init_std, seed),
            ps,
        )
        positions = master_init(
            "embedding.position_embeddings.weight", (cfg.seq_length, cfg.hidden_size), cfg.init_std, seed
        )
        self.position_embeddings = torch.nn.Embedding.from_pretrained(positions.to(ps.device), freeze=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)
        return self.rng.dropout(x, self.cfg.hidden_dropout, self.training)

    def sharded_state_dict(self) -> dict[str, Any]:
        return {
            **self.word_embeddings.sharded_state_dict(),
            "embedding.position_embeddings.weight": self.position_embeddings.weight,
        }


class GPTModel(torch.nn.Module):
    """One pipeline stage of the GPT on one tensor-parallel rank.

    Args:
        cfg: the model's shape.
        ps: this rank's parallel state.
        rng: the dropout streams (see :mod:`shardpoint.demo.rng_tracker`).
        seed: seeds the initial weights (the same full weights at every layout).

    Raises:
        TopologyMismatchError: a size does not divide over the layout (layers over
            pp; heads, vocabulary or MLP width over tp).
    """

    def __init__(self, cfg: GPTConfig, ps: ParallelState, rng: RNGTracker, seed: int = 1234):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        cfg.check_layout(ps.tp_size, ps.pp_size)
        per_stage = cfg.num_layers // ps.pp_size
        first = ps.pp_rank * per_stage
        self.embedding = Embedding(cfg, ps, rng, seed) if ps.is_first_stage else None
        self.layers = torch.nn.ModuleList(TransformerLayer(first + i, cfg, ps, rng, seed) for i in range(per_stage))
        self.final_layernorm = _LayerNorm("decoder.final_layernorm", cfg, ps) if ps.is_last_stage else None
        self.output_weight: torch.nn.Parameter | None = None
        if ps.is_last_stage and not ps.is_first_stage:
            head = VocabParallelEmbedding(
                "embedding.word_embeddings",
                master_init(WORD_EMBEDDINGS, (cfg.vocab_size, cfg.hidden_size), cfg.init_std, seed),
                ps,
            )
            self.output_weight = head.weight

    def forward(self, hidden: torch.Tensor | None, tokens: torch.Tensor | None) -> torch.Tensor:
        """This stage's part: embed ``tokens`` on the first stage, else continue from ``hidden``."""
        x = self.embedding(tokens) if self.embedding is not None else hidden
        if x is None:
            raise ValueError(f"pipeline stage {self.ps.pp_rank} needs the previous stage's hidden states")
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x) if self.final_layernorm is not None else x

    def word_embeddings_weight(self) -> torch.nn.Parameter | None:
        """The tied embedding this stage holds (first or last stage), else None."""
        if self.embedding is not None:
            return self.embedding.word_embeddings.weight
        return self.output_weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last stage: this tp rank's vocabulary slice of the logits."""
        weight = self.word_embeddings_weight()
        if weight is None:
            raise ValueError(f"pipeline stage {self.ps.pp_rank} holds no output weights: logits are the last stage's")
        return F.linear(copy_to_tp(hidden, self.ps.tp_group), weight)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Last stage: mean next-token cross-entropy over the micro-batch."""
        vocab_start = self.ps.tp_rank * (self.cfg.vocab_size // self.ps.tp_size)
        return vocab_parallel_cross_entropy(self.logits(hidden), labels, vocab_start, self.ps.tp_group).mean()

    def sharded_state_dict(self) -> dict[str, Any]:
        """Every tensor of this stage under its global key (see the module docstring)."""
        out: dict[str, Any] = {}
        if self.embedding is not None:
            out.update(self.embedding.sharded_state_dict())
        for layer in self.layers:
            if not isinstance(layer, TransformerLayer):
                raise TypeError(f"{type(layer).__name__} among the decoder layers, which are TransformerLayers")
            out.update(layer.sharded_state_dict())
        if self.final_layernorm is not None:
            out.update(self.final_layernorm.sharded_state_dict())
        if self.output_weight is not None:
            topo = self.ps.topology
            out[WORD_EMBEDDINGS] = sp.shard_along(
                self.output_weight, 0, topo.tp_rank, topo.tp_size, replica_id=1 + topo.dp_rank
            )
        return out
