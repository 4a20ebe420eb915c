"""Mixture-of-experts models to and from Hugging Face weights (issue 37 item 4): stacked experts ↔ per-expert keys.

transformers 5 holds a MoE layer's experts stacked (``experts.gate_up_proj`` [E, 2F, H],
``experts.down_proj`` [E, H, F]); ``save_pretrained`` writes one tensor per expert
(Mixtral: ``block_sparse_moe.experts.<e>.w1/w3/w2``; Qwen3-MoE: ``mlp.experts.<e>.gate_proj/
up_proj/down_proj``). The reference is transformers itself: what ``save_pretrained``
wrote and what ``from_pretrained`` computes. Ranks are real gloo processes; the experts
are sharded over an expert-parallel mesh (DTensor ``Shard(0)`` over the expert dim) or
by FSDP2.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from safetensors import safe_open

import shardpoint as sp
from tests import distributed
from tests.test_hf_weights import stored_tensor_bytes

transformers = pytest.importorskip("transformers")

launch = functools.partial(distributed.launch, backend="gloo")
TOKENS = torch.arange(2 * 10).reshape(2, 10) * 5 % 128
EXPERTS = 4


def config(family: str):
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if family == "mixtral":
        return transformers.MixtralConfig(
            **common, intermediate_size=16, num_local_experts=EXPERTS, num_experts_per_tok=2
        )
    return transformers.Qwen3MoeConfig(
        **common, intermediate_size=48, moe_intermediate_size=16, num_experts=EXPERTS, num_experts_per_tok=2, head_dim=8
    )


def model_class(family: str):
    return transformers.MixtralForCausalLM if family == "mixtral" else transformers.Qwen3MoeForCausalLM


def reference(directory: str, family: str) -> dict[str, torch.Tensor]:
    """save_pretrained of a seeded model; its state dict (the stacked, in-memory names)."""
    torch.manual_seed(0)
    model = model_class(family)(config(family))
    model.save_pretrained(directory, max_shard_size="50KB")
    return {k: v.clone() for k, v in model.state_dict().items()}


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def build(family: str, mesh: str | None, world: int = 1, seed: int = 1):
    """The model with other random weights: experts sharded over ``ep`` (DTensor), FSDP2 over ``dp``, or plain."""
    torch.manual_seed(seed)
    model = model_class(family)(config(family))
    if mesh is None:
        return model
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(mesh,))
    if mesh == "ep":
        from torch.distributed.tensor import Shard, distribute_tensor

        for layer in model.model.layers:
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(experts, name)
                setattr(experts, name, torch.nn.Parameter(distribute_tensor(full.data, device_mesh, [Shard(0)])))
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=device_mesh)
        fully_shard(model, mesh=device_mesh)
    return model


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def expert_bytes(model) -> int:
    """Bytes of this rank's pieces of the stacked expert parameters."""
    total = 0
    for layer in model.model.layers:
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(layer.mlp.experts, name)
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_per_expert_keys_load_into_stacked_experts_and_save_back_as_transformers_writes_them(tmp_path, family):
    """One process: load equals from_pretrained; the save has save_pretrained's keys, and from_pretrained reads it."""
    expected = reference(str(tmp_path / "hf"), family)
    per_expert = "block_sparse_moe.experts.3.w3" if family == "mixtral" else "mlp.experts.3.up_proj"
    assert f"model.layers.1.{per_expert}.weight" in _all_keys(tmp_path / "hf")  # what transformers stores
    model = build(family, None)
    result = sp.load_hf_weights(model, tmp_path / "hf")
    assert not result.missing and not result.unexpected
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[key]), key
    sp.save_hf_weights(model, tmp_path / "out", max_shard_size="50KB")
    assert _all_keys(tmp_path / "out") == _all_keys(tmp_path / "hf")
    reloaded, info = model_class(family).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    torch.testing.assert_close(logits_of(reloaded), logits_of(model), rtol=0, atol=0)


def _all_keys(directory) -> set[str]:
    keys: set[str] = set()
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                keys |= set(f.keys())
    return keys


def _load_sharded(rank, world, family, mesh, source, out):
    model = build(family, mesh, world)
    result = sp.load_hf_weights(model, source)
    own_experts = expert_bytes(model)
    state = full_state(model)
    sp.save_hf_weights(model, out, max_shard_size="50KB")
    return {"state": state, "bytes_read": result.bytes_read, "expert_bytes": own_experts}


@pytest.mark.parametrize("family, mesh", [("mixtral", "ep"), ("qwen3_moe", "ep"), ("mixtral", "dp")])
def test_an_expert_sharded_model_loads_its_own_experts_and_saves_what_from_pretrained_reads(tmp_path, family, mesh):
    """2 ranks, each holding half the experts: every stored byte is read once across ranks, each rank read
    at least its own experts' bytes, the full tensors equal from_pretrained's, and the save reloads."""
    source, out = str(tmp_path / "hf"), str(tmp_path / "out")
    expected = reference(source, family)
    results = launch(_load_sharded, 2, family, mesh, source, out)
    for result in results:
        assert result["state"].keys() == expected.keys()
        for key, tensor in result["state"].items():
            assert torch.equal(tensor, expected[key]), key
        assert result["bytes_read"] >= result["expert_bytes"] > 0
    assert sum(r["bytes_read"] for r in results) == stored_tensor_bytes(source)
    assert _all_keys(out) == _all_keys(source)
    reloaded = model_class(family).from_pretrained(out)
    for key, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[key]), key


def test_only_families_that_transformers_stores_per_expert_are_split():
    """gpt-oss keeps its stacked experts on disk as in memory; splitting them would miss every stored key."""
    from shardpoint.formats.hf_experts import expert_scheme

    class Holder(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config

    assert expert_scheme(Holder(transformers.GptOssConfig())) is None
    assert expert_scheme(Holder(transformers.LlamaConfig())) is None
    assert expert_scheme(torch.nn.Linear(2, 2)) is None
    assert expert_scheme(Holder(config("mixtral")))[1:] == ("w1", "w3", "w2")
    assert expert_scheme(Holder(config("qwen3_moe")))[1:] == ("gate_proj", "up_proj", "down_proj")
