"""``export --to hf`` of a Megatron-LM GPT: the Hugging Face model computes what Megatron computed.

The Megatron fixtures are GPT-2-like (learned absolute positions, LayerNorm, erf GeLU,
biases, untied output layer; see their MANIFEST.json). The reference is a forward pass
written here with plain torch ops straight from the truth tensors (Megatron's own
per-query-group QKV interleave, padded vocabulary); it is itself checked against the
logits Megatron-LM computed on a fixed batch when it wrote ``megatron-legacy-tp1``
(``logits.pt``, copied from the shared fixtures).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from shardpoint.errors import CheckpointError
from shardpoint.foreign import import_checkpoint, read_foreign
from shardpoint.foreign.hf import export_hf, hf_config
from tests.test_cli_commands import run_cli
from tests.test_foreign_import import FIXTURES, truth

transformers = pytest.importorskip("transformers")

WE, PE, OUT = "embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer.weight"
HEADS, GROUPS, LAYERS, VOCAB = 4, 4, 4, 128
MEGATRON_LOGITS = FIXTURES / "megatron-legacy-tp1" / "logits.pt"
TOL = 1e-5


def reference_logits(t: dict[str, torch.Tensor], tokens: torch.Tensor, output: torch.Tensor | None = None):
    """Megatron GPTModel's forward (local spec, learned positions, no dropout) in plain torch ops."""
    b, s = tokens.shape
    hidden = t[WE].shape[1]
    head_dim = hidden // HEADS
    x = t[WE][tokens] + t[PE][:s]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."

        def ln(x, name, p=p):
            return F.layer_norm(x, (hidden,), t[p + name + ".weight"], t[p + name + ".bias"], 1e-5)

        def linear(x, name, p=p):
            return F.linear(x, t[p + name + ".weight"], t[p + name + ".bias"])

        qkv = linear(ln(x, "input_layernorm"), "self_attention.linear_qkv")
        qkv = qkv.view(b, s, GROUPS, HEADS // GROUPS + 2, head_dim)  # [q heads of group g, k_g, v_g]
        q = qkv[..., : HEADS // GROUPS, :].reshape(b, s, HEADS, head_dim).transpose(1, 2)
        k = qkv[..., -2, :].repeat_interleave(HEADS // GROUPS, dim=2).transpose(1, 2)
        v = qkv[..., -1, :].repeat_interleave(HEADS // GROUPS, dim=2).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
        context = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + linear(context.transpose(1, 2).reshape(b, s, hidden), "self_attention.linear_proj")
        x = x + linear(F.gelu(linear(ln(x, "pre_mlp_layernorm"), "mlp.linear_fc1")), "mlp.linear_fc2")
    x = F.layer_norm(x, (hidden,), t["decoder.final_layernorm.weight"], t["decoder.final_layernorm.bias"], 1e-5)
    return F.linear(x, t[OUT] if output is None else output)


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return torch.load(MEGATRON_LOGITS, weights_only=True)  # tokens [2, 32], logits [2, 32, padded vocab]


def hf_logits(directory, tokens: torch.Tensor) -> torch.Tensor:
    model, info = transformers.GPT2LMHeadModel.from_pretrained(str(directory), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert (got - want).abs().max() <= TOL, float((got - want).abs().max())


def test_the_reference_forward_is_what_megatron_computed(batch):
    close(reference_logits(truth("megatron-legacy-tp1"), batch["tokens"]), batch["logits"])


@pytest.mark.parametrize("fixture", ["megatron-legacy-tp2", "megatron-torchdist-tp2"])
def test_hf_model_of_each_megatron_format_gives_the_reference_logits(fixture, batch, tmp_path):
    export_hf(read_foreign(FIXTURES / fixture / "ckpt"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["activation_function"] == "gelu" and not config["tie_word_embeddings"]
    close(hf_logits(tmp_path, batch["tokens"]), reference_logits(truth(fixture), batch["tokens"]))


def test_vocabulary_padding_is_dropped(batch, tmp_path):
    ckpt = read_foreign(FIXTURES / "megatron-legacy-tp1" / "ckpt")
    junk = torch.Generator().manual_seed(0)
    for name in (WE, OUT):  # as Megatron pads at tp=3: 128 -> 192 rows
        ckpt.params[name] = torch.cat([ckpt.params[name], torch.randn(64, 64, generator=junk)])
    ckpt.args["padded_vocab_size"] = 192
    export_hf(ckpt, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == VOCAB
    close(hf_logits(tmp_path, batch["tokens"]), reference_logits(truth("megatron-legacy-tp1"), batch["tokens"]))
    del ckpt.args["vocab_size"]  # a tokenizer set it: only the caller knows it
    with pytest.raises(CheckpointError, match="--vocab-size"):
        export_hf(ckpt, tmp_path / "again")
    export_hf(ckpt, tmp_path / "again", vocab_size=VOCAB)
    close(hf_logits(tmp_path / "again", batch["tokens"]), batch["logits"])


def test_tied_embeddings_and_missing_linear_biases(batch, tmp_path):
    t = truth("megatron-legacy-tp1")
    ckpt = read_foreign(FIXTURES / "megatron-legacy-tp1" / "ckpt")
    ckpt.args["untie_embeddings_and_output_weights"] = False
    del ckpt.params[OUT]
    for i in range(LAYERS):  # --disable-bias-linear: the model computed with zero biases
        for name in ("self_attention.linear_proj.bias", "mlp.linear_fc2.bias"):
            del ckpt.params[f"decoder.layers.{i}.{name}"]
            t[f"decoder.layers.{i}.{name}"] = torch.zeros(64)
    export_hf(ckpt, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"]
    close(hf_logits(tmp_path, batch["tokens"]), reference_logits(t, batch["tokens"], output=t[WE]))


def test_models_gpt2_cannot_hold_are_refused_naming_what_differs(tmp_path):
    source = read_foreign(FIXTURES / "megatron-legacy-tp1" / "ckpt")
    llama = copy.deepcopy(source)
    llama.args.update(swiglu=True, position_embedding_type="rope", normalization="RMSNorm")
    with pytest.raises(CheckpointError, match=r"'rope'.*RMSNorm.*gated MLP \(--swiglu\)"):
        export_hf(llama, tmp_path)
    gqa = copy.deepcopy(source)
    gqa.args.update(group_query_attention=True, num_query_groups=2)
    with pytest.raises(CheckpointError, match="grouped-query attention"):
        export_hf(gqa, tmp_path)
    extra = copy.deepcopy(source)
    extra.params["decoder.layers.0.mlp.router.weight"] = torch.zeros(2, 64)
    with pytest.raises(CheckpointError, match=r"no place for.*router\.weight"):
        export_hf(extra, tmp_path)
    with pytest.raises(CheckpointError, match="deepspeed checkpoint"):
        export_hf(read_foreign(FIXTURES / "deepspeed-zero1-dp2" / "ckpt"), tmp_path)
    assert not list(tmp_path.iterdir())  # refused before writing anything
    fused = copy.deepcopy(source)
    fused.args["bias_gelu_fusion"] = True  # Megatron's fused bias-GeLU is the tanh approximation
    assert hf_config(fused)["activation_function"] == "gelu_new"


def test_cli_exports_through_the_import_and_in_place(batch, tmp_path):
    import_checkpoint(FIXTURES / "megatron-legacy-tp2" / "ckpt", tmp_path / "imported")
    sources = {"torch": tmp_path / "imported", "torch_dist": FIXTURES / "megatron-torchdist-tp2" / "ckpt"}
    for fmt, source in sources.items():
        result = run_cli("export", source, "--to", "hf", tmp_path / fmt, "--json")
        assert result.rc == 0, result.err
        report = result.json()
        assert (report["format"], report["vocab_size"], report["layers"]) == (fmt, VOCAB, LAYERS)
        assert report["imported"] == (fmt == "torch")  # the dist checkpoint imported from legacy files
        close(hf_logits(tmp_path / fmt, batch["tokens"]), batch["logits"])
