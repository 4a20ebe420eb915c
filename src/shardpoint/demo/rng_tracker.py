"""Megatron's model-parallel RNG tracker: which random stream each dropout draws from.

Dropout on a replicated activation (embeddings, the residual stream) must draw the
*same* mask on every rank of the tensor-parallel group, or the replicas would
diverge; dropout on a split activation (attention probabilities of this rank's
heads) must draw *different* masks per tp rank, or the heads of different ranks
would be dropped in lockstep. Megatron keeps two CUDA RNG states for this and forks
between them (``get_cuda_rng_tracker().fork()``); here they are two explicit
``torch.Generator`` objects, seeded as Megatron seeds them:

* ``default``: ``seed + 100 * pp_rank`` — shared by the tp group (and by data-parallel
  replicas, as in Megatron without ``--data-parallel-random-init``);
* ``model-parallel``: that plus ``2718 + tp_rank`` — one stream per tp rank.

Both are handed to ``sp.TrainState(generators=...)``, so each rank's streams are
checkpointed and restored, which exact resume with dropout on depends on.
"""

from __future__ import annotations

import torch

from shardpoint.demo.parallel import ParallelState

__all__ = ["DEFAULT", "MODEL_PARALLEL", "RNGTracker"]

DEFAULT = "default"
MODEL_PARALLEL = "model-parallel"
_MODEL_PARALLEL_OFFSET = 2718


class RNGTracker:
    """The two dropout streams of one rank.

    Args:
        seed: the job's base seed.
        ps: this rank's parallel state (its stage and tp rank pick the seeds, its
            device the generators' device).
    """

    def __init__(self, seed: int, ps: ParallelState):
        base = seed + 100 * ps.pp_rank
        self.generators: dict[str, torch.Generator] = {
            DEFAULT: torch.Generator(ps.device).manual_seed(base),
            MODEL_PARALLEL: torch.Generator(ps.device).manual_seed(base + _MODEL_PARALLEL_OFFSET + ps.tp_rank),
        }

    def dropout(self, x: torch.Tensor, p: float, training: bool, *, tensor_parallel: bool = False) -> torch.Tensor:
        """Inverted dropout with a mask from the stream the region calls for.

        Args:
            tensor_parallel: ``x`` is split over the tp group (attention probabilities),
                so the mask comes from this tp rank's own stream.
        """
        if not training or p == 0.0:
            return x
        generator = self.generators[MODEL_PARALLEL if tensor_parallel else DEFAULT]
        keep = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) >= p
        return x * keep / (1.0 - p)
