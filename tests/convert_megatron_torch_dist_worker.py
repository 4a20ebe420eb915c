"""megatron-core 0.16.1 loads a ``convert --to megatron --ckpt-format torch_dist`` output, as Megatron-LM does.

Used by ``tests/test_convert_megatron_torch_dist.py`` through :func:`tests.distributed.launch`
(gloo, CPU). The model is the one the ``megatron-torchdist-tp2`` fixture was trained with
(its MANIFEST.json), built at tp=1 from other initial weights, so every value compared
afterwards came from the checkpoint. The load follows ``megatron/training/checkpointing.py``:
the content metadata read from the checkpoint chooses the optimizer's sharded form, then
``dist_checkpointing.load`` fills the model's and the optimizer's sharded state dicts and
the RNG ``ShardedObject``.
"""

from __future__ import annotations

from typing import Any

import torch

from tests import integration_megatron_cpu
from tests.integration_megatron_worker import Job


def build(distributed: bool, tp: int = 1, pp: int = 1) -> Job:
    """The fixture's GPTModel (local spec, 4 layers, hidden 64, vocabulary 128) with its optimizer."""
    integration_megatron_cpu.install()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(99)
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, normalization="LayerNorm",
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        add_bias_linear=True, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
    )  # fmt: skip
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=32,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=False,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=distributed, overlap_grad_reduce=False), model
    )
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, use_distributed_optimizer=distributed)
    return Job([ddp], get_megatron_optimizer(opt_config, [ddp]), None, None)


def load(job: Job, directory: str) -> dict[str, Any]:
    """What Megatron-LM's ``load_checkpoint`` does for a ``torch_dist`` iteration directory, without its loop."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    content = dist_checkpointing.load_content_metadata(directory) or {}
    content["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    model = job.model[0].module
    model_sd = model.sharded_state_dict(metadata=content)
    state = {
        "model": model_sd,
        "optimizer": job.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=content),
        "rng_state": ShardedObject(  # as Megatron-LM's get_rng_state(ckpt_format="torch_dist") lays it out
            "rng_state",
            None,
            (
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_world_size(),
            ),
            (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
            replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
        ),
    }
    loaded = dist_checkpointing.load(state, directory)
    model.load_state_dict(loaded["model"])
    job.optimizer.load_state_dict(loaded["optimizer"])
    return {
        "iteration": loaded["iteration"],
        "tp": loaded["args"].tensor_model_parallel_size,
        "content": {k: v for k, v in content.items() if k != "dp_cp_group"},
        "rng": loaded["rng_state"],
        "state": _full_state(job, content),
        "steps": _steps(job),
    }


def _full_state(job: Job, content: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The loaded weights and moments under GPTModel's names, as megatron-core's own save would gather them.

    At tp=1 every rank holds whole weights; the optimizer's sharded state dict for saving
    (for the distributed optimizer its ``fully_reshardable`` form, gathered over dp) gives
    whole moments under ``optimizer.state.<moment>.<key>``, matched to names by key and layer offset.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    model_sd = job.model[0].module.sharded_state_dict(metadata=content)  # as for a save: the loaded one is spent
    names = {(t.key, t.global_offset): name for name, t in model_sd.items() if isinstance(t, ShardedTensor)}
    out = {f"model.{name}": t.data.detach().clone() for name, t in model_sd.items() if isinstance(t, ShardedTensor)}
    optimizer_sd = job.optimizer.sharded_state_dict(model_sd, metadata=content)
    for t in nested_values(optimizer_sd):
        if isinstance(t, ShardedTensor) and t.key.startswith("optimizer.state."):
            moment, _, key = t.key[len("optimizer.state.") :].partition(".")
            out[f"optimizer.state.{names[(key, t.global_offset)]}.{moment}"] = t.data.detach().clone()
    return out


def _steps(job: Job) -> list[float]:
    """Every Adam step count the loaded optimizer holds (per parameter, or per group for the distributed one)."""
    inner = job.optimizer.optimizer
    steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
    return steps + [float(g["step"]) for g in inner.param_groups if g.get("step") is not None]


def load_both(rank: int, world: int, plain: str, distributed: str) -> dict[str, Any]:
    """Load the plain-optimizer export, then the distributed-optimizer one, each into a fresh tp=1 job."""
    result = {"plain": load(build(distributed=False), plain)}
    _step_kept_as_with_fused_adam()
    job = build(distributed=True)
    # megatron-core 0.16.1 without Apex/Transformer Engine reads the step from the optimizer's state when it
    # builds the sharded state dict to load into (DistributedOptimizer.state_dict): one step creates it
    job.optimizer.step()
    result["distributed"] = load(job, distributed)
    return result


def _step_kept_as_with_fused_adam() -> None:
    """A CPU stand-in: the distributed optimizer's ``fully_reshardable`` load keeps the step it already set.

    megatron-core 0.16.1 sets torch Adam's per-parameter ``step`` from the loaded param groups,
    then copies every state key of the parameter from the checkpoint's tensors, which never
    hold ``step``: a ``KeyError`` whenever Apex and Transformer Engine are missing (their
    FusedAdam keeps the step in the param groups, so on GPU the key is never there). The
    stand-in skips only that key; every tensor is still copied by megatron-core.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "stand_in", False):
        return

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main_param].pop("step", None)
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                self.optimizer.state[main_param]["step"] = step

    set_states.stand_in = True  # type: ignore[attr-defined]
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def load_at(rank: int, world: int, directory: str, tp: int, pp: int, distributed: bool) -> dict[str, Any]:
    """Load one export at (tp, pp, dp = world / tp / pp); every loaded tensor by its global key and slice."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    job = build(distributed, tp=tp, pp=pp)
    if distributed:
        _step_kept_as_with_fused_adam()
        job.optimizer.step()
    result = load(job, directory)
    content = result.pop("content")
    model_sd = job.model[0].module.sharded_state_dict(metadata=content)
    optimizer_sd = job.optimizer.sharded_state_dict(model_sd, metadata=content)
    result["state"] = [
        (t.key, t.global_slice(), t.data.detach().clone())
        for t in (*nested_values(model_sd), *nested_values(optimizer_sd))
        if isinstance(t, ShardedTensor)
    ]
    return result
