"""Llama-family models between Megatron-LM and Hugging Face, both ways, checked against Megatron's own files.

Megatron → HF: the ``LlamaForCausalLM`` exported from Megatron-LM's checkpoints computes
the logits Megatron-LM itself computed (``llama-legacy-tp1/logits.pt``). HF → Megatron:
the legacy files written equal the ones Megatron-LM wrote for the same weights, and a
model built by ``transformers`` comes back from Megatron tp=2 pp=2 tensor for tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardpoint as sp
from shardpoint.errors import CheckpointError, CorruptCheckpointError, MissingKeysError
from shardpoint.foreign import read_foreign
from shardpoint.foreign.exporter import export_megatron
from shardpoint.foreign.hf import export_hf
from shardpoint.foreign.hf_import import read_hf
from tests.test_cli_commands import run_cli
from tests.test_foreign_export import assert_same, rank_file
from tests.test_foreign_import import build_model

transformers = pytest.importorskip("transformers")

LLAMA = Path(__file__).parent / "fixtures" / "megatron-llama"
LEGACY_TP2 = LLAMA / "llama-legacy-tp2" / "ckpt"
DISTOPT = LLAMA / "llama-torchdist-tp2-dp2-distopt" / "ckpt"
TOL = 1e-5


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return torch.load(LLAMA / "llama-legacy-tp1" / "logits.pt", weights_only=True)  # Megatron's forward, tp=1


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= TOL, float((got - want).abs().max())


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


@pytest.mark.parametrize("source", [LEGACY_TP2, DISTOPT], ids=["legacy-tp2", "torchdist-tp2-dp2-distopt"])
def test_the_exported_llama_computes_megatrons_logits(source, batch, tmp_path):
    export_hf(read_foreign(source, optimizer=False), tmp_path, max_shard_size="150KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    config = json.loads((tmp_path / "config.json").read_text())
    reference = json.loads((LLAMA / "llama-legacy-tp1" / "hf_config.json").read_text())
    for key in ("num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "intermediate_size", "vocab_size"):
        assert config[key] == reference[key], key
    assert not config["tie_word_embeddings"] and "lm_head.weight" in index["weight_map"]
    close(hf_logits(tmp_path, batch["tokens"]), batch["logits"])


def test_cli_exports_a_llama_from_the_import_and_in_place(batch, tmp_path):
    imported = run_cli("convert", "--from", "megatron", DISTOPT, tmp_path / "dist", "--json")
    assert imported.rc == 0, imported.err
    for name, source in (("imported", tmp_path / "dist"), ("in-place", LEGACY_TP2)):
        result = run_cli("export", source, "--to", "hf", tmp_path / name, "--json")
        assert result.rc == 0, result.err
        report = result.json()
        assert (report["architecture"], report["layers"], report["vocab_size"]) == ("LlamaForCausalLM", 2, 128)
        assert report["imported"] == (name == "imported") and report["weight_files"] == ["model.safetensors"]
        close(hf_logits(tmp_path / name, batch["tokens"]), batch["logits"])


def test_what_llama_cannot_hold_is_refused_naming_each_feature(tmp_path):
    ckpt = read_foreign(LEGACY_TP2, optimizer=False)
    for change, expected in (
        ({"num_experts": 8}, r"mixture of experts"),
        ({"multi_latent_attention": True}, r"multi-latent attention"),
        ({"rotary_percent": 0.5}, r"partial rotary embeddings \(rotary_percent 0\.5 < 1\)"),
        ({"add_qkv_bias": True}, r"QKV biases.*Qwen2ForCausalLM.*no fixture verifies"),
        ({"rotary_interleaved": True, "qk_layernorm": True}, r"interleaved RoPE.*query/key normalization"),
    ):
        original = {k: ckpt.args.get(k) for k in change}
        ckpt.args.update(change)
        with pytest.raises(CheckpointError, match=r"not Llama-like \(LlamaForCausalLM\): .*" + expected):
            export_hf(ckpt, tmp_path / "out")
        ckpt.args.update(original)
    ckpt.params["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.zeros(128)
    with pytest.raises(CheckpointError, match=r"no place for.*linear_qkv\.bias"):
        export_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def small_llama(tmp_path: Path, tie: bool = False) -> tuple[Path, torch.nn.Module]:
    """A LlamaForCausalLM built by transformers: GQA, a vocabulary Megatron pads, non-default RoPE base and eps."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, so that a swapped norm shows
            p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / ("hf-tied" if tie else "hf")
    model.save_pretrained(str(path), max_shard_size="200KB")
    return path, model


