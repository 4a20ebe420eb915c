"""The padded vocabulary when a resume changes tensor parallelism.

Megatron-LM pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by`` ×
tp (``_vocab_size_with_padding``), so the embedding and output layer have another
number of rows at another tp: 50 tokens are 64 rows at tp=2 and 56 at tp=1 with
``--make-vocab-size-divisible-by 8``. Megatron's own loader refuses the other shape;
its offline converter (``tools/checkpoint/saver_*.py``) trims the extra rows, or pads
by repeating the last saved row. A resume does the same here:

* the rows both sizes share are read in place (the job's tensors are asked for at the
  saved size, clipped to the rows they hold); a rank whose rows are all new reads none;
* rows beyond the saved ones take the last saved row, as Megatron's converter does
  (one all-reduce of one row in the tensor-parallel group, which holds it on one rank);
  their Adam moments start at zero and fp32 master copies take the new rows' values;
* trimmed rows must be padding. The true vocabulary is recorded at save when Megatron
  knows it (``--vocab-size`` or its tokenizer); otherwise the saved padding bounds it
  (fewer than ``make_vocab_size_divisible_by`` × tp rows of padding). A trim that
  would drop a real token is refused by name before anything is read.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch

from shardpoint.catalog.metadata import MARKER_NAME, CheckpointMetadata
from shardpoint.errors import ShapeMismatchError
from shardpoint.state.sharding import Shard

__all__ = [
    "VOCAB_ARGS",
    "VOCAB_KEYS",
    "PaddedVocabularyError",
    "VocabPadding",
    "fill_state",
    "kept_rows",
    "saved_vocab",
    "vocab_config",
]

log = logging.getLogger(__name__)

# Megatron's keys of the tensors whose rows are the padded vocabulary (a tied output layer uses the embedding's)
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
VOCAB_ARGS = ("padded_vocab_size", "vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size")


class PaddedVocabularyError(ShapeMismatchError):
    """The saved vocabulary cannot become this job's: trimming would drop real tokens."""


def true_vocab(args: argparse.Namespace) -> int | None:
    """The unpadded vocabulary: the tokenizer Megatron-LM built (its ``NullTokenizer`` adds an end-of-document
    token to ``--vocab-size``), else ``--vocab-size``, else unknown."""
    try:
        from megatron.training import global_vars

        tokenizer = getattr(global_vars, "_GLOBAL_TOKENIZER", None)
        if tokenizer is not None:
            return int(tokenizer.vocab_size)
    except (ImportError, AttributeError, NotImplementedError, TypeError):
        pass
    return int(args.vocab_size) if getattr(args, "vocab_size", None) else None


def vocab_config(args: argparse.Namespace) -> dict[str, Any]:
    """What a save records of the vocabulary (in the marker's config; never compared on load)."""
    config = {k: getattr(args, k) for k in VOCAB_ARGS if isinstance(getattr(args, k, None), int)}
    vocab = true_vocab(args)
    if vocab is not None:
        config["vocab_size"] = vocab
    return config if "padded_vocab_size" in config else {}


def saved_vocab(checkpoint: str | None) -> dict[str, Any]:
    """The vocabulary fields of the marker of ``checkpoint`` (a local directory), or ``{}``."""
    if not checkpoint or not os.path.isfile(os.path.join(checkpoint, MARKER_NAME)):
        return {}
    with open(os.path.join(checkpoint, MARKER_NAME), "rb") as f:
        meta = CheckpointMetadata.from_json(f.read(), os.path.join(checkpoint, MARKER_NAME))
    config = {k: meta.config[k] for k in VOCAB_ARGS if isinstance(meta.config.get(k), int)}
    if "tensor_model_parallel_size" not in config and isinstance(meta.topology.get("tp"), int):
        config["tensor_model_parallel_size"] = meta.topology["tp"]
    return config


