"""Pipeline and expert parallelism through ``shardpoint.integrations.megatron``, asserted on the phases of
ONE 2-rank job (:mod:`tests.integration_megatron_parallel`): megatron-core's GPTModel at pp=2 and a
mixture-of-experts GPTModel at ep=2 (local expert MLPs), each with the DistributedOptimizer on gloo
CPU ranks, resumed bit-exact and resharded (pp=1 dp=2, ep=1) to what the offline reader reads.
"""

from __future__ import annotations

import os

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


def test_padded_vocabulary_trimmed_at_tp1_equals_the_offline_reader(phases):
    from shardpoint.offline import read_full

    root, results = phases
    offline = read_full(f"{root}/vocab/tp2").tensors
    for r in results:
        state = r["vocab"]["trim"]
        assert state["model.embedding.word_embeddings.weight"].shape[0] == 56  # 64 rows at tp=2, 56 at tp=1
        for key, value in state.items():  # the vocabulary's tensors (and their moments) lose padding rows only
            expected = offline[key][: value.shape[0]] if value.dim() else offline[key]
            assert torch.equal(value, expected.to(value.dtype)), key


def test_padded_vocabulary_padded_at_tp2_repeats_the_last_row_and_zeroes_its_moments(phases):
    _, results = phases
    for r in results:
        saved, state = r["vocab"]["trim_saved"], r["vocab"]["pad"]
        assert state.keys() == saved.keys()
        for key, value in state.items():
            before = saved[key]
            if value.shape == before.shape:
                assert torch.equal(value, before), key
                continue
            assert torch.equal(value[: before.shape[0]], before), key
            assert key.endswith(("word_embeddings.weight", "output_layer.weight", ".exp_avg", ".exp_avg_sq")), key
            new = value[before.shape[0] :]
            expected = torch.zeros_like(new) if ".exp_avg" in key else before[-1].expand_as(new)
            assert torch.equal(new, expected), key  # Megatron's converter repeats the last row


def test_a_trim_that_would_drop_real_tokens_is_refused_by_name(phases):
    _, results = phases
    for r in results:
        kind, message = r["vocab"]["refused"]
        assert kind == "PaddedVocabularyError"
        assert "embedding.word_embeddings.weight" in message and "rows 40..63" in message and "tokenizer" in message


def test_extra_state_sharded_objects_resume_per_stage_and_at_pp1(phases):
    _, results = phases
    everything = {}
    for r in results:
        saved = r["pp2"]["objects"]  # each stage's layers, set to what TE would hold after training
        assert saved and all(v["tag"] == "trained" for v in saved.values())
        assert repr(r["pp2"]["objects_loaded"]) == repr(saved)  # a fresh job (built "fresh") got them back
        everything.update(saved)
    for r in results:  # pp=1: every rank holds both layers, each from the stage that saved it
        assert repr(r["pp1_dp2"]["objects"]) == repr(dict(sorted(everything.items())))


def test_a_crafted_extra_state_is_refused_by_name_and_never_run(phases, tmp_path):
    import io
    import json
    import os
    import shutil

    import xxhash

    from shardpoint.errors import UnsafeCheckpointError
    from shardpoint.integrations.megatron.objects import OBJECTS_FILE, saved_objects

    root, _ = phases
    checkpoint = tmp_path / "crafted"
    shutil.copytree(f"{root}/pp/iter_0000002", checkpoint)
    table = saved_objects(str(checkpoint))
    assert table["decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2"]["layer"] == 1

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/ran",))

    inner, outer = io.BytesIO(), io.BytesIO()
    torch.save(Payload(), inner)
    torch.save({"decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2": inner.getvalue()}, outer)
    (checkpoint / OBJECTS_FILE).write_bytes(outer.getvalue())
    marker = json.loads((checkpoint / "shardpoint.json").read_text())  # resealed: only the unpickler can refuse it
    raw = outer.getvalue()
    marker["files"][OBJECTS_FILE] = {"size": len(raw), "xxh3_64": xxhash.xxh3_64(raw).hexdigest()}
    (checkpoint / "shardpoint.json").write_text(json.dumps(marker))
    with pytest.raises(UnsafeCheckpointError, match="linear_qkv._extra_state/shard_1_2"):
        saved_objects(str(checkpoint))
    assert not (tmp_path / "ran").exists()


@pytest.mark.skipif(not os.environ.get("SHARDPOINT_MEGATRON_FULL"), reason="4 ranks: SHARDPOINT_MEGATRON_FULL=1")
def test_full_tp2_pp2_and_pp2_ep2_on_4_ranks(tmp_path):
    root = str(tmp_path)
    results = launch(parallel.run_full, 4, root, backend="gloo", timeout=600)
    print("seconds per phase:", results[0]["seconds"])
    for r in results:
        _bit_exact(r["tp2pp2"])
        _bit_exact(r["pp2ep2"])
    _equals_offline(f"{root}/tp2pp2", results, "tp2pp2", "tp1pp2dp2")
    _equals_offline(f"{root}/moe", results, "pp2ep2", "pp1ep4")