def test_a_transformers_llama_through_megatron_tp2_pp2_and_back_is_identical(tmp_path):
    hf, model = small_llama(tmp_path)
    assert (hf / "model.safetensors.index.json").exists()  # sharded input
    meg = tmp_path / "megatron"
    flags = ("--from", "hf", "--to", "megatron", "--tp", 2, "--pp", 2, "--distributed-optimizer", "--json")
    written = run_cli("convert", hf, meg, *flags)
    assert written.rc == 0, written.err
    assert written.json()["release"] and (meg / "latest_checkpointed_iteration.txt").read_text() == "release"
    folders = sorted(p.name for p in (meg / "release").iterdir())
    assert folders == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    state = sp_load(meg / "release" / "mp_rank_01_001" / "model_optim_rng.pt")
    assert list(state) == ["args", "checkpoint_version", "iteration", "model", "num_floating_point_operations_so_far"]
    assert "decoder.layers.1.mlp.linear_fc1.weight" in state["model"] and "output_layer.weight" in state["model"]
    assert state["args"].padded_vocab_size == 256 and state["args"].use_distributed_optimizer  # 100 -> 128 * tp
    back = run_cli("export", meg, "--to", "hf", tmp_path / "back", "--json")
    assert back.rc == 0, back.err
    original, again = tensors_of(hf), tensors_of(tmp_path / "back")
    assert sorted(original) == sorted(again)
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["rope_theta"], config["rms_norm_eps"], config["num_key_value_heads"]) == (50000.0, 1e-6, 2)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(hf_model(tmp_path / "back")(tokens).logits, model.eval()(tokens).logits)


def sp_load(path: Path) -> dict:
    from shardpoint.foreign._unpickle import load_foreign

    return load_foreign(path)


