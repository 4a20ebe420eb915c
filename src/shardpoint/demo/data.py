"""Training data that needs no download, and resumes exactly at any data-parallel size.

The corpus is the Python standard library's own top-level ``.py`` files, read in
sorted order: present on every Python install, identical on every rank. Tokens are
bytes (a vocabulary of 256).

Sample ``i`` of the global stream is a window of ``seq_length + 1`` bytes whose start
is a hash of ``(seed, i)``: a pure function of ``i``, so no sampler state has to be
checkpointed. Step ``t`` (1-based) uses the global batch of samples
``consumed .. consumed + global_batch - 1`` where ``consumed`` is the samples consumed
before it (``TrainState.extra["consumed_samples"]``, as Megatron's
``MegatronPretrainingSampler``); data-parallel rank ``r`` takes the ``r``-th contiguous
slice and cuts it into micro-batches. A resumed run, at any dp size that divides the
global batch, therefore sees exactly the samples the uninterrupted run saw.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch

import shardpoint as sp

__all__ = ["SampleStream", "load_corpus", "micro_batches"]

_MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int = 1 << 21) -> torch.Tensor:
    """The first ``max_bytes`` of the sorted standard-library sources, as a uint8 tensor."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"\n".join(chunks)[:max_bytes]
    if len(corpus) < 4096:
        raise RuntimeError(f"the standard library under {stdlib} holds too little source to train on")
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


def _mix(value: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of ``value``."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class SampleStream:
    """The deterministic stream of training windows.

    Args:
        seq_length: tokens per sample (each window holds one more, for the labels).
        seed: picks the stream; a different seed gives e.g. a validation stream.
        corpus: bytes to sample from (default: :func:`load_corpus`).
    """

    def __init__(self, seq_length: int, seed: int = 0, corpus: torch.Tensor | None = None):
        self.corpus = load_corpus() if corpus is None else corpus
        self.seq_length = seq_length
        self.seed = seed
        self.starts = len(self.corpus) - seq_length - 1

    def sample(self, index: int) -> torch.Tensor:
        """Window ``index``: ``seq_length + 1`` token ids (int64)."""
        start = _mix(_mix(self.seed) ^ index) % self.starts
        return self.corpus[start : start + self.seq_length + 1].long()

    def batch(self, indices: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, labels)`` of the given samples, each ``[len(indices), seq_length]``."""
        windows = torch.stack([self.sample(i) for i in indices])
        return windows[:, :-1], windows[:, 1:]


def micro_batches(
    stream: SampleStream,
    consumed: int,
    global_batch: int,
    micro_batch: int,
    dp_size: int,
    dp_rank: int,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's micro-batches of the global batch that starts at sample ``consumed``.

    Raises:
        TopologyMismatchError: the global batch does not divide over ``dp_size`` x ``micro_batch``.
    """
    per_rank = sp.divide(global_batch, dp_size, "global_batch_size (over data parallel)")
    count = sp.divide(per_rank, micro_batch, "global_batch_size / dp (into micro-batches)")
    first = consumed + dp_rank * per_rank
    out = []
    for m in range(count):
        tokens, labels = stream.batch(range(first + m * micro_batch, first + (m + 1) * micro_batch))
        out.append((tokens.to(device), labels.to(device)))
    return out
