"""Megatron-LM mixture-of-experts GPTs with q/k norms and Hugging Face Qwen3-MoE, both ways.

``moe-torchdist-ep2-qwen3`` was written by Megatron-LM core_v0.16.1 (ep=2, dp=2, distributed
optimizer) with the Mixtral fixture's router plus ``--qk-layernorm``; its ``logits.pt`` is
Megatron's own forward. Megatron -> HF: the exported ``Qwen3MoeForCausalLM`` computes those
logits. HF -> Megatron: a Qwen3-MoE built by transformers comes back from ``convert --from hf``
tensor for tensor, loads at ep=2 and ep=1, and exports back identical. What Qwen3-MoE cannot
compute is refused by name, on either side.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from shardpoint.errors import CheckpointError
from shardpoint.foreign import read_foreign
from shardpoint.foreign.hf import export_hf, model_family
from shardpoint.foreign.hf_import import read_hf
from tests.distributed import launch
from tests.test_cli_commands import run_cli
from tests.test_foreign_import import MOMENTS, assert_equal, params_of
from tests.test_foreign_mixtral import (
    MIXTRAL,
    _load_weights,
    assert_export_refused,
    check_ep_rank,
    exported_both_ways,
    tensors_of,
)

transformers = pytest.importorskip("transformers")

QWEN3 = Path(__file__).parent / "fixtures" / "megatron-moe" / "moe-torchdist-ep2-qwen3"
TOL = 1e-5


def hf_model(directory: Path) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def test_the_exported_qwen3_moe_computes_megatrons_logits_in_place_and_after_import(tmp_path):
    batch = torch.load(QWEN3 / "logits.pt", weights_only=True)  # Megatron's own forward, ep=2
    for name, _, config, reference in exported_both_ways(QWEN3, "Qwen3MoeForCausalLM", tmp_path):
        for key in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "attention_bias",
            "tie_word_embeddings",
        ):
            assert config[key] == reference[key], key
        weights = tensors_of(tmp_path / name)
        for saved in ("mlp.experts.3.up_proj.weight", "mlp.gate.weight", "self_attn.q_norm.weight"):
            assert f"model.layers.1.{saved}" in weights, saved  # save_pretrained's names
        with torch.no_grad():
            got = hf_model(tmp_path / name)(batch["tokens"]).logits
        assert got.shape == batch["logits"].shape
        diff = float((got - batch["logits"]).abs().max())  # measured 2.2e-7 (sdpa, transformers 5.25)
        assert diff <= TOL, (name, diff)


def test_the_fixture_reads_equal_to_its_truth_despite_the_bucket_gaps():
    """The 16-element q/k norms leave 48-element gaps full of garbage in Megatron's dense bucket."""
    t = torch.load(QWEN3 / "truth.pt", weights_only=True)
    ckpt = read_foreign(QWEN3 / "ckpt")
    assert list(ckpt.params) == params_of(t) and ckpt.ep == 2  # q/k norms in GPTModel's order
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in ckpt.params
    for name in params_of(t):
        assert_equal(name, ckpt.params[name], t[name])
        for moment in MOMENTS:
            assert_equal(f"{name}.{moment}", ckpt.optimizer[name].get(moment), t[f"{name}.{moment}"])
    assert model_family(ckpt) == "qwen3_moe"
    assert model_family(read_foreign(MIXTRAL / "ckpt", optimizer=False)) == "mixtral"  # no q/k norms


