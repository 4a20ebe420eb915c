"""Megatron's flags through ``shardpoint.integrations.megatron``, each asserted on one phase of ONE 2-rank job
(:mod:`tests.integration_megatron_flags`): megatron-core from the package registry on gloo CPU ranks.

The flags that need Megatron-LM's training code (``--use-checkpoint-args``, a Megatron-native
checkpoint loaded by Megatron's own ``load_checkpoint``) are checked by ``scripts/megatron-check``.
"""

from __future__ import annotations

import argparse

import pytest

from tests.distributed import launch

pytest.importorskip("megatron.core")

from tests import integration_megatron_flags as flags


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron_flags"))
    results = launch(flags.run, 2, root, backend="gloo", timeout=480)
    print("seconds per phase:", results[0]["seconds"])  # shown with -s
    return results


def _bit_exact(r):
    assert r["returned"] == (1, 7.0)
    assert not r["loaded_differs"], r["loaded_differs"][:5]
    assert r["losses"][0] == r["losses"][1]
    assert not r["end_differs"], r["end_differs"][:5]


def test_fp32_optimizer_without_the_distributed_optimizer_resumes_bit_exact(phases):
    for r in phases:
        _bit_exact(r["optimizers"]["fp32"])
    keys = phases[0]["optimizers"]["fp32"]["keys"]
    assert "optimizer.state.decoder.layers.1.mlp.linear_fc1.weight.exp_avg_sq" in keys
    assert "optimizer.state.decoder.layers.1.mlp.linear_fc1.weight.step" in keys


def test_bf16_optimizer_with_fp32_master_weights_resumes_bit_exact(phases):
    for r in phases:
        _bit_exact(r["optimizers"]["bf16"])
    assert (
        "optimizer.state.decoder.layers.0.self_attention.linear_qkv.weight.master_param"
        in (phases[0]["optimizers"]["bf16"]["keys"])
    )


def test_another_optimizer_is_refused_by_name_before_anything_is_written(phases):
    for r in phases:
        kind, message, written = r["optimizers"]["refused"]
        assert kind == "UnsupportedOptimizerError"
        assert "--use-distributed-optimizer" in message and "SGD" in message
        assert not written


def test_finetune_loads_the_weights_only(phases):
    for r in phases:
        f = r["finetune"]
        assert f["returned"] == (0, 0)
        assert f["samples"] == 0
        assert not f["model_differs"], f["model_differs"][:5]
        assert not f["optimizer_differs_from_fresh"], f["optimizer_differs_from_fresh"][:5]
        assert f["rng_kept"]


def test_save_retain_interval_keeps_the_newest_and_every_nth(phases):
    assert phases[0]["retain"]["kept"] == ["iter_0000002", "iter_0000004"]


def test_non_persistent_local_checkpoint_survives_a_lost_node_then_falls_back(phases):
    for rank, r in enumerate(phases):
        local = r["local"]
        assert local["node_dirs"], "nothing in the node-local directory"
        replica = local["node0_lost"]
        assert replica["returned"][0] == 4
        assert replica["tier"] == ("peer" if rank == 0 else "local"), replica
        assert not replica["differs"], replica["differs"][:5]
        fallback = local["both_lost"]
        assert fallback["returned"][0] == 2 and fallback["tier"] == "persistent"
        assert not fallback["differs"], fallback["differs"][:5]
        for resumed, it in ((replica, 4), (fallback, 2)):  # the extra state of the checkpoint loaded, any tier
            saved, loaded = resumed["objects"]
            assert saved == loaded and {v.get("saved_at") for v in loaded.values()} == {it}, (saved, loaded)


def test_rerun_state_machine_pending_rerun_is_restored_from_either_tier(phases):
    """Megatron saves the machine's state only while a rerun is pending, and restores it at the same layout."""
    for rank, r in enumerate(phases):
        for name, it in (("node0_lost", 4), ("both_lost", 2)):
            saved, loaded = r["local"][name]["rerun"]
            assert saved["state"] == "WILL_RERUN_FROM_CHECKPOINT" and saved["node"] == f"node{rank}"
            assert loaded == saved and loaded["iteration"] == it, (saved, loaded)
            assert loaded["call"] == ((("loss is NaN", rank), it))


