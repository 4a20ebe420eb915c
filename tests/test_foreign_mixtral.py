"""Megatron-LM mixture-of-experts GPTs and Hugging Face Mixtral, both ways, checked against Megatron's own forward.

``moe-torchdist-ep2-mixtral`` was written by Megatron-LM core_v0.16.1 (ep=2, dp=2, distributed
optimizer) with a router Mixtral computes (softmax top-2 over 4 experts, no expert bias, no
shared expert); its ``logits.pt`` is Megatron's own forward. Megatron -> HF: the exported
``MixtralForCausalLM`` computes those logits. HF -> Megatron: a Mixtral built by transformers
comes back from ``convert --from hf`` tensor for tensor, and the import loads at ep=2. The
sigmoid / shared-expert fixtures are refused naming each feature.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint.errors import CheckpointError
from shardpoint.foreign import import_checkpoint, read_foreign
from shardpoint.foreign.hf import export_hf
from shardpoint.foreign.hf_import import read_hf
from tests.distributed import launch
from tests.test_cli_commands import run_cli
from tests.test_foreign_import import MOMENTS, assert_equal, params_of
from tests.test_foreign_moe import EP1, EP2, MoEGPT, _check, _load

transformers = pytest.importorskip("transformers")

MOE = Path(__file__).parent / "fixtures" / "megatron-moe"
MIXTRAL = MOE / "moe-torchdist-ep2-mixtral"
TOL = 1e-5


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return torch.load(MIXTRAL / "logits.pt", weights_only=True)  # Megatron's forward, ep=2


def hf_model(directory: Path) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def max_diff(directory: Path, batch: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        got = hf_model(directory)(batch["tokens"]).logits
    assert got.shape == batch["logits"].shape
    return float((got - batch["logits"]).abs().max())


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def exported_both_ways(fixture: Path, architecture: str, tmp_path: Path) -> Iterator[tuple[str, dict, dict, dict]]:
    """The Megatron ``fixture`` exported to HF as it is and after importing it, through the CLI.

    Yields ``(name, the export's report, its config.json, the fixture's hf_config.json)``
    once each export succeeded as ``architecture`` (2 layers, vocabulary 128); the
    export lies in ``tmp_path / name``.
    """
    imported = run_cli("convert", "--from", "megatron", fixture / "ckpt", tmp_path / "dist", "--json")
    assert imported.rc == 0, imported.err
    reference = json.loads((fixture / "hf_config.json").read_text())
    for name, source in (("in-place", fixture / "ckpt"), ("imported", tmp_path / "dist")):
        result = run_cli("export", source, "--to", "hf", tmp_path / name, "--json")
        assert result.rc == 0, result.err
        report = result.json()
        assert (report["architecture"], report["layers"], report["vocab_size"]) == (architecture, 2, 128)
        yield name, report, json.loads((tmp_path / name / "config.json").read_text()), reference


def test_the_exported_mixtral_computes_megatrons_logits_in_place_and_after_import(batch, tmp_path):
    for name, report, config, reference in exported_both_ways(MIXTRAL, "MixtralForCausalLM", tmp_path):
        assert report["imported"] == (name == "imported")
        for key in (
            "num_local_experts",
            "num_experts_per_tok",
            "intermediate_size",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "router_jitter_noise",
            "tie_word_embeddings",
        ):
            assert config[key] == reference[key], key
        weights = tensors_of(tmp_path / name)
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in weights  # save_pretrained's names
        assert max_diff(tmp_path / name, batch) <= TOL


def test_the_fixture_imports_equal_to_its_truth_and_loads_at_ep1(tmp_path):
    t = torch.load(MIXTRAL / "truth.pt", weights_only=True)
    ckpt = read_foreign(MIXTRAL / "ckpt")
    assert list(ckpt.params) == params_of(t) and ckpt.ep == 2 and not ckpt.buffers
    for name in params_of(t):
        assert_equal(name, ckpt.params[name], t[name])
        for moment in MOMENTS:
            assert_equal(f"{name}.{moment}", ckpt.optimizer[name].get(moment), t[f"{name}.{moment}"])
    import_checkpoint(MIXTRAL / "ckpt", tmp_path / "run")
    _check(_load(0, 1, str(tmp_path / "run"), 1, {n: t[n].shape for n in params_of(t)}), t, params_of(t))


def small_mixtral(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A MixtralForCausalLM built by transformers: 4 experts top-2, GQA, a vocabulary Megatron pads."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, experts apart
            p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / "hf"
    model.save_pretrained(str(path), max_shard_size="200KB")
    return path, model


def test_a_transformers_mixtral_through_convert_and_back_is_identical(tmp_path):
    hf, model = small_mixtral(tmp_path)
    done = run_cli("convert", "--from", "hf", hf, tmp_path / "dist", "--json")
    assert done.rc == 0, done.err
    config = done.json()["config"]
    assert (config["num_experts"], config["moe_router_topk"], config["moe_ffn_hidden_size"]) == (4, 2, 40)
    back = run_cli("export", tmp_path / "dist", "--to", "hf", tmp_path / "back", "--json")
    assert back.rc == 0, back.err
    original, again = tensors_of(hf), tensors_of(tmp_path / "back")
    assert sorted(original) == sorted(again)
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(hf_model(tmp_path / "back")(tokens).logits, model.eval()(tokens).logits)


def _load_weights(rank: int, world: int, root: str, ep: int, shapes: dict) -> dict:
    topo = sp.Topology(tp_size=1, dp_size=world, ep_size=ep, rank=rank)
    model = MoEGPT(shapes, topo)
    result = sp.Checkpointer(root, topology=topo).load(sp.TrainState(model=model))
    loaded = {}
    for key, value in model.sharded_state_dict().items():
        tensor = value.tensor if hasattr(value, "tensor") else value
        loaded[key] = tensor.detach().clone()
    return {"release": result.release, "finetune": result.finetune, "loaded": loaded}


def check_ep_rank(got: dict, ep_rank: int, params: dict) -> None:
    """One ep rank of an ep=2 load of a 4-expert import: experts ``2r`` and ``2r+1`` and every dense tensor, equal."""
    assert got["release"] and got["finetune"]
    experts = {n.split("local_experts.")[1].split(".")[0] for n in got["loaded"] if "local_experts." in n}
    assert experts == {str(2 * ep_rank), str(2 * ep_rank + 1)}
    assert sorted(got["loaded"]) == sorted(
        n for n in params if "local_experts." not in n or n.split("local_experts.")[1][0] in experts
    )
    for name, tensor in got["loaded"].items():
        assert torch.equal(tensor, params[name]), name


def test_the_hf_import_loads_at_ep2_on_two_ranks(tmp_path):
    hf, _ = small_mixtral(tmp_path)
    done = run_cli("convert", "--from", "hf", hf, tmp_path / "dist")
    assert done.rc == 0, done.err
    params = read_hf(hf).params  # Megatron names, global expert ids, padded vocabulary
    original = tensors_of(hf)
    results = launch(_load_weights, 2, str(tmp_path / "dist"), 2, {n: t.shape for n, t in params.items()})
    for ep_rank, got in enumerate(results):  # tp=1, dp=2, ep=2: rank r holds experts 2r, 2r+1
        check_ep_rank(got, ep_rank, params)
        g = 2 * ep_rank + 1
        fc1 = got["loaded"][f"decoder.layers.1.mlp.experts.local_experts.{g}.linear_fc1.weight"]
        w1, w3 = (original[f"model.layers.1.block_sparse_moe.experts.{g}.{w}.weight"] for w in ("w1", "w3"))
        assert torch.equal(fc1, torch.cat([w1, w3]))  # [gate; up]
        router = got["loaded"]["decoder.layers.0.mlp.router.weight"]
        assert torch.equal(router, original["model.layers.0.block_sparse_moe.gate.weight"])


@pytest.mark.parametrize("fixture", [EP2, EP1])
def test_the_sigmoid_shared_expert_fixtures_are_refused_naming_each_feature(fixture, tmp_path):
    result = run_cli("export", MOE / fixture / "ckpt", "--to", "hf", tmp_path / "out")
    assert result.rc == 1
    message = result.one_line_error()
    for feature in (
        r"not Mixtral-like \(MixtralForCausalLM\)",
        r"a sigmoid router \(--moe-router-score-function sigmoid",
        r"a router expert bias \(--moe-router-enable-expert-bias\)",
        r"shared experts \(--moe-shared-expert-intermediate-size\)",
    ):
        assert re.search(feature, message), (feature, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"moe_router_pre_softmax": True}, r"softmax before top-k \(--moe-router-pre-softmax"),
        ({"moe_router_topk_scaling_factor": 2.5}, r"a top-k scaling factor"),
        ({"moe_router_num_groups": 2, "moe_router_group_topk": 1}, r"group-limited routing"),
        ({"moe_expert_capacity_factor": 1.0}, r"token dropping \(--moe-expert-capacity-factor\)"),
        ({"moe_input_jitter_eps": 0.01}, r"router input jitter"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, r"Sinkhorn routing"),
        ({"moe_layer_freq": [1, 0]}, r"dense layers among the MoE layers"),
        ({"moe_apply_probs_on_input": True}, r"router probabilities applied to the expert input"),
        ({"swiglu": False}, r"a non-gated MLP"),
    ],
)
def test_what_mixtral_cannot_compute_is_refused_by_name(change, expected, tmp_path):
    assert_export_refused(MIXTRAL, change, r"not Mixtral-like \(MixtralForCausalLM\): .*" + expected, tmp_path)


def assert_export_refused(fixture: Path, change: dict, message: str, tmp_path: Path) -> None:
    """``export --to hf`` of ``fixture`` with its args changed raises ``message`` and writes nothing."""
    ckpt = read_foreign(fixture / "ckpt", optimizer=False)
    ckpt.args.update(change)
    with pytest.raises(CheckpointError, match=message):
        export_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_hf_mixtrals_megatron_cannot_hold_exactly_are_refused_by_name(tmp_path):
    hf, _ = small_mixtral(tmp_path)
    config_path = hf / "config.json"
    original = json.loads(config_path.read_text())
    for change, expected in (
        ({"sliding_window": 16}, r"sliding-window attention \(sliding_window 16\)"),
        ({"router_jitter_noise": 0.1}, r"router jitter"),
        ({"hidden_act": "gelu"}, r"activation 'gelu'"),
    ):
        config_path.write_text(json.dumps(original | change))
        with pytest.raises(CheckpointError, match=expected):
            read_hf(hf)