def padding_for(checkpoint: str, saved: dict[str, Any], args: argparse.Namespace) -> VocabPadding | None:
    """The :class:`VocabPadding` a load of ``checkpoint`` needs, None when the rows agree.

    Raises:
        PaddedVocabularyError: the job's rows would trim real tokens of the saved vocabulary.
    """
    rows, here = saved.get("padded_vocab_size"), getattr(args, "padded_vocab_size", None)
    if not isinstance(rows, int) or not isinstance(here, int) or rows == here:
        return None
    vocab = saved.get("vocab_size") or true_vocab(args)
    if here < rows:
        # without the true vocabulary, the saved padding bounds it: fewer rows than one padding multiple
        multiple = int(saved.get("make_vocab_size_divisible_by", 1)) * int(saved.get("tensor_model_parallel_size", 1))
        real = vocab if vocab is not None else rows - multiple + 1
        if here < real:
            known = f"{vocab} tokens" if vocab is not None else f"at least {real} tokens (its padding is < {multiple})"
            raise PaddedVocabularyError(
                f"{checkpoint}: embedding.word_embeddings.weight and output_layer.weight have {rows} rows "
                f"({known}, padded at tp={saved.get('tensor_model_parallel_size')}); this job's padded vocabulary "
                f"is {here} rows, so rows {here}..{rows - 1} would be dropped, and real tokens are among them: use the "
                "tokenizer the checkpoint was trained with (or its --make-vocab-size-divisible-by)"
            )
    log.info("megatron: the padded vocabulary goes from %d rows (saved) to %d (this tp): %s", rows, here, checkpoint)
    return VocabPadding(rows)


class VocabPadding:
    """Asks for the vocabulary tensors at their saved rows, then fills the rows the saved ones lack."""

    def __init__(self, saved_rows: int):
        self.saved_rows = saved_rows
        # (key, the job's whole piece, its first global row, the job's global rows)
        self.pieces: list[tuple[str, torch.Tensor, int, int]] = []
        self.filled = False

    def reset(self) -> None:
        """Before the model's shards are collected again."""
        self.pieces.clear()
        self.filled = False

    def shard(self, key: str, sh: Shard) -> Shard | None:
        """``sh`` clipped to the saved rows, at the saved global shape; None when it holds no saved row."""
        first, rows = sh.global_offset[0], sh.global_shape[0]
        self.pieces.append((key, sh.tensor, first, rows))
        kept = kept_rows(sh.tensor, first, self.saved_rows)
        shape = (self.saved_rows, *tuple(sh.global_shape)[1:])
        return Shard(sh.tensor[:kept], shape, tuple(sh.global_offset), sh.replica_id) if kept else None

    def fill_model(self) -> None:
        """Rows past the saved ones take the last saved row (Megatron's converter pads so); once per load.

        Every rank of a tensor-parallel group holds a piece of the same keys, so the rows
        are summed first for every key (one rank contributes each), then written.
        """
        if self.filled:
            return
        self.filled = True
        grown = sorted((p for p in self.pieces if p[3] > self.saved_rows), key=lambda piece: piece[0])
        rows = [self._last_row(data, first) for _, data, first, _ in grown]
        with torch.no_grad():
            for (_, data, first, _), row in zip(grown, rows):
                start = max(0, self.saved_rows - first)
                if start < data.shape[0]:
                    data[start:].copy_(row.expand_as(data[start:]))

    def _last_row(self, data: torch.Tensor, first: int) -> torch.Tensor:
        """The last saved row of the tensor ``data`` is a piece of, from whichever tp rank holds it."""
        last = self.saved_rows - 1
        row = torch.zeros(data.shape[1:], dtype=torch.float64)  # bf16 summed exactly: one rank contributes
        if first <= last < first + data.shape[0]:
            row.copy_(data[last - first].detach())
        group = _tp_group()
        if group is not None:
            torch.distributed.all_reduce(row, group=group)
        return row.to(data.dtype)


def kept_rows(piece: torch.Tensor, first: int, saved_rows: int) -> int:
    """How many leading rows of ``piece`` (global rows from ``first``) the checkpoint holds."""
    return max(0, min(first + piece.shape[0], saved_rows) - first)


def fill_state(state: torch.Tensor, kept: int, param: torch.Tensor, master: bool) -> None:
    """An optimizer tensor's rows past the saved vocabulary: a master copy takes the parameter's, moments zero."""
    if kept < state.shape[0]:
        with torch.no_grad():
            state[kept:].copy_(param[kept:]) if master else state[kept:].zero_()


def _tp_group() -> Any:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    return group if group is not None and group.size() > 1 else None