def test_dist_ckpt_strictness(phases):
    for r in phases:
        s = r["strictness"]
        # saved keys nothing asks for: skipped under assume_ok_unexpected (Megatron's default), refused under raise_all
        ok = s["extra_in_checkpoint/assume_ok_unexpected"]
        assert ok["error"] is None and ok["returned"][0] == 1 and ok["same_weights"]
        _, mro, message = s["extra_in_checkpoint/raise_all"]["error"]
        assert "CheckpointError" in mro and "q_layernorm" in message, message
        # keys the job asks for and the checkpoint lacks: an error by default, skipped under log_unexpected
        _, mro, message = s["missing_in_checkpoint/assume_ok_unexpected"]["error"]
        assert "CheckpointError" in mro and "q_layernorm" in message, message
        lenient = s["missing_in_checkpoint/log_unexpected"]
        assert lenient["error"] is None and lenient["returned"][0] == 4


def test_megatron_native_checkpoint_is_refused_by_name_then_imported_and_resumed(phases):
    for r in phases:
        n = r["native"]
        assert n["same_save"] and "pass a new --save directory" in n["same_save"], n["same_save"]
        assert n["refused"] and "shardpoint convert --from megatron" in n["refused"], n["refused"]
        assert n["returned"][0] == 2
        assert not n["differs"], n["differs"][:5]
        assert n["tracker"] == "3" and n["native_untouched"]


def test_use_checkpoint_args_reads_the_saved_args_checked_by_the_marker(phases):
    for r in phases:
        a = r["checkpoint_args"]
        assert (a["iteration"], a["num_layers"], a["hidden_size"]) == (4, 2, 32)
    kind, message = phases[0]["checkpoint_args"]["changed"]
    assert kind == "CorruptCheckpointError" and "megatron_args.json" in message, message


def test_replication_flags_give_the_local_tier_its_replicas():
    """Megatron replicates local checkpoints only with --replication; --replication-factor counts the original."""
    from shardpoint.integrations.megatron.loop import Session

    local = dict(non_persistent_save_interval=2, non_persistent_ckpt_type="local", non_persistent_local_ckpt_dir="/x")
    assert Session._local_options(argparse.Namespace(**local))["local_replicas"] == 0
    factor3 = argparse.Namespace(**local, replication=True, replication_factor=3)
    assert Session._local_options(factor3) == {"local_dir": "/x", "local_interval": 2, "local_replicas": 2}


def test_query_groups_are_compared_only_with_grouped_query_attention():
    """Without --group-query-attention Megatron ignores --num-query-groups (and --use-checkpoint-args changes it)."""
    from shardpoint.integrations.megatron.loop import config_options

    mha = argparse.Namespace(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=1
    )
    assert "num_query_groups" in config_options(mha)["allow_config_mismatch"]
    gqa = argparse.Namespace(**vars(mha), group_query_attention=True)
    options = config_options(gqa)
    assert "num_query_groups" not in options["allow_config_mismatch"] and options["config"]["num_query_groups"] == 1
    assert "group_query_attention" in options["allow_config_mismatch"]  # run arguments are not compared


def test_saved_rerun_state_rebuilds_only_megatrons_own_classes():
    """The rerun state is stored as plain values; a table naming any other class is refused by name."""
    from megatron.core import rerun_state_machine as rsm

    from shardpoint.errors import UnsafeCheckpointError
    from shardpoint.integrations.megatron.rerun import plain, rebuilt

    state = {"state": rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT, "call": rsm.Call(rsm.Caller("nan", 1), 3)}
    stored = plain(state)
    assert "RerunState" not in repr(type(stored["state"])) and rebuilt(stored) == state
    with pytest.raises(UnsafeCheckpointError, match="'Popen'"):
        rebuilt({"mode": {"__megatron_enum__": "Popen", "name": "x"}})
