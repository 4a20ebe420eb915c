"""Megatron-LM MoE ``torch_dist`` checkpoints with expert tensor parallelism and pipeline stages, decoded.

Four more checkpoints of the model of ``tests/test_foreign_moe.py`` (same seeds, so the same
``truth.pt``), written by Megatron-LM core_v0.16.1's own ``save_checkpoint``
(``scripts/fixtures/make_megatron_moe.py --tp 2 --etp 2``, ``--pp 2 --ep 2 --world 4``,
``--tp 2 --etp 2 --ep 2 --world 4`` and ``--tp 2 --etp 1``):

* ``moe-torchdist-tp2-etp2-distopt`` (tp=2, etp=2, ep=1, dp=1): the experts are ordinary
  parameters of the one optimizer, split over the two tensor-parallel ranks like a dense MLP
  (``linear_fc1`` as ``[gate_t; up_t]``), in ``dp_group_idx_<tp rank>``;
* ``moe-torchdist-pp2-ep2-distopt`` (tp=1, pp=2, ep=2, dp=2, expert dp=1): a ChainedOptimizer per
  stage; the dense groups are numbered by pp rank, the expert groups by
  ``ep_rank + ep * pp_rank`` (the rank in megatron-core's ``expt_tp_pp_group``);
* ``moe-torchdist-tp2-etp2-ep2-distopt`` (tp=2, etp=2, ep=2, dp=2, expert dp=1): the expert groups
  are ``etp_rank + etp * ep_rank``, each holding its etp piece of its ep rank's experts;
* ``moe-torchdist-tp2-etp1-distopt`` (tp=2, etp=1, ep=1, dp=1): etp other than tp; the experts
  are whole on each tensor-parallel rank, in the one optimizer.

Each imports equal to its truth, bit for bit, and loads at another ep/tp.
"""

from __future__ import annotations

import pytest
import torch

from shardpoint.errors import CheckpointError
from shardpoint.foreign import import_checkpoint, read_foreign
from shardpoint.foreign._unpickle import load_foreign
from tests.distributed import launch
from tests.test_foreign_import import MOMENTS, assert_equal, params_of
from tests.test_foreign_moe import EP2, LOCAL, MOE, STEP_DIR, _check, _held, _load, copy_ckpt, truth, with_args
from tests.test_foreign_moe_export import assert_truth

TP2, PP2 = "moe-torchdist-tp2-etp2-distopt", "moe-torchdist-pp2-ep2-distopt"
TP2EP2, ETP1 = "moe-torchdist-tp2-etp2-ep2-distopt", "moe-torchdist-tp2-etp1-distopt"
# the layout each was saved at: tp, pp, ep, etp
LAYOUTS = {TP2: (2, 1, 1, 2), PP2: (1, 2, 2, 1), TP2EP2: (2, 1, 2, 2), ETP1: (2, 1, 1, 1)}
SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def test_the_new_fixtures_hold_the_ep2_fixtures_truth():
    """Same model, same seeds, another layout: the truth of the live jobs is the same, entry for entry."""
    reference = truth(EP2)
    for fixture in LAYOUTS:
        t = truth(fixture)
        assert list(t) == list(reference) and all(torch.equal(t[k], reference[k]) for k in t), fixture


@pytest.mark.parametrize("fixture", list(LAYOUTS))
def test_reader_gives_every_weight_and_moment_of_the_truth(fixture):
    args = load_foreign(MOE / fixture / "ckpt" / STEP_DIR / "common.pt")["args"]
    assert tuple(getattr(args, k) for k in SIZES) == LAYOUTS[fixture]  # the layout Megatron saved at
    ckpt = read_foreign(MOE / fixture / "ckpt")
    t = truth(fixture)
    names = params_of(t)
    assert list(ckpt.params) == names and len(ckpt.buffers) == 2
    assert ckpt.extra["optimizer_layout"] == "dp_reshardable"
    assert_truth(ckpt, t)  # every weight, buffer, moment and step
    experts = [n for n in names if LOCAL.search(n)]
    grouped = {n: g.get("is_expert_parallel") for g in ckpt.param_groups for n in g["param_names"]}
    assert sorted(grouped) == sorted(n for n in names if n not in ckpt.buffers)
    assert {grouped[n] for n in experts} == {LAYOUTS[fixture][2] > 1}  # expert optimizer only at ep > 1


def test_the_tp2_etp2_import_loads_at_ep2_tp1_on_two_ranks(tmp_path):
    import_checkpoint(MOE / TP2 / "ckpt", tmp_path / "run")
    t = truth(TP2)
    names = params_of(t)
    results = launch(_load, 2, str(tmp_path / "run"), 2, {n: t[n].shape for n in names})
    for ep_rank, got in enumerate(results):
        _check(got, t, _held(names, 2, ep_rank))


@pytest.mark.parametrize("fixture", [PP2, TP2EP2, ETP1])
def test_the_import_loads_at_ep1_tp1_in_one_process(fixture, tmp_path):
    import_checkpoint(MOE / fixture / "ckpt", tmp_path / "run")
    t = truth(fixture)
    _check(_load(0, 1, str(tmp_path / "run"), 1, {n: t[n].shape for n in params_of(t)}), t, params_of(t))


@pytest.mark.parametrize(
    ("fixture", "changes", "message"),
    [
        (TP2, {"expert_tensor_parallel_size": 1}, r"dp_group_idx_0.*local_experts.*would end at element"),
        (TP2, {"expert_tensor_parallel_size": 4}, r"expert tensor parallelism other than tp.*--no-optimizer"),
        (PP2, {"expert_tensor_parallel_size": 2}, r"expert tensor parallelism other than tp.*size 2, tp=1\)"),
        (TP2EP2, {"expert_tensor_parallel_size": 1}, r"chained_1\) has groups \[0, 1, 2, 3\], but etp=1 x ep=2 x pp=1"),
        (PP2, {"expert_model_parallel_size": 4}, r"chained_1\) has groups \[0, 1, 2, 3\], but etp=1 x ep=4 x pp=2"),
    ],
)
def test_layouts_not_derived_or_not_matching_are_named(tmp_path, fixture, changes, message):
    root = with_args(copy_ckpt(tmp_path, fixture), **changes)
    with pytest.raises(CheckpointError, match=message):
        read_foreign(root)


def test_tied_embeddings_at_pp2_ep2_leave_the_expert_groups_alone(tmp_path):
    """Tied embeddings (Megatron's default) put an output copy on the last stage's list of parameters;
    the expert optimizer's groups must not take it for an expert (it raised a bare ValueError)."""
    root = with_args(copy_ckpt(tmp_path, PP2), untie_embeddings_and_output_weights=False)
    ckpt = read_foreign(root)
    t = truth(PP2)
    for name in (n for n in params_of(t) if LOCAL.search(n)):
        for moment in MOMENTS:
            assert_equal(f"{name}.{moment}", ckpt.optimizer[name].get(moment), t[f"{name}.{moment}"])
