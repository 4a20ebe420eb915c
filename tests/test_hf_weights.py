"""Hugging Face weights straight into FSDP2 / tensor-parallel LlamaForCausalLM, and out again from every rank.

The reference is always ``transformers`` itself: a checkpoint written by ``save_pretrained``
and the logits of ``from_pretrained`` in this (one) process. Ranks are real gloo processes;
S3 is a real (moto) server.
"""

from __future__ import annotations

import functools
import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import shardpoint as sp
from shardpoint.formats.hf_weights import ShapeMismatchError
from tests import distributed

transformers = pytest.importorskip("transformers")

# DeviceMesh needs plain gloo (see tests/test_fsdp2.py)
launch = functools.partial(distributed.launch, backend="gloo")

VOCAB = 256
TOKENS = torch.arange(2 * 12).reshape(2, 12) * 7 % VOCAB


def llama_config(tied: bool = False):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )


def reference(directory: str, tied: bool = False, max_shard_size: str = "100KB") -> torch.Tensor:
    """Write a LlamaForCausalLM with save_pretrained; return from_pretrained's logits on TOKENS."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(tied)).save_pretrained(directory, max_shard_size=max_shard_size)
    return hf_logits(directory)


def hf_logits(directory: str) -> torch.Tensor:
    model, info = transformers.LlamaForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def stored_tensor_bytes(directory: str) -> int:
    total = 0
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                total += sum(_nbytes(f.get_slice(k)) for k in f.keys())  # noqa: SIM118 - safe_open is not a dict
    return total


def _nbytes(piece) -> int:
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}
    count = 1
    for size in piece.get_shape():
        count *= size
    return count * sizes[piece.get_dtype()]


def build(mesh_sizes: dict[str, int], tied: bool = False, seed: int = 1):
    """A LlamaForCausalLM with other random weights, parallelised over ``mesh_sizes`` (dp: FSDP2, tp: DTensor TP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(tied))
    if not mesh_sizes:
        return model
    names = tuple(mesh_sizes)
    mesh = init_device_mesh("cpu", tuple(mesh_sizes.values()), mesh_dim_names=names)
    if "tp" in mesh_sizes:
        plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan |= {f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")}
        plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
    if "dp" in mesh_sizes:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def local_bytes(model) -> int:
    """Bytes of this rank's own pieces of the model's tensors (tied ones once)."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total


def _load(rank, world, path, mesh_sizes, save_to=None):
    model = build(mesh_sizes)
    result = sp.load_hf_weights(model, path)
    own = local_bytes(model)  # before the forward: FSDP2 leaves the root's parameters unsharded after it
    if save_to:
        sp.save_hf_weights(model, save_to, max_shard_size="100KB")
    return {"logits": logits(model), "bytes_read": result.bytes_read, "local_bytes": own}


def test_fsdp2_load_gives_from_pretrained_logits_and_each_rank_reads_only_its_shards(tmp_path):
    expected = reference(str(tmp_path))
    assert os.path.exists(tmp_path / "model.safetensors.index.json")  # several files and the index
    results = launch(_load, 2, str(tmp_path), {"dp": 2})
    for result in results:
        torch.testing.assert_close(result["logits"], expected, rtol=0, atol=1e-6)
        assert result["bytes_read"] == result["local_bytes"]  # its own dim-0 pieces, nothing else
    assert sum(r["bytes_read"] for r in results) == stored_tensor_bytes(str(tmp_path))


@pytest.mark.parametrize("mesh_sizes, world", [({"dp": 2, "tp": 2}, 4), ({}, 2)], ids=["fsdp2-tp", "replicated"])
def test_shared_tensors_are_read_once_across_ranks(tmp_path, mesh_sizes, world):
    """2-D FSDP2 x TP (norms and embeddings on both tp ranks, row-parallel columns interleaved), and a plain
    model on every rank: each stored byte is read by one rank and passed on."""
    expected = reference(str(tmp_path))
    results = launch(_load, world, str(tmp_path), mesh_sizes)
    for result in results:
        torch.testing.assert_close(result["logits"], expected, rtol=0, atol=1e-5)
    reads = [r["bytes_read"] for r in results]
    assert sum(reads) == stored_tensor_bytes(str(tmp_path))
    assert min(reads) > 0  # the reading is shared out


def test_load_from_s3_and_save_back(s3_server, bucket, tmp_path):
    """Ranged GETs only for each rank's shards; the save writes in place, the index last."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    expected = reference(str(tmp_path / "hf"))
    fs.put(str(tmp_path / "hf"), f"{bucket}/llama", recursive=True)
    results = launch(_load, 2, f"{bucket}/llama", {"dp": 2}, f"{bucket}/saved", env=s3_server.env)
    for result in results:
        torch.testing.assert_close(result["logits"], expected, rtol=0, atol=1e-6)
        assert result["bytes_read"] == result["local_bytes"]
    fs.get(f"{bucket}/saved", str(tmp_path / "saved"), recursive=True)
    assert os.path.exists(tmp_path / "saved" / "model.safetensors.index.json")
    torch.testing.assert_close(hf_logits(str(tmp_path / "saved")), expected, rtol=0, atol=0)


def _save(rank, world, source, out, mesh_sizes, tied, dtype, max_shard_size):
    model = build(mesh_sizes, tied=tied)
    sp.load_hf_weights(model, source)
    result = sp.save_hf_weights(model, out, dtype=dtype, max_shard_size=max_shard_size)
    return result.files, result.bytes_written


@pytest.mark.parametrize(
    "mesh, tied",
    [({"dp": 2}, False), ({"dp": 2}, True), ({"dp": 2, "tp": 2}, False)],
    ids=["fsdp2", "tied", "fsdp2-tp"],
)
def test_save_from_every_rank_loads_with_from_pretrained(tmp_path, mesh, tied):
    source, out = str(tmp_path / "src"), str(tmp_path / "out")
    expected = reference(source, tied=tied, max_shard_size="1GB")
    results = launch(_save, math.prod(mesh.values()), source, out, mesh, tied, None, "100KB")
    files = results[0][0]
    assert len(files) > 2 and os.path.exists(f"{out}/model.safetensors.index.json")
    assert all(written > 0 for _, written in results)  # both ranks wrote files
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == sorted(files)
    torch.testing.assert_close(hf_logits(out), expected, rtol=0, atol=0)
    saved = {k: v for f in files for k, v in load_file(f"{out}/{f}").items()}
    assert ("lm_head.weight" in saved) == (not tied)  # tied weights are written once, as save_pretrained does


def test_save_casts_to_dtype_and_replaces_an_older_single_file(tmp_path):
    source, out = str(tmp_path / "src"), str(tmp_path / "out")
    reference(source, max_shard_size="1GB")
    os.makedirs(out)
    save_file({"stale": torch.zeros(3)}, f"{out}/model.safetensors", metadata={"format": "pt"})
    (files, _), _ = launch(_save, 2, source, out, {"dp": 2}, False, torch.bfloat16, "200KB")
    assert not os.path.exists(f"{out}/model.safetensors")  # from_pretrained would prefer it to the index
    original = load_file(f"{source}/model.safetensors")
    with open(f"{out}/model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(original)
    for name in files:
        for key, value in load_file(f"{out}/{name}").items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, original[key].to(torch.bfloat16)), key
    assert hf_logits(out).shape == (2, 12, VOCAB)  # loads with no missing or unexpected keys


def _damage(directory: str, how: str) -> str:
    """Damage the second shard of the checkpoint; return its name."""
    name = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))[1]
    path = os.path.join(directory, name)
    with open(path, "rb") as f:
        data = f.read()
    if how == "truncated":
        data = data[: len(data) - 100]
    elif how == "header-length":
        data = (10**9).to_bytes(8, "little") + data[8:]
    else:  # not JSON
        data = data[:8] + b"\xff{" + data[10:]
    with open(path, "wb") as f:
        f.write(data)
    return name


