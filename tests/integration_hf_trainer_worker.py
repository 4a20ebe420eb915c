"""Worker of tests/test_integration_transformers.py: ShardpointTrainer under torchrun (CPU, gloo).

``python integration_hf_trainer_worker.py PHASE OUT``; each phase writes its results under OUT:

* ``ddp-runs`` (2 ranks, DDP): an uninterrupted run (``full/``), a run stopped after
  step ``STOP`` (``stopped/``) and a run keeping the best checkpoint (``best/``);
  ``full.pt`` / ``stopped.pt`` / ``best.json`` describe how they ended.
* ``ddp-resume`` (2 ranks): resumes the damaged copies ``corrupt*/`` (the test made
  them; each rank's error goes to ``<name>.error<rank>``), resumes ``failsave/`` (a copy)
  with a disk failing during the next save, then ``stopped/`` to the end (``resumed.pt``).
* ``fsdp-save`` (2 ranks): transformers' own FSDP2 (``from_pretrained(distributed_config=...)``),
  stopped after step ``STOP``; ``reference.pt`` is the full state at that save.
* ``fsdp-resume`` (1 process, no launcher): a plain model resumes ``fsdp/``; ``fsdp_resume.pt``
  holds the state right after the load and how the run ended.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

import shardpoint as sp
from shardpoint.integrations.transformers import ShardpointTrainer

STEPS, STOP, SAVE_EVERY = 6, 4, 2
BATCH = 2  # per rank at 2 ranks
SCORES = {2: 0.5, 4: 0.9, 6: 0.1}  # the "score" evaluated at each save: step 4 is the best


class Tokens(torch.utils.data.Dataset):
    """32 fixed sequences of 8 tokens."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def llama_config() -> LlamaConfig:
    # attention dropout: the resumed run must get the random streams back to match
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        attention_dropout=0.1,
    )


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


