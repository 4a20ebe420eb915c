"""The demo GPT on real gloo ranks: exact resume, resharded resume, and preemption by SIGTERM.

Layout (2, 2, 1) is the demo's default: two tensor-parallel ranks in each of two
pipeline stages, so the tied embedding lives on both stages under one key.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal

import pytest
import torch

from shardpoint.demo.model import GPTConfig
from shardpoint.demo.procs import run_ranks
from shardpoint.demo.rng_tracker import DEFAULT, MODEL_PARALLEL
from shardpoint.demo.trainer import StepInfo, TrainConfig, Trainer
from shardpoint.state.train_state import collect
from tests import toy
from tests.distributed import launch

# all_gather_into_tensor (the demo's ZeRO optimizer at dp > 1) is not dispatched to a
# Python-defined ProcessGroup in torch 2.13: those runs use plain gloo
launch_gloo = functools.partial(launch, backend="gloo")

LAYOUT = (2, 2, 1)
ITERS = 6
NO_DROPOUT = GPTConfig(hidden_dropout=0.0, attention_dropout=0.0)


def config(root: str, layout: tuple[int, int, int], model: GPTConfig | None = None, **overrides) -> TrainConfig:
    tp, pp, dp = layout
    settings = dict(
        save=root,
        tp=tp,
        pp=pp,
        dp=dp,
        model=model or GPTConfig(),
        train_iters=ITERS,
        global_batch_size=8,
        micro_batch_size=2,
        warmup_iters=2,
        validate_forward=True,
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def _train(rank: int, world: int, cfg: TrainConfig) -> dict:
    trainer = Trainer(cfg)
    result = trainer.run()
    flat = collect(trainer.state, iteration=0, include_rng=False)
    return {
        "result": result,
        "tensors": {k: (s.global_shape, s.global_offset, s.tensor.detach().clone()) for k, s in flat.tensors.items()},
        "generators": {k: g.get_state() for k, g in trainer.rng.generators.items()},
        "torch_rng": torch.get_rng_state(),
        "extra": dict(trainer.state.extra),
        "lr": [g["lr"] for g in trainer.state.optimizer.param_groups],
    }


def _losses(runs: list[dict]) -> dict[int, float]:
    losses = runs[0]["result"].losses
    assert all(r["result"].losses == losses for r in runs), "ranks disagree on the loss"
    return losses


@pytest.mark.long  # 4 ranks x 3 launches; tests/test_resume_multirank.py proves exact resumes, RNG included
def test_exact_resume_same_layout_is_bit_identical(tmp_path):
    """Dropout on: bit-identical also proves the per-rank RNG streams were restored."""
    ref = launch(_train, 4, config(str(tmp_path / "ref"), LAYOUT))
    stopped = launch(_train, 4, config(str(tmp_path / "run"), LAYOUT, exit_interval=3))
    assert {(r["result"].iteration, r["result"].exit_reason) for r in stopped} == {(3, "exit-interval")}
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "3"
    resumed = launch(_train, 4, config(str(tmp_path / "run"), LAYOUT))

    ref_losses = _losses(ref)
    assert _losses(stopped) == {i: ref_losses[i] for i in (1, 2, 3)}
    assert _losses(resumed) == {i: ref_losses[i] for i in (4, 5, 6)}
    assert {r["result"].start_iteration for r in resumed} == {3}
    assert {r["result"].validation_diff for r in resumed} == {0.0}
    for before, after in zip(ref, resumed):
        assert before["tensors"].keys() == after["tensors"].keys()
        for key, (_, _, tensor) in before["tensors"].items():
            assert torch.equal(tensor, after["tensors"][key][2]), key
        for name in (DEFAULT, MODEL_PARALLEL):
            assert torch.equal(before["generators"][name], after["generators"][name]), name
        assert torch.equal(before["torch_rng"], after["torch_rng"])
        assert before["extra"] == after["extra"] == {"consumed_samples": ITERS * 8}
        assert before["lr"] == after["lr"]
    # The tied embedding and its Adam moments: the same key and box on the first and last stage, equal values.
    full = toy.assemble(resumed)
    assert "model.embedding.word_embeddings.weight" in full
    keys = [set(r["tensors"]) for r in resumed]
    assert "optimizer.state.embedding.word_embeddings.weight.exp_avg" in keys[0] & keys[3]


def test_resharded_resume_matches_uninterrupted(tmp_path):
    """Saved at tp=2 pp=2 dp=1, resumed at tp=1 pp=2 dp=2 (ZeRO slices change) and tp=1 pp=1 dp=4.

    Dropout is off: per-rank dropout streams cannot carry over to ranks holding
    other shards, so with it on the losses would differ by more than rounding.
    """
    ref = launch_gloo(_train, 4, config(str(tmp_path / "ref"), LAYOUT, NO_DROPOUT))
    launch_gloo(_train, 4, config(str(tmp_path / "run"), LAYOUT, NO_DROPOUT, exit_interval=3))
    shutil.copytree(tmp_path / "run", tmp_path / "run2")
    ref_losses = _losses(ref)
    for root, layout in ((tmp_path / "run", (1, 2, 2)), (tmp_path / "run2", (1, 1, 4))):
        resumed = launch_gloo(_train, 4, config(str(root), layout, NO_DROPOUT))
        losses = _losses(resumed)
        assert sorted(losses) == [4, 5, 6], layout
        for i in losses:
            assert losses[i] == pytest.approx(ref_losses[i], abs=1e-4), (layout, i)
        diffs = {r["result"].validation_diff for r in resumed}
        assert len(diffs) == 1 and diffs.pop() <= 1e-4, layout
        full, full_ref = toy.assemble(resumed), toy.assemble(ref)
        for key in full_ref:
            if key.startswith("model."):
                torch.testing.assert_close(full[key], full_ref[key], atol=1e-4, rtol=1e-3, msg=key)


def _signal_one_rank(rank: int, world: int, cfg: TrainConfig) -> dict:
    """Only rank 1 gets SIGTERM, during step 2: every rank must still stop and save at step 2."""

    def on_step(info: StepInfo) -> None:
        if rank == 1 and info.iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    result = Trainer(cfg, on_step=on_step).run()
    return {"iteration": result.iteration, "reason": result.exit_reason, "saved": [s.iteration for s in result.saves]}


def test_sigterm_to_one_rank_stops_all_at_the_same_step(tmp_path):
    results = launch(_signal_one_rank, 2, config(str(tmp_path / "run"), (1, 2, 1), train_iters=50))
    assert results == [{"iteration": 2, "reason": "signal", "saved": [2]}] * 2
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (tmp_path / "run" / "iter_0000002" / "shardpoint.json").exists()


def test_sigterm_from_launcher_commits_interrupted_step_and_exits_zero(tmp_path):
    """The demo's launcher preempts every rank at once, as a scheduler would."""
    root = tmp_path / "run"
    outcome = run_ranks(config(str(root), (1, 2, 1), train_iters=500), sigterm_after=2)
    stopped = outcome.result.iteration
    assert outcome.exit_codes == [0, 0]
    assert outcome.result.exit_reason == "signal"
    assert 2 <= stopped < 500
    assert [s.iteration for s in outcome.result.saves] == [stopped]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == str(stopped)
    assert (root / f"iter_{stopped:07d}" / "shardpoint.json").exists()
    assert (root / f"iter_{stopped:07d}" / "validation_logits.pt").exists()
