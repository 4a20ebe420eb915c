"""Pipeline and expert parallelism through ``shardpoint.integrations.megatron``, asserted on the phases of
ONE 2-rank job (:mod:`tests.integration_megatron_parallel`): megatron-core's GPTModel at pp=2 and a
mixture-of-experts GPTModel at ep=2 (local expert MLPs), each with the DistributedOptimizer on gloo
CPU ranks, resumed bit-exact and resharded (pp=1 dp=2, ep=1) to what the offline reader reads.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import launch

pytest.importorskip("megatron.core")

from tests import integration_megatron_parallel as parallel


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron_parallel"))
    results = launch(parallel.run, 2, root, backend="gloo", timeout=300)
    print("seconds per phase:", results[0]["seconds"])  # shown with -s
    return root, results


def _bit_exact(r):
    assert r["returned"] == (2, 9.0)
    assert not r["loaded_differs"], r["loaded_differs"][:5]
    assert r["losses"][0] == r["losses"][1]
    assert not r["end_differs"], r["end_differs"][:5]


def _equals_offline(root, results, saved_phase, loaded_phase):
    from shardpoint.offline import read_full

    offline = read_full(root).tensors
    saved = results[0][saved_phase]["saved"]
    for r in results:
        state = r[loaded_phase]["state"]
        assert r[loaded_phase]["returned"] == (2, 9.0)
        assert state.keys() == saved.keys()
        for key, value in state.items():
            assert torch.equal(value, offline[key].to(value.dtype)), key
            assert torch.equal(value, saved[key]), key


def test_pp2_resumes_bit_exact_with_the_distributed_optimizer(phases):
    _, results = phases
    for r in results:
        _bit_exact(r["pp2"])
    keys = results[0]["pp2"]["keys"]
    # stage 1's only layer is global layer 1; the embedding (stage 0) and output layer (stage 1) both saved
    for key in ("decoder.layers.1.mlp.linear_fc1.weight", "embedding.word_embeddings.weight", "output_layer.weight"):
        assert f"model.{key}" in keys and f"optimizer.state.{key}.exp_avg" in keys, key


def test_pp2_loaded_at_pp1_dp2_equals_the_offline_reader(phases):
    root, results = phases
    _equals_offline(f"{root}/pp", results, "pp2", "pp1_dp2")


def test_moe_ep2_resumes_bit_exact_with_the_distributed_optimizer(phases):
    _, results = phases
    for r in results:
        _bit_exact(r["ep2"])
    keys = results[0]["ep2"]["keys"]
    for expert in range(4):  # global expert numbers: ranks hold experts 0-1 and 2-3
        key = f"decoder.layers.1.mlp.experts.local_experts.{expert}.linear_fc2.weight"
        assert f"model.{key}" in keys and f"optimizer.state.{key}.exp_avg_sq" in keys, key


def test_moe_ep2_loaded_at_ep1_equals_the_offline_reader(phases):
    root, results = phases
    _equals_offline(f"{root}/moe", results, "ep2", "ep1")