@pytest.mark.parametrize(
    "how, says",
    [
        ("truncated", "is truncated: its header places"),
        ("header-length", "header length"),
        ("bad-json", "not valid JSON"),
    ],
)
def test_damaged_safetensors_is_named_before_anything_is_loaded(tmp_path, how, says):
    reference(str(tmp_path))
    name = _damage(str(tmp_path), how)
    model = build({})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(sp.CorruptCheckpointError, match=f"{name}.*{says}|{says}.*{name}"):
        sp.load_hf_weights(model, str(tmp_path))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # found from the headers alone


def test_damage_fails_every_rank_without_a_hang(tmp_path):
    reference(str(tmp_path))
    name = _damage(str(tmp_path), "truncated")
    with pytest.raises(distributed.RankFailure) as failure:
        launch(_load, 2, str(tmp_path), {"dp": 2}, timeout=60)
    assert len(failure.value.errors) == 2 and all(name in tb for tb in failure.value.errors.values())


def test_missing_unexpected_and_misshapen_keys_are_named(tmp_path):
    reference(str(tmp_path), max_shard_size="1GB")
    tensors = load_file(f"{tmp_path}/model.safetensors")
    tensors["extra.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(sp.MissingKeysError, match=r"model\.layers\.1\.mlp\.up_proj\.weight") as error:
        sp.load_hf_weights(build({}), str(tmp_path))
    assert error.value.unexpected == ["extra.weight"]
    model = build({})
    result = sp.load_hf_weights(model, str(tmp_path), strict=False)
    assert result.missing == ["model.layers.1.mlp.up_proj.weight"] and result.unexpected == ["extra.weight"]
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors.pop("extra.weight")[:, :32].contiguous()
    save_file(tensors, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShapeMismatchError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        sp.load_hf_weights(build({}), str(tmp_path))


def test_base_model_checkpoint_loads_into_the_causal_lm_wrapped_by_torch_compile(tmp_path):
    """Names: a LlamaModel checkpoint (no ``model.`` prefix) into LlamaForCausalLM under torch.compile."""
    torch.manual_seed(0)
    base = transformers.LlamaModel(llama_config())
    base.save_pretrained(str(tmp_path))
    model = build({})
    result = sp.load_hf_weights(torch.compile(model), str(tmp_path), strict=False)
    assert result.missing == ["lm_head.weight"] and not result.unexpected
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, base.layers[0].self_attn.q_proj.weight)


def test_files_are_split_as_huggingface_hub_splits_them():
    from huggingface_hub import split_torch_state_dict_into_shards

    from shardpoint.formats.safetensors_index import file_names, parse_size, plan_files

    torch.manual_seed(0)
    state = {f"t{i}": torch.empty(int(n)) for i, n in enumerate(torch.randint(1, 4000, (40,)))}
    state["huge"] = torch.empty(30_000)
    for size in ("10KB", "40KB", "1GB"):
        split = split_torch_state_dict_into_shards(state, max_shard_size=size)
        files = plan_files(((k, v.numel() * 4) for k, v in state.items()), parse_size(size))
        ours = {key: name for name, keys in zip(file_names(len(files)), files) for key in keys}
        assert ours == split.tensor_to_filename, size
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("5 parsecs")
