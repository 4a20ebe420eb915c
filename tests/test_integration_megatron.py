"""Megatron's training objects through ``shardpoint.integrations.megatron``: megatron-core from the
package registry (GPTModel, parallel_state, DDP, DistributedOptimizer) on 2 gloo CPU ranks.

Megatron-LM's own loop (``pretrain_gpt.py``, not a package) is exercised by ``scripts/megatron-check``.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import launch

pytest.importorskip("megatron.core")

from tests import integration_megatron_worker as worker


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron") / "ckpt")
    return root, launch(worker.resume, 2, root, backend="gloo", timeout=240)


def test_resume_is_bit_exact_with_the_distributed_optimizer(tp2_run):
    _, results = tp2_run
    for r in results:
        assert (r["iteration"], r["flops"], r["consumed"]) == (2, 123.0, 4)
        assert r["first"] == r["second"]
        assert r["saved"].keys() == r["loaded"].keys()
        for key, value in r["saved"].items():
            assert torch.equal(value, r["loaded"][key]), key
        for key, value in r["end"].items():
            assert torch.equal(value, r["end_again"][key]), key
    keys = results[0]["saved"]
    assert "model.decoder.layers.1.self_attention.linear_qkv.weight" in keys  # global layer numbers, GPTModel names
    assert "optimizer.state.decoder.layers.1.mlp.linear_fc1.weight.exp_avg_sq" in keys, sorted(
        k for k in keys if "optim" in k
    )


def test_reshard_tp2_to_tp1_dp2_equals_the_offline_reader(tp2_run):
    from shardpoint.offline import read_full

    root, results = tp2_run
    offline = read_full(root).tensors
    resharded = launch(worker.reshard, 2, root, backend="gloo", timeout=240)
    for r in resharded:
        assert r["iteration"] == 2
        for key, value in r["state"].items():
            assert torch.equal(value, offline[key]), key
            assert torch.equal(value, results[0]["saved"][key]), key
