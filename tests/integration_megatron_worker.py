"""A megatron-core training job on CPU ranks: GPTModel, parallel_state, DDP and DistributedOptimizer.

Used by ``tests/test_integration_megatron.py`` through :func:`tests.distributed.launch`. The
model is tiny (2 layers, hidden 32, vocabulary 64) and every step's batch and gradient
noise come from the step number alone, so two jobs that run the same steps end bit-equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tests import integration_megatron_cpu

VOCAB = 64
SEQ = 16
LAYERS = 2


@dataclass
class Job:
    model: Any  # list of DDP-wrapped model chunks, as Megatron's training loop holds it
    optimizer: Any
    scheduler: Any
    args: Any


def build(
    tp: int,
    pp: int = 1,
    *,
    seed: int = 1234,
    distributed: bool = True,
    bf16: bool = False,
    qk_layernorm: bool = False,
    experts: int = 0,
    ep: int = 1,
    vocab: int = VOCAB,
) -> Job:
    """parallel_state at (tp, pp, ep, dp = world / tp / pp), a GPTModel, DDP and the optimizer.

    ``distributed``: megatron-core's DistributedOptimizer, else its FP32Optimizer (or with
    ``bf16`` its Float16OptimizerWithFloat16Params over fp32 master copies).
    ``qk_layernorm``: layer norms on queries and keys, i.e. 2 more parameters per layer.
    ``experts``: a mixture-of-experts MLP with that many experts, ``ep`` of them groups
    (the local, non-grouped expert MLP spec: grouped GEMM needs a GPU). ``vocab``: the
    embedding's rows (Megatron-LM passes its padded vocabulary).
    """
    integration_megatron_cpu.install()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        hidden_dropout=0.1,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        **_moe(experts, ep),
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts or None, qk_layernorm=qk_layernorm),
        vocab_size=vocab,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    if bf16:
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=distributed, overlap_grad_reduce=False), model
    )
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01, use_distributed_optimizer=distributed, bf16=bf16
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=20,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=20,
        wd_incr_style="constant",
    )
    return Job([ddp], optimizer, scheduler, None)


def _moe(experts: int, ep: int) -> dict[str, Any]:
    """MoE at tp=1 only: with tp > 1 megatron-core requires sequence parallelism, which its torch LayerNorm
    (no Apex or Transformer Engine on CPU) refuses."""
    if not experts:
        return {}
    return dict(
        num_moe_experts=experts, expert_model_parallel_size=ep, moe_router_topk=2,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_aux_loss_coeff=0.0,
        add_bias_linear=False,  # megatron-core 0.16.1 adds an expert bias in place into a tp-reduce view
    )  # fmt: skip


def batch(step: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (2, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(job: Job, step: int) -> float:
    """One step at pp=1: forward, backward, reduce-scatter, optimizer step, scheduler step."""
    ddp = job.model[0]
    ddp.zero_grad_buffer()
    job.optimizer.zero_grad()
    tokens, labels = batch(step)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    losses = ddp(tokens, position_ids, None, labels=labels)
    loss = losses.float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    job.optimizer.step()
    job.scheduler.step(increment=1)
    return float(loss)


def args(root: str, **over: Any) -> Any:
    """The Megatron args the integration reads (what ``megatron.training.get_args()`` holds in a real run)."""
    import argparse

    values = dict(
        save=root, load=root, no_save_optim=False, no_save_rng=False, no_load_optim=False, no_load_rng=False,
        finetune=False, pretrained_checkpoint=None, exit_on_missing_checkpoint=False, ckpt_step=None,
        async_save=False, non_persistent_ckpt_type=None, non_persistent_save_interval=None,
        save_retain_interval=None, dist_ckpt_strictness="assume_ok_unexpected", use_checkpoint_args=False,
        consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
        num_layers=LAYERS, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=None,
        ckpt_fully_parallel_save=True, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        data_parallel_size=1, transformer_impl="local", untie_embeddings_and_output_weights=True,
        use_distributed_optimizer=True, iteration=0,
    )  # fmt: skip
    values["rank"] = torch.distributed.get_rank()  # as in Megatron's args: they differ by rank
    values.update(over)
    return argparse.Namespace(**values)


def full_state(job: Job) -> dict[str, torch.Tensor]:
    """Every model tensor and Adam moment at full size, under the integration's keys (gathered on every rank)."""
    import torch.distributed as dist

    from shardpoint.integrations.megatron.state import MegatronModel, optimizer_state

    model = MegatronModel(job.model).sharded_state_dict()
    optim = optimizer_state(job.optimizer).sharded_state_dict({"model." + k: v for k, v in model.items()})
    out = {}
    for prefix, shards in (("model.", model), ("optimizer.state.", optim)):
        for key, shard in shards.items():
            # bf16 summed as fp32: exact, and gloo sums it
            wide = torch.float32 if shard.tensor.dtype == torch.bfloat16 else shard.tensor.dtype
            full = torch.zeros(shard.global_shape, dtype=wide)
            if shard.replica_id == 0:
                full[tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.tensor.shape))] = shard.tensor
            dist.all_reduce(full)
            out[prefix + key] = full.to(shard.tensor.dtype)
    return out


def resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """tp=2: train 4 steps saving at 2 through the integration; a fresh job loads step 2 and redoes 3..4."""
    from shardpoint.integrations.megatron.loop import Session

    job = build(2)
    session = Session({}, get_args=lambda: job.args)
    job.args = args(root)
    for step in (1, 2):
        train_step(job, step)
        job.args.consumed_train_samples += 2
    saved = full_state(job)
    session.save_checkpoint(2, job.model, job.optimizer, job.scheduler, 123.0)
    first = [train_step(job, step) for step in (3, 4)]
    end = full_state(job)
    session.maybe_finalize_async_save(blocking=True, terminate=True)

    again = build(2, seed=99)  # other initial weights and RNG: all of it must come from the checkpoint
    again.args = args(root)
    session = Session({}, get_args=lambda: again.args)
    iteration, flops = session.load_checkpoint(again.model, again.optimizer, again.scheduler)
    loaded = full_state(again)
    second = [train_step(again, step) for step in (3, 4)]
    session.maybe_finalize_async_save(blocking=True, terminate=True)
    return {
        "iteration": iteration, "flops": flops, "consumed": again.args.consumed_train_samples,
        "saved": saved, "loaded": loaded, "first": first, "second": second,
        "end": end, "end_again": full_state(again),
    }  # fmt: skip


def reshard(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    """tp=1 dp=2: load what tp=2 saved; every tensor at full size."""
    from shardpoint.integrations.megatron.loop import Session

    job = build(1)
    job.args = args(root)
    session = Session({}, get_args=lambda: job.args)
    iteration, _ = session.load_checkpoint(job.model, job.optimizer, job.scheduler)
    state = full_state(job)
    train_step(job, 3)  # the resharded job trains on
    session.maybe_finalize_async_save(blocking=True, terminate=True)
    return {"iteration": iteration, "state": state}
