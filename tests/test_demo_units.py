"""Pieces of the demo GPT that need no process group: data stream, loss, layout errors, HF mapping."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

import shardpoint as sp
from shardpoint.demo.cross_entropy import vocab_parallel_cross_entropy
from shardpoint.demo.data import SampleStream, micro_batches
from shardpoint.demo.hf import from_hf_state_dict, hf_config, to_hf_state_dict
from shardpoint.demo.model import GPTConfig, GPTModel
from shardpoint.demo.parallel import build_parallel_state
from shardpoint.demo.preemption import ExitSignalHandler, agree_to_exit
from shardpoint.demo.rng_tracker import RNGTracker
from shardpoint.demo.trainer import cosine_with_warmup

CPU = torch.device("cpu")


def test_global_batch_is_the_same_samples_at_any_dp_size():
    stream = SampleStream(16, seed=3)
    one = micro_batches(stream, 40, 8, 2, dp_size=1, dp_rank=0, device=CPU)
    two = [mb for r in range(2) for mb in micro_batches(stream, 40, 8, 2, dp_size=2, dp_rank=r, device=CPU)]
    four = [mb for r in range(4) for mb in micro_batches(stream, 40, 8, 2, dp_size=4, dp_rank=r, device=CPU)]
    for layout in (two, four):
        assert torch.equal(torch.cat([t for t, _ in one]), torch.cat([t for t, _ in layout]))
    tokens, labels = one[0]
    assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels are the next bytes
    assert torch.equal(SampleStream(16, seed=3).sample(41), stream.sample(41))
    assert not torch.equal(stream.sample(41), stream.sample(42))


def test_global_batch_must_divide_over_dp_and_micro_batches():
    with pytest.raises(sp.TopologyMismatchError, match="global_batch_size"):
        micro_batches(SampleStream(16), 0, 8, 2, dp_size=3, dp_rank=0, device=CPU)


def test_vocab_parallel_cross_entropy_matches_torch_without_tp():
    logits = torch.randn(5, 7, 32, requires_grad=True)
    target = torch.randint(0, 32, (5, 7))
    ours = vocab_parallel_cross_entropy(logits, target, 0, None)
    ours.mean().backward()
    grad = logits.grad.clone()
    logits.grad = None
    reference = F.cross_entropy(logits.reshape(-1, 32), target.reshape(-1), reduction="none").reshape(5, 7)
    reference.mean().backward()
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad, logits.grad)


@pytest.mark.parametrize(("tp", "pp", "what"), [(3, 1, "num_attention_heads"), (1, 3, "num_layers")])
def test_layout_that_does_not_divide_the_model_is_a_clear_error(tp, pp, what):
    ps = build_parallel_state(tp, pp, 1)  # no process group: one virtual rank of the layout
    with pytest.raises(sp.TopologyMismatchError, match=what):
        GPTModel(GPTConfig(), ps, RNGTracker(0, ps))


def test_cosine_schedule_warms_up_linearly_then_decays_to_min():
    factor = cosine_with_warmup(warmup=4, decay_iters=20, min_ratio=0.1)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factor(20) == factor(50) == pytest.approx(0.1)


def test_single_rank_model_equals_hf_gpt2_and_mapping_round_trips():
    """tp=1 pp=1: the model itself (not only the export) computes GPT-2's function."""
    transformers = pytest.importorskip("transformers")
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    ps = build_parallel_state(1, 1, 1)
    model = GPTModel(cfg, ps, RNGTracker(0, ps), seed=7).eval()
    with torch.no_grad():  # LayerNorms and biases start at 1 / 0: make them count
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = {k: (v.tensor if isinstance(v, sp.Shard) else v).detach() for k, v in model.sharded_state_dict().items()}
    hf_sd = to_hf_state_dict(ours, cfg)
    back = from_hf_state_dict(hf_sd, cfg)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config(cfg))).eval()
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    hf.tie_weights()
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        logits = model.logits(model(None, tokens))
        assert (logits - hf(tokens).logits).abs().max() <= 1e-4


def test_exit_agreement_without_a_process_group():
    started = time.time()
    assert agree_to_exit(False, started, None, CPU) is None
    assert agree_to_exit(False, started - 120, 1.0, CPU) == "duration"
    assert agree_to_exit(True, started - 120, 1.0, CPU) == "signal"


def test_signal_handler_records_sigterm_and_restores_the_previous_handler():
    before = signal.getsignal(signal.SIGTERM)
    with ExitSignalHandler() as handler:
        os.kill(os.getpid(), signal.SIGTERM)  # would end the test process without the handler
        time.sleep(0.01)
        assert handler.received
    assert signal.getsignal(signal.SIGTERM) is before