def arguments(out: str, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=out,
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        save_total_limit=2,
        logging_steps=1,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    options.update(overrides)
    return TrainingArguments(**options)


class StopAfter(TrainerCallback):
    """Ends training after ``step`` (its checkpoint is saved first), as a job that was stopped."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class AtSave(TrainerCallback):
    """Calls ``fn(step)`` right after the checkpoint of ``step`` is saved."""

    def __init__(self, step: int, fn):
        self.step, self.fn = step, fn

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.fn(state.global_step)


def full_state(trainer) -> dict:
    """Model and optimizer state by parameter name, whole tensors on CPU (collective under FSDP2)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = trainer.model
    optimizer = trainer.optimizer.optimizer
    return {
        "model": detached(get_model_state_dict(model, options=options)),
        "optimizer": detached(get_optimizer_state_dict(model, optimizer, options=options)),
        "lr": [g["lr"] for g in optimizer.param_groups],
        "scheduler": trainer.lr_scheduler.state_dict(),
        "global_step": trainer.state.global_step,
    }


def detached(value):
    """A copy of a nested state dict whose tensors no later optimizer step changes."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    if isinstance(value, list):
        return [detached(v) for v in value]
    return value


def save_rank0(obj, path: str) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(obj, path)


def ddp_runs(out: str) -> None:
    full = ShardpointTrainer(model=tiny_model(), args=arguments(f"{out}/full"), train_dataset=Tokens())
    full.train()
    save_rank0(full_state(full), f"{out}/full.pt")

    stopped = ShardpointTrainer(
        model=tiny_model(), args=arguments(f"{out}/stopped"), train_dataset=Tokens(), callbacks=[StopAfter(STOP)]
    )
    stopped.train()
    save_rank0(full_state(stopped), f"{out}/stopped.pt")
    best_run(out)


def best_run(out: str) -> None:
    """save_total_limit=1 with load_best_model_at_end: the best checkpoint (step 4) survives and is loaded."""
    at_best = {}
    trainer = ShardpointTrainer(
        model=tiny_model(),
        args=arguments(
            f"{out}/best",
            save_total_limit=1,
            eval_strategy="steps",
            eval_steps=SAVE_EVERY,
            load_best_model_at_end=True,
            metric_for_best_model="score",
            greater_is_better=True,
        ),
        train_dataset=Tokens(),
        eval_dataset=torch.utils.data.Subset(Tokens(), range(4)),
        compute_metrics=lambda _: {"score": SCORES[trainer.state.global_step]},
        callbacks=[AtSave(4, lambda step: at_best.update(full_state(trainer)["model"]))],
    )
    trainer.train()
    final = full_state(trainer)["model"]
    result = {
        "best_model_checkpoint": trainer.state.best_model_checkpoint,
        "best_loaded": bool(at_best) and all(torch.equal(final[k], v) for k, v in at_best.items()),
    }
    if int(os.environ.get("RANK", 0)) == 0:
        with open(f"{out}/best.json", "w") as f:
            json.dump(result, f)


def ddp_resume(out: str) -> None:
    for name in sorted(n for n in os.listdir(out) if n.startswith("corrupt") and os.path.isdir(f"{out}/{n}")):
        trainer = ShardpointTrainer(model=tiny_model(), args=arguments(f"{out}/{name}"), train_dataset=Tokens())
        try:
            trainer.train(resume_from_checkpoint=True)
            message = "no error"
        except sp.CheckpointError as exc:  # the rank that found the damage raises CorruptCheckpointError
            message = f"{type(exc).__name__}: {exc}"
        with open(f"{out}/{name}.error{os.environ.get('RANK', 0)}", "w") as f:
            f.write(message)
    failed_save(f"{out}/failsave")
    resumed = ShardpointTrainer(model=tiny_model(), args=arguments(f"{out}/stopped"), train_dataset=Tokens())
    resumed.train(resume_from_checkpoint=True)
    save_rank0(full_state(resumed), f"{out}/resumed.pt")


def failed_save(out: str) -> None:
    """Resume ``out`` with rank 1's disk failing in the middle of the step-6 save (``failsave.error<rank>``)."""
    trainer = ShardpointTrainer(model=tiny_model(), args=arguments(out), train_dataset=Tokens())
    os.environ["SHARDPOINT_FAULT"] = "point=mid-data,rank=1,action=raise"
    try:
        trainer.train(resume_from_checkpoint=True)
        message = "no error"
    except sp.CheckpointError as exc:
        message = f"{type(exc).__name__}: {exc}"
    finally:
        del os.environ["SHARDPOINT_FAULT"]
    trainer.close_checkpointers()  # every rank failed alike: release the directory
    with open(f"{out}.error{os.environ.get('RANK', 0)}", "w") as f:
        f.write(message)


def fsdp_save(out: str) -> None:
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        tiny_model().save_pretrained(f"{out}/base")
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(f"{out}/base", distributed_config=DistributedConfig(fsdp_size=2))
    trainer = ShardpointTrainer(model=model, args=arguments(f"{out}/fsdp"), train_dataset=Tokens())
    reference = AtSave(STOP, lambda step: save_rank0(full_state(trainer), f"{out}/reference.pt"))
    trainer.add_callback(reference)
    trainer.add_callback(StopAfter(STOP))
    trainer.train()


def fsdp_resume(out: str) -> None:
    """One process, twice the batch: the same global batch as the two ranks that saved."""
    model = LlamaForCausalLM.from_pretrained(f"{out}/base")
    loaded = {}

    class AfterLoad(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            loaded.update(full_state(trainer))

    trainer = ShardpointTrainer(
        model=model,
        args=arguments(f"{out}/fsdp", per_device_train_batch_size=2 * BATCH),
        train_dataset=Tokens(),
        callbacks=[AfterLoad()],
    )
    trainer.train(resume_from_checkpoint=True)
    torch.save({"loaded": loaded, "global_step": trainer.state.global_step}, f"{out}/fsdp_resume.pt")


PHASES = {"ddp-runs": ddp_runs, "ddp-resume": ddp_resume, "fsdp-save": fsdp_save, "fsdp-resume": fsdp_resume}

if __name__ == "__main__":
    torch.set_num_threads(1)
    PHASES[sys.argv[1]](sys.argv[2])
    if dist.is_initialized():
        dist.barrier()
    # skip the interpreter's teardown: there, the gloo groups still referred to (the model's mesh, the
    # control group) are freed in no set order, and rank 1 aborted once under load ("terminate called
    # without an active exception", SIGABRT) after every result had been written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
