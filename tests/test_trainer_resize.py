"""ShardpointTrainer resumes a model whose state changes size on load (issue 40 item 3).

The Trainer loads a checkpoint through ``model.load_state_dict``, so a module that keeps
data-sized state (here: the ids of every batch seen, a buffer that grows each step) can
take it at its saved size. shardpoint's in-place load reads such whole tensors at their
saved size and hands them to the same ``load_state_dict``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaForCausalLM

from shardpoint.integrations.transformers import ShardpointTrainer
from tests.integration_hf_trainer_worker import Tokens, arguments, llama_config


class _RemembersBatches(LlamaForCausalLM):
    """A causal LM with a buffer of every batch's first token id: its size is the number of steps."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("seen", torch.zeros(0, dtype=torch.long), persistent=True)

    def forward(self, input_ids=None, labels=None, **kwargs):  # named: the Trainer keeps only named columns
        if self.training:
            self.seen = torch.cat([self.seen, input_ids[:, 0]])
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        saved = state_dict.get(prefix + "seen")
        if saved is not None:
            self.seen = torch.empty_like(saved)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _trainer(out, max_steps: int) -> ShardpointTrainer:
    torch.manual_seed(0)
    model = _RemembersBatches(llama_config())
    args = arguments(str(out), max_steps=max_steps, save_steps=2, save_total_limit=None)
    return ShardpointTrainer(model=model, args=args, train_dataset=Tokens())


def test_a_buffer_that_grows_resumes_at_its_saved_size(tmp_path):
    whole = _trainer(tmp_path / "whole", 4)
    whole.train()
    whole.close_checkpointers()
    first = _trainer(tmp_path / "split", 4)
    first.args.max_steps = 2
    first.train()
    first.close_checkpointers()
    resumed = _trainer(tmp_path / "split", 4)
    assert resumed.model.seen.numel() == 0
    resumed.train(resume_from_checkpoint=str(tmp_path / "split" / "checkpoint-2"))
    resumed.close_checkpointers()
    # loaded at its saved size (4 ids), then two more steps: as the uninterrupted run
    assert resumed.model.seen.numel() == whole.model.seen.numel() == 8
    assert torch.equal(resumed.model.seen, whole.model.seen)