def small_qwen3_moe(tmp_path: Path, **change) -> tuple[Path, torch.nn.Module]:
    """A Qwen3MoeForCausalLM built by transformers: 4 experts top-2, GQA, a vocabulary Megatron pads."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **change,
    )
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, q and k norms apart, experts apart
            p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / "hf"
    model.save_pretrained(str(path), max_shard_size="200KB")
    return path, model


@pytest.fixture
def qwen3_import(tmp_path: Path) -> tuple[Path, torch.nn.Module, Path]:
    hf, model = small_qwen3_moe(tmp_path)
    done = run_cli("convert", "--from", "hf", hf, tmp_path / "dist", "--json")
    assert done.rc == 0, done.err
    config = done.json()["config"]
    assert (config["num_experts"], config["moe_router_topk"], config["moe_ffn_hidden_size"]) == (4, 2, 40)
    assert config["qk_layernorm"] and config["ffn_hidden_size"] == 96
    return hf, model, tmp_path / "dist"


def test_a_transformers_qwen3_moe_through_convert_and_back_is_identical(qwen3_import, tmp_path):
    hf, model, dist = qwen3_import
    params = read_hf(hf).params
    got = _load_weights(0, 1, str(dist), 1, {n: t.shape for n, t in params.items()})  # one process, ep=1
    assert got["release"] and got["finetune"] and sorted(got["loaded"]) == sorted(params)
    for name, tensor in got["loaded"].items():
        assert torch.equal(tensor, params[name]), name
    back = run_cli("export", dist, "--to", "hf", tmp_path / "back", "--json")
    assert back.rc == 0, back.err
    original, again = tensors_of(hf), tensors_of(tmp_path / "back")
    assert sorted(original) == sorted(again)
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["intermediate_size"], config["moe_intermediate_size"], config["norm_topk_prob"]) == (96, 40, True)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(hf_model(tmp_path / "back")(tokens).logits, model.eval()(tokens).logits)


def test_the_hf_import_loads_at_ep2_on_two_ranks(qwen3_import):
    hf, _, dist = qwen3_import
    params = read_hf(hf).params  # Megatron names, global expert ids, padded vocabulary
    original = tensors_of(hf)
    results = launch(_load_weights, 2, str(dist), 2, {n: t.shape for n, t in params.items()})
    for ep_rank, got in enumerate(results):  # tp=1, dp=2, ep=2: rank r holds experts 2r, 2r+1
        check_ep_rank(got, ep_rank, params)
        g = 2 * ep_rank + 1
        fc1 = got["loaded"][f"decoder.layers.1.mlp.experts.local_experts.{g}.linear_fc1.weight"]
        gate, up = (original[f"model.layers.1.mlp.experts.{g}.{w}.weight"] for w in ("gate_proj", "up_proj"))
        assert torch.equal(fc1, torch.cat([gate, up]))  # [gate; up]
        for megatron, qwen in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            norm = got["loaded"][f"decoder.layers.0.self_attention.{megatron}.weight"]
            assert torch.equal(norm, original[f"model.layers.0.self_attn.{qwen}.weight"])
        router = got["loaded"]["decoder.layers.0.mlp.router.weight"]
        assert torch.equal(router, original["model.layers.0.mlp.gate.weight"])


def test_hf_qwen3_moes_megatron_cannot_hold_exactly_are_refused_by_name(tmp_path):
    hf, _ = small_qwen3_moe(tmp_path)
    config_path = hf / "config.json"
    original = json.loads(config_path.read_text())
    for change, expected in (
        ({"norm_topk_prob": False}, r"unnormalised top-k router weights \(norm_topk_prob false"),
        ({"norm_topk_prob": None}, r"unnormalised top-k router weights"),  # transformers' default
        ({"mlp_only_layers": [1]}, r"dense MLP layers among the MoE ones \(mlp_only_layers \[1\]\)"),
        ({"decoder_sparse_step": 2}, r"dense MLP layers among the MoE ones \(decoder_sparse_step 2"),
        ({"use_sliding_window": True, "sliding_window": 16}, r"sliding-window attention"),
        ({"attention_bias": True}, r"attention biases \(attention_bias"),
    ):
        config = {k: v for k, v in (original | change).items() if v is not None}
        config_path.write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=expected):
            read_hf(hf)
        assert run_cli("convert", "--from", "hf", hf, tmp_path / "never").rc == 1
        assert not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"moe_router_score_function": "sigmoid"}, r"a sigmoid router .*Qwen3-MoE's router is a softmax"),
        ({"moe_router_pre_softmax": True}, r"softmax before top-k \(--moe-router-pre-softmax"),
        ({"moe_shared_expert_intermediate_size": 32}, r"shared experts"),
        ({"moe_router_enable_expert_bias": True}, r"a router expert bias"),
        ({"moe_layer_freq": [1, 0]}, r"dense layers among the MoE layers"),
        ({"qk_l2_norm": True}, r"L2-normalised queries and keys \(--qk-l2-norm\)"),
        ({"normalization": "LayerNorm"}, r"normalization 'LayerNorm'"),
    ],
)
def test_what_qwen3_moe_cannot_compute_is_refused_by_name(change, expected, tmp_path):
    assert_export_refused(QWEN3, change, r"not Qwen3-MoE-like \(Qwen3MoeForCausalLM\): .*" + expected, tmp_path)


def test_args_and_weights_that_disagree_on_qk_norms_are_refused_by_name(tmp_path):
    without = read_foreign(QWEN3 / "ckpt", optimizer=False)
    without.args["qk_layernorm"] = False  # a Mixtral by its args, with norms Mixtral has no place for
    with pytest.raises(CheckpointError, match=r"a Mixtral model has no place for: .*q_layernorm"):
        export_hf(without, tmp_path / "out")
    claims = read_foreign(MIXTRAL / "ckpt", optimizer=False)
    claims.args["qk_layernorm"] = True
    with pytest.raises(CheckpointError, match=re.escape("has no decoder.layers.0.self_attention.q_layernorm.weight")):
        export_hf(claims, tmp_path / "out")
    assert not (tmp_path / "out").exists()
