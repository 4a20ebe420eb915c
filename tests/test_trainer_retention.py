"""ShardpointTrainer keeps what transformers' Trainer keeps (issue 40 items 1 and 2).

The rule is checked against transformers' own ``rotate_checkpoints`` on real folders, in
every combination of checkpoint count, ``save_total_limit`` and best step; then whole
in-process Trainer runs check that the Trainer's record (``state.best_model_checkpoint``)
decides the best, also when ``evaluate`` is overridden and logs nothing.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from shardpoint.integrations.trainer_retention import TrainerRetention
from shardpoint.lifecycle.policy import CheckpointInfo, select_for_deletion

transformers = pytest.importorskip("transformers")
from transformers.trainer_utils import get_last_checkpoint, rotate_checkpoints, sort_checkpoints  # noqa: E402

from shardpoint.integrations.transformers import ShardpointTrainer  # noqa: E402
from tests.integration_hf_trainer_worker import Tokens, arguments, tiny_model  # noqa: E402


def _kept_by_transformers(tmp_path, steps, limit, best) -> set[int]:
    for step in steps:
        (tmp_path / f"checkpoint-{step}").mkdir()
    best_dir = str(tmp_path / f"checkpoint-{best}") if best is not None else None
    rotate_checkpoints(str(tmp_path), save_total_limit=limit, best_model_checkpoint=best_dir)
    return {int(p.name.split("-")[1]) for p in tmp_path.iterdir()}


def test_the_rule_is_transformers_rotate_checkpoints_in_every_combination(tmp_path):
    cases = 0
    for count, limit in itertools.product(range(1, 7), (None, 0, 1, 2, 3, 5)):
        steps = [2 * (i + 1) for i in range(count)]
        for best in (None, *steps):
            folder = tmp_path / f"{count}-{limit}-{best}"
            folder.mkdir()
            expected = _kept_by_transformers(folder, steps, limit, best)
            policy = TrainerRetention(limit, best)
            deleted = select_for_deletion([CheckpointInfo(s) for s in steps], [policy], protected=set())
            assert set(steps) - set(deleted) == expected, (count, limit, best)
            cases += 1
    assert cases == 6 * 6 + 6 * sum(range(1, 7))


def test_a_best_whose_folder_is_gone_takes_no_place_from_the_others(tmp_path):
    """transformers counts a best it cannot find in ``max(limit, len(protected))`` but deletes only real folders:
    with ``save_total_limit=1`` it keeps two (issue 54). shardpoint counted that best as a kept folder and deleted
    one more than transformers does."""
    cases = 0
    for count, limit in itertools.product(range(2, 7), (1, 2, 3)):
        steps = [2 * (i + 1) for i in range(count)]
        for gone in (1, 3, 99):  # before, between and after the folders that exist
            folder = tmp_path / f"{count}-{limit}-{gone}"
            folder.mkdir()
            expected = _kept_by_transformers(folder, steps, limit, gone)
            deleted = select_for_deletion([CheckpointInfo(s) for s in steps], [TrainerRetention(limit, gone)], set())
            assert set(steps) - set(deleted) == expected, (count, limit, gone)
            cases += 1
    assert cases == 5 * 3 * 3


class _EvaluateOverridden(ShardpointTrainer):
    """``evaluate`` replaced by one that returns its metrics and logs nothing (no log_history entry)."""

    scores: dict[int, float] = {}

    def evaluate(self, *args, **kwargs):
        return {"eval_score": self.scores[self.state.global_step]}


def _train(tmp_path, trainer_class=ShardpointTrainer, **overrides):
    args = arguments(
        str(tmp_path),
        max_steps=8,
        save_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        metric_for_best_model="score",
        greater_is_better=True,
        **overrides,
    )
    scores = {1: 0.1, 2: 0.9, 3: 0.2, 4: 0.3, 5: 0.1, 6: 0.2, 7: 0.4, 8: 0.5}  # step 2 is best
    trainer = trainer_class(
        model=tiny_model(),
        args=args,
        train_dataset=Tokens(),
        eval_dataset=torch.utils.data.Subset(Tokens(), range(2)),
        compute_metrics=lambda _: {"score": scores[trainer.state.global_step]},
    )
    trainer.scores = {s: v for s, v in scores.items()}
    trainer.train()
    trainer.close_checkpointers()
    return trainer, sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*"))


def test_a_best_metric_without_a_limit_keeps_every_checkpoint(tmp_path):
    trainer, kept = _train(tmp_path / "all", save_total_limit=None)
    assert kept == list(range(1, 9))  # as the Trainer: no limit, nothing deleted
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    # what shardpoint adds to output_dir is out of the way of the Trainer's own listing
    others = sorted(p.name for p in (tmp_path / "all").iterdir() if not p.name.startswith("checkpoint-"))
    assert others == [".shardpoint.lock", "latest_checkpoint.txt"]
    assert sort_checkpoints(str(tmp_path / "all")) == [str(tmp_path / "all" / f"checkpoint-{s}") for s in kept]
    assert get_last_checkpoint(str(tmp_path / "all")) == str(tmp_path / "all" / "checkpoint-8")


def test_the_best_named_by_the_trainer_survives_when_evaluate_is_overridden(tmp_path):
    trainer, kept = _train(tmp_path / "over", _EvaluateOverridden, save_total_limit=2)
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert kept == [2, 8]  # the best and the newest, from the Trainer's record (log_history holds no score)