def hf_model(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()


def test_hf_to_megatron_writes_the_files_megatron_wrote(tmp_path):
    export_hf(read_foreign(LEGACY_TP2, optimizer=False), tmp_path / "hf")  # the fixture's weights as an HF model
    ckpt = read_hf(tmp_path / "hf")
    ckpt.args["make_vocab_size_divisible_by"] = 64  # the fixture run's choice (Megatron's default is 128)
    export_megatron(ckpt, tmp_path / "meg", tp=2, pp=1)
    for folder in ("mp_rank_00", "mp_rank_01"):
        mine = sp_load(tmp_path / "meg" / "release" / folder / "model_optim_rng.pt")
        real = rank_file(LEGACY_TP2, folder)
        assert_same(mine["model"], real["model"], "model")  # names, order, _extra_state, [gate_r; up_r] halves
        assert [k for k in real if k in mine] == list(mine)
        assert mine["checkpoint_version"] == real["checkpoint_version"]
        ours, theirs = vars(mine["args"]), vars(real["args"])
        differing = {k for k in ours if ours[k] != theirs.get(k, "<absent>")}
        # what the HF side cannot know: the run's tokenizer and progress; everything Megatron's loader checks agrees
        assert differing == {"tokenizer_type", "tokenizer_model", "iteration", "consumed_train_samples"}
    for key in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size", "tensor_model_parallel_size"):
        assert ours[key] == theirs[key]  # check_checkpoint_args compares these


def test_a_tied_llama_imports_as_dist_and_loads_through_the_checkpointer(tmp_path):
    hf, _ = small_llama(tmp_path, tie=True)
    result = run_cli("convert", "--from-hf", hf, tmp_path / "dist", "--json")  # the old spelling still works
    assert result.rc == 0, result.err
    report = result.json()
    assert report["release"] and report["config"]["untie_embeddings_and_output_weights"] is False
    original = tensors_of(hf)
    full = read_hf(hf).params
    model = build_model({name: t.shape for name, t in full.items()})
    loaded = sp.Checkpointer(tmp_path / "dist", topology=sp.Topology(1, 1, 1, rank=0)).load(sp.TrainState(model=model))
    assert loaded.release and loaded.finetune and loaded.iteration == 0
    params = dict(model.named_parameters())
    assert "output_layer.weight" not in params and params["embedding.word_embeddings.weight"].shape[0] == 128
    assert torch.equal(params["embedding.word_embeddings.weight"][:100], original["model.embed_tokens.weight"])
    back = run_cli("export", tmp_path / "dist", "--to", "hf", tmp_path / "back")
    assert back.rc == 0, back.err
    again = tensors_of(tmp_path / "back")
    assert sorted(again) == sorted(k for k in original if k != "lm_head.weight")
    assert all(torch.equal(again[k], original[k]) for k in again)


def test_a_gpt2_through_megatron_and_back_is_identical(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=120, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp_path / "hf"))
    export_megatron(read_hf(tmp_path / "hf"), tmp_path / "meg", tp=2, pp=2)
    back = read_foreign(tmp_path / "meg")
    assert back.params["decoder.layers.1.self_attention.linear_qkv.bias"].shape == (96,)
    export_hf(back, tmp_path / "back")
    original, again = tensors_of(tmp_path / "hf"), tensors_of(tmp_path / "back")
    assert sorted(original) == sorted(again) and all(torch.equal(again[k], original[k]) for k in original)


def test_damaged_safetensors_are_named(tmp_path):
    hf, _ = small_llama(tmp_path)
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    saved = shard.read_bytes()
    shard.write_bytes(saved[:-100])  # truncated
    with pytest.raises(CorruptCheckpointError, match=rf"{shard.name} is damaged: .*not fully covered"):
        read_hf(hf)
    garbled = bytearray(saved)
    garbled[10] ^= 0xFF  # inside the JSON header
    shard.write_bytes(bytes(garbled))
    with pytest.raises(CorruptCheckpointError, match=rf"{shard.name} is damaged"):
        read_hf(hf)
    shard.unlink()
    result = run_cli("convert", "--from", "hf", hf, tmp_path / "x")
    assert result.rc == 1 and f"{shard.name} is missing" in result.one_line_error()
    shard.write_bytes(saved)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shard.name
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=rf"{shard.name} lacks \['model\.layers\.9"):
        read_hf(hf)
    assert not (tmp_path / "x").exists()


def test_hf_models_megatron_cannot_hold_exactly_are_refused_by_name(tmp_path):
    hf, _ = small_llama(tmp_path)
    config_path = hf / "config.json"
    original = json.loads(config_path.read_text())
    for change, expected in (
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, r"'qwen2' \(Qwen2ForCausalLM\)"),
        ({"attention_bias": True}, r"attention biases"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, r"RoPE scaling 'llama3'"),
        ({"hidden_act": "gelu"}, r"activation 'gelu'"),
    ):
        config_path.write_text(json.dumps(original | change))
        with pytest.raises(CheckpointError, match=expected):
            read_hf(hf)
    config_path.write_text(json.dumps(original))
    assert read_hf(hf).args["num_query_groups"] == 2
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, str(hf / "model-extra.safetensors"))
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.q_norm.weight"] = "model-extra.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingKeysError, match=r"q_norm"):  # a tensor Llama has no place for (Qwen3's q norm)
        read_hf(hf)
