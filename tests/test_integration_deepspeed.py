"""shardpoint.integrations.deepspeed with a real DeepSpeed engine on CPU (gloo, 2 ranks).

Engine mode: the files equal DeepSpeed's own engine's byte for byte and DeepSpeed's own
loader and ``zero_to_fp32`` read them; a resume equals the uninterrupted run; a kill (or a
failed write) during a save leaves ``latest`` naming a loadable tag; a flipped byte is
named on load, on every rank; a crafted pickle runs nothing.

Engine mode in the background (one launch): ``async_save`` files equal DeepSpeed's own
(written after training moved on), ``latest`` moves only at the commit, ``keep_last`` and
``upload_to`` (S3, moto) keep and upload the newest tags; a SIGKILL during an async write
leaves ``latest`` on the previous tag.

Reshardable mode: saved at dp=2 ZeRO-2, resumed at dp=1 ZeRO-1/2/3 and dp=2 ZeRO-3 (and
dp=4 ZeRO-1 with ``SHARDPOINT_DEEPSPEED_FULL=1``) with identical weights, fp32 masters, Adam
moments and step; GPT-NeoX's client_state per rank; SIGTERM to one rank mid-training saves
and stops every rank, and the restart's losses equal the uninterrupted run's.
``convert --to deepspeed`` writes it back as DeepSpeed's own files, which DeepSpeed's
engine loads exactly.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.util import find_spec

import pytest
import torch

from tests.distributed import launch
from tests.integration_deepspeed_worker import (
    ENV,
    async_save_killed,
    in_background_then_preempted,
    load_ours,
    load_ours_each,
    load_stock_and_converted,
    load_universal,
    reshard_load,
    reshard_save,
    resume_all,
    save_both_ways,
    save_then_killed,
    tag_files,
)

# DeepSpeed is imported by the ranks (and by two tests), not at collection: its import takes seconds
pytestmark = pytest.mark.skipif(find_spec("deepspeed") is None, reason="DeepSpeed is in the test extra")
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # for this process's own imports of DeepSpeed
FULL_RUN = os.environ.get("SHARDPOINT_DEEPSPEED_FULL") == "1"  # the longer variants

TAG = "global_step3"


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """One training run saved twice at the same state: DeepSpeed's engine, then shardpoint's (ZeRO-2, 2 ranks)."""
    root = tmp_path_factory.mktemp("ds")
    stock, ours = root / "stock", root / "ours"
    results = launch(save_both_ways, 2, str(stock), str(ours), 2, env=ENV, backend="gloo")
    return stock, ours, results[0]["params"], [r["losses"] for r in results]


def test_engine_mode_files_are_deepspeeds_own(both):
    stock, ours, *_ = both
    theirs, mine = tag_files(stock / TAG), tag_files(ours / TAG)
    assert set(mine) == set(theirs) | {"shardpoint.json"}
    for name, data in theirs.items():
        assert mine[name] == data, f"{name} differs from DeepSpeed's own engine's"
    assert (ours / "latest").read_text() == TAG
    marker = json.loads((ours / TAG / "shardpoint.json").read_text())
    assert marker["format"] == "deepspeed" and marker["iteration"] == 3
    assert set(marker["files"]) == set(theirs)
    assert not [p.name for p in ours.iterdir() if p.name.startswith(".shardpoint-")]
    # save_16bit_model's file beside the tags: DeepSpeed's own bytes, moved into place whole, no tag for it
    assert (ours / "model.pt").read_bytes() == (stock / "model.pt").read_bytes()
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in stock.iterdir())  # no other tag


@pytest.fixture(scope="module")
def converted(resharded, tmp_path_factory):
    """The reshardable checkpoint (dp=2 ZeRO-2) as DeepSpeed's own files for dp=2 ZeRO-2: ``convert --to deepspeed``."""
    from shardpoint.cli import main

    directory, _ = resharded
    out = tmp_path_factory.mktemp("converted") / "ds"
    assert main(["convert", "--to", "deepspeed", str(directory), str(out), "--dp", "2", "--zero-stage", "2"]) == 0
    return out


@pytest.fixture(scope="module")
def converted3(resharded, tmp_path_factory):
    """The same reshardable checkpoint (dp=2 ZeRO-2) as DeepSpeed's own ZeRO-3 files for dp=2."""
    from shardpoint.cli import main

    directory, _ = resharded
    out = tmp_path_factory.mktemp("converted3") / "ds"
    assert main(["convert", "--to", "deepspeed", str(directory), str(out), "--dp", "2", "--zero-stage", "3"]) == 0
    return out


@pytest.fixture(scope="module")
def frozen3(resharded, tmp_path_factory):
    """The same state with ``0.bias`` taken out of the optimizer (frozen), as DeepSpeed's ZeRO-3 files for dp=2."""
    from shardpoint.foreign.deepspeed_export import export_deepspeed, from_reshardable

    directory, _ = resharded
    ckpt = from_reshardable(str(directory))
    del ckpt.optimizer["0.bias"]
    for group in ckpt.param_groups:
        group["param_names"] = [n for n in group["param_names"] if n != "0.bias"]
    out = tmp_path_factory.mktemp("frozen3") / "ds"
    export_deepspeed(ckpt, out, dp=2, stage=3)
    return out


@pytest.fixture(scope="module")
def redp(both, tmp_path_factory):
    """DeepSpeed's own dp=2 ZeRO-2 files (no shardpoint in them) rewritten for dp=1, which DeepSpeed refuses to load."""
    from shardpoint.cli import main

    stock, *_ = both
    out = tmp_path_factory.mktemp("redp") / "ds"
    assert main(["convert", "--from", "deepspeed", "--to", "deepspeed", str(stock), str(out), "--dp", "1"]) == 0
    assert sorted(p.name for p in (out / "global_step3").iterdir() if p.name.startswith("zero_pp")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ]
    return out


@pytest.fixture(scope="module")
def stock_loaded(both, converted, converted3, frozen3):
    """DeepSpeed's own engine (no shardpoint) loads shardpoint's files and trains two more steps (and, in the
    same launch, loads what ``convert --to deepspeed`` wrote, at ZeRO-2 and at ZeRO-3)."""
    _, ours, *_ = both
    args = str(ours), str(converted), 2, str(converted3), str(frozen3)
    return launch(load_stock_and_converted, 2, *args, env=ENV, backend="gloo")


def test_engine_mode_read_by_deepspeeds_loader_and_zero_to_fp32(both, stock_loaded):
    _, ours, saved, _ = both
    for result in (r["stock"] for r in stock_loaded):
        assert result["iteration"] == 3
        _same(result["params"], saved)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _same({k: v.float() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(ours)).items()}, saved)


def test_engine_mode_load_matches_deepspeed_and_names_a_flipped_byte(both, stock_loaded, tmp_path):
    stock, ours, saved, uninterrupted = both
    mine = launch(load_ours, 2, str(ours), 2, env=ENV, backend="gloo")
    for a, b, going_on in zip((r["stock"] for r in stock_loaded), mine, uninterrupted):
        _same(b["params"], saved)
        assert a["losses"] == b["losses"] == going_on  # resumed bit for bit: as from DeepSpeed's load, as uninterrupted
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for entry in ours.iterdir():
        if entry.is_dir():
            (damaged / entry.name).mkdir()
            for f in entry.iterdir():
                (damaged / entry.name / f.name).write_bytes(f.read_bytes())
        else:
            (damaged / entry.name).write_bytes(entry.read_bytes())
    victim = damaged / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    runs = [(str(damaged), {}), (str(stock), {}), (str(stock), {"unverified_ok": True})]
    for flipped, unmarked, unverified in launch(load_ours_each, 2, runs, 2, env=ENV, backend="gloo"):
        assert "error" in flipped, "a flipped byte was loaded"
        assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in flipped["error"]
        # DeepSpeed's own tag (no shardpoint.json) is refused, naming the way to read it anyway
        assert "shardpoint.json" in unmarked["error"] and "unverified_ok=True" in unmarked["error"]
        _same(unverified["params"], saved)


def test_engine_mode_loads_what_ds_to_universal_made_of_its_tag(both, tmp_path):
    """DeepSpeed's universal workflow: ``ds_to_universal`` writes a tag offline (never with a shardpoint.json);
    an engine configured to load universal checkpoints reads it through shardpoint's engine, with no code run."""
    from types import SimpleNamespace

    from deepspeed.checkpoint.ds_to_universal import main as to_universal

    _, ours, saved, uninterrupted = both
    directory = tmp_path / "run"
    shutil.copytree(ours, directory)
    universal = f"{TAG}_universal"
    args = {"input_folder": str(directory / TAG), "output_folder": str(directory / universal)}
    workers = {"num_extract_workers": 1, "num_merge_workers": 1, "keep_temp_folder": False}
    to_universal(SimpleNamespace(**args, **workers, strict=True, inject_missing_state=True))
    assert not (directory / universal / "shardpoint.json").exists()
    for result, going_on in zip(
        launch(load_universal, 2, str(directory), universal, 2, env=ENV, backend="gloo"), uninterrupted
    ):
        _same(result["params"], saved)
        assert result["losses"] == going_on  # fp32 masters and moments came back too: training goes on bit for bit


@pytest.mark.parametrize(
    "fault",
    [  # rank 1 killed after writing its file (DeepSpeed's own rank 0 would go on to write `latest`);
        # rank 0 killed with every file written, before the marker
        "point=mid-data,rank=1,action=kill",
        "point=before-marker,rank=0,action=kill",
        "point=mid-data,rank=1,action=raise",  # a failed write on one rank fails the save on every rank
    ],
)
def test_engine_mode_kill_during_save_leaves_latest_loadable(tmp_path, fault):
    directory = tmp_path / "run"
    directory.mkdir()
    codes = launch(save_then_killed, 2, str(directory), fault, env=ENV, backend="gloo", expect_failure=True, timeout=90)
    assert any(code != 0 for code in codes)
    if "raise" in fault:  # every rank failed (none hangs or returns success) and nothing is left behind
        assert all(code != 0 for code in codes), codes
        assert not [p.name for p in directory.iterdir() if p.name.startswith(".shardpoint-")]
    tag = (directory / "latest").read_text()
    assert tag == "global_step2", f"latest names {tag!r} after a kill mid-save"
    expected = torch.load(directory / "expected_0.pt")
    for result in launch(load_ours, 2, str(directory), 2, env=ENV, backend="gloo"):
        assert "error" not in result, result.get("error")
        assert result["iteration"] == 2
        _same(result["params"], expected)


# ------------------------------------------------------------------ reshardable mode


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Saved in the reshardable mode at dp=2 ZeRO-2 after 3 steps."""
    directory = tmp_path_factory.mktemp("reshard") / "run"
    saved = launch(reshard_save, 2, str(directory), 2, env=ENV, backend="gloo")
    return directory, saved


# dp=4: 4 ranks on CI's 2 cores (13 s on a loaded 2-core machine), outside CI's time budget:
# SHARDPOINT_DEEPSPEED_FULL=1 runs it
FULL = pytest.mark.skipif(not FULL_RUN, reason="SHARDPOINT_DEEPSPEED_FULL=1")


@pytest.mark.parametrize("world, stage", [(1, 2), (1, 1), (1, 3), (2, 3), pytest.param(4, 1, marks=FULL)])
def test_reshardable_mode_resumes_at_another_dp_size_and_stage_exactly(resharded, world, stage, request, tmp_path):
    directory, saved = resharded
    assert (directory / "latest").read_text() == "global_step3"
    assert json.loads((directory / "global_step3" / "shardpoint.json").read_text())["format"] == "dist"
    # at dp=1 ZeRO-2 the same launch loads DeepSpeed's own dp=2 files rewritten for dp=1 (convert, below)
    stock = str(request.getfixturevalue("redp")) if (world, stage) == (1, 2) else None
    # at dp=2 ZeRO-3 the loaded engine saves again: a ZeRO-3 source for convert --to deepspeed
    save_to = str(tmp_path / "from-zero3") if (world, stage) == (2, 3) else None
    results = launch(reshard_load, world, str(directory), stage, stock, save_to, env=ENV, backend="gloo")
    if save_to is not None:
        _converts_as_the_zero2_source(save_to, request, tmp_path)
    if stock is not None:  # the same training run as the reshardable save's (same seeds, batches, steps)
        result = results[0]["stock"]
        _same(result["state"], saved[0]["state"])
        _same(result["params"], saved[0]["params"])
        assert result["step"] == result["global_steps"] == 3
    for result in results:
        _same(result["state"], saved[0]["state"])  # fp32 masters and both Adam moments, every element
        _same(result["params"], saved[0]["params"])
        assert result["step"] == saved[0]["step"] == 3
        assert result["global_steps"] == 3
        assert result["client"]["iteration"] == 3
        assert result["client"]["args"]["hidden_size"] == 10
    if world == 2:  # same layout: each data-parallel rank gets its own client_state (GPT-NeoX's RNG states) back
        for rank, result in enumerate(results):
            assert result["client"]["rank"] == rank
            assert result["client"]["np_rng_state"][1].dtype.name == "uint32"


def _converts_as_the_zero2_source(source: str, request, tmp_path) -> None:
    """A ZeRO-3 reshardable save of the same state converts to the same DeepSpeed files as the ZeRO-2 one.

    Its two optimizer groups (ZeRO-3 sub-groups joined again by group) must be recorded as
    the ZeRO-2 engine flattened them, or the files differ.
    """
    from shardpoint.cli import main

    for zero, fixture in ((2, "converted"), (3, "converted3")):
        out = tmp_path / f"zero{zero}"
        assert main(["convert", "--to", "deepspeed", source, str(out), "--dp", "2", "--zero-stage", str(zero)]) == 0
        mine, theirs = tag_files(out / TAG), tag_files(request.getfixturevalue(fixture) / TAG)
        assert mine.keys() == theirs.keys()
        for name in mine.keys() - {"shardpoint.json"}:  # the marker records the wall time
            assert mine[name] == theirs[name], f"ZeRO-{zero}: {name} differs"


class _RunsCode:
    def __reduce__(self):
        import os

        return (os.system, ("echo crafted checkpoint ran this",))


def test_engine_mode_load_runs_no_code_from_a_crafted_file(tmp_path):
    from shardpoint.errors import UnsafeCheckpointError
    from shardpoint.integrations.deepspeed.unpickle import load_restricted

    crafted = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "payload": _RunsCode()}, crafted)
    with pytest.raises(UnsafeCheckpointError, match="system"):
        load_restricted(str(crafted), str(crafted))


# ------------------------------------------------------------------ async, upload_to, retention, preemption


@pytest.fixture(scope="module")
def backgrounds(tmp_path_factory, request):
    """One launch: engine mode with async_save + keep_last=2 + upload_to (S3, moto); then a run preempted by SIGTERM."""
    s3 = request.getfixturevalue("s3_server")
    remote = s3.make_bucket("deepspeed-engine-upload") + "/run"
    root = tmp_path_factory.mktemp("ds-background")
    directory, stock, stopped = root / "run", root / "stock", root / "preempted"
    engine_dir = str(root / "engine-preempted") if FULL_RUN else None  # engine mode's SIGTERM: the long variant
    env = {**ENV, **s3.env}
    args = (str(directory), str(stock), remote, str(stopped), engine_dir)
    results = launch(in_background_then_preempted, 2, *args, env=env, backend="gloo")
    stopped_runs = [{**r["preempted"], "engine": r["engine_preempted"], "engine_dir": engine_dir} for r in results]
    return directory, stock, remote, [r["background"] for r in results], stopped, stopped_runs


def test_engine_mode_async_commits_when_written_keeps_last_and_uploads(backgrounds):
    directory, stock, remote, seen, *_ = backgrounds
    for rank in seen:
        named, foreign = rank["refused"]
        assert "'final'" in named and "global_step<N>" in named
        assert "global_step1" in foreign
        # save_checkpoint returned (and a step trained) with global_step4 still being written:
        # latest moved only at its commit
        assert rank["latest_after_return"] == rank["latest_after_step"] == "global_step2"
        assert rank["latest_after_commit"] == "global_step4"
        assert rank["latest_at_end"] == "global_step6"
    # the files written after step 5 trained hold step 4, as DeepSpeed's own engine wrote it, byte for byte
    theirs, mine = tag_files(stock / "global_step4"), tag_files(directory / "global_step4")
    assert set(mine) == set(theirs) | {"shardpoint.json"}
    for name, data in theirs.items():
        assert mine[name] == data, f"{name} written async differs from DeepSpeed's own engine's"
    # keep_last=2 here and at upload_to; nothing staged is left behind
    tags = sorted(p.name for p in directory.iterdir() if p.is_dir())
    assert tags == ["global_step1", "global_step4", "global_step6"], tags  # nothing staged left either
    assert (directory / "global_step1" / "theirs.pt").read_bytes() == b"theirs"
    from shardpoint.storage.base import open_storage

    store = open_storage(remote)
    names = sorted(store.listdir(store.root))
    assert [n for n in names if n.startswith("global_step")] == ["global_step4", "global_step6"], names
    assert not [n for n in names if n.startswith(".shardpoint-tmp")], names
    assert store.read_bytes(store.join(store.root, "latest")) == b"global_step6"
    for name, data in tag_files(directory / "global_step6").items():
        assert store.read_bytes(store.join(store.root, "global_step6", name)) == data, name


def test_engine_mode_sigkill_during_async_save_leaves_latest_on_previous_tag(tmp_path, backgrounds):
    *_, stopped, stopped_run = backgrounds
    killed = tmp_path / "killed"
    killed.mkdir()
    codes = launch(async_save_killed, 2, str(killed), env=ENV, backend="gloo", expect_failure=True, timeout=90)
    assert codes[1] == -9 and codes[0] != 0, codes
    assert (killed / "latest").read_text() == "global_step2"
    assert not (killed / "global_step4").exists()
    # one launch restarts both: this run (engine mode) and the preempted one (reshardable mode)
    expected = torch.load(killed / "expected_0.pt")
    engine_dir = stopped_run[0]["engine_dir"]
    resumed = launch(resume_all, 2, str(stopped), str(killed), engine_dir, env=ENV, backend="gloo")
    for rank, result in enumerate(resumed):
        loaded = result["killed"]
        assert "error" not in loaded, loaded.get("error")
        assert loaded["iteration"] == 2
        _same(loaded["params"], expected)
        # SIGTERM reached rank 1 only, during step 3: every rank saved step 3 and stopped; the restart's
        # losses for steps 4-6 are the uninterrupted run's, bit for bit (each rank's RNG restored)
        run = stopped_run[rank]
        assert run["stopped"] == 3 and run["latest"] == "global_step3"
        assert result["preempted"]["iteration"] == 3
        assert result["preempted"]["losses"] == run["uninterrupted"][3:]
        if engine_dir:  # the same through engine mode with async_save: committed before the loop ended
            assert run["engine"]["stopped"] == 3 and run["engine"]["latest"] == "global_step3"
            assert result["engine_preempted"]["iteration"] == 3
            assert result["engine_preempted"]["losses"] == run["engine"]["uninterrupted"][3:]


def test_convert_to_deepspeed_writes_files_deepspeeds_own_loader_reads_exactly(resharded, converted, stock_loaded):
    _, saved = resharded
    assert (converted / "latest").read_text() == "global_step3"
    names = sorted(p.name for p in (converted / "global_step3").iterdir())
    assert names == [
        "mp_rank_00_model_states.pt",
        "shardpoint.json",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    for result in (r["converted"] for r in stock_loaded):  # DeepSpeed's engine, no shardpoint, 2 ranks, ZeRO-2
        _same(result["state"], saved[0]["state"])  # fp32 masters and both Adam moments, every element
        _same(result["params"], saved[0]["params"])
        assert result["step"] == result["global_steps"] == 3
        assert result["client"]["iteration"] == 3 and result["client"]["args"]["hidden_size"] == 10
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    merged = get_fp32_state_dict_from_zero_checkpoint(str(converted))  # DeepSpeed's zero_to_fp32 reads them too
    _same({k: v.float() for k, v in merged.items()}, saved[0]["params"])


def test_convert_to_deepspeed_zero3_files_deepspeeds_own_zero3_engine_loads_exactly(
    resharded, converted3, stock_loaded
):
    _, saved = resharded
    assert (converted3 / "latest").read_text() == "global_step3"
    names = sorted(p.name for p in (converted3 / "global_step3").iterdir())
    assert names == [
        "shardpoint.json",
        *[f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")],
    ]
    for result in (r["converted3"] for r in stock_loaded):  # DeepSpeed's engine at ZeRO-3, no shardpoint, 2 ranks
        _same(result["state"], saved[0]["state"])  # fp32 masters and both Adam moments, every element
        _same(result["params"], saved[0]["params"])
        assert result["step"] == result["global_steps"] == 3
        assert result["client"]["iteration"] == 3
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    merged = get_fp32_state_dict_from_zero_checkpoint(str(converted3))  # zero_to_fp32's ZeRO-3 path
    _same({k: v.float() for k, v in merged.items()}, saved[0]["params"])


def test_convert_to_deepspeed_zero3_frozen_parameter_loaded_from_its_fragments(resharded, stock_loaded):
    _, saved = resharded
    trained = {k: v for k, v in saved[0]["state"].items() if not k.startswith("0.bias.")}
    for result in (r["frozen3"] for r in stock_loaded):  # DeepSpeed's ZeRO-3 engine with 0.bias frozen
        _same(result["params"], saved[0]["params"])  # 0.bias included: from frozen_param_fragments
        _same(result["state"], trained)
        assert result["step"] == 3


def test_convert_to_deepspeed_refuses_to_guess_the_flattening_order(tmp_path):
    from shardpoint.errors import CheckpointError
    from shardpoint.foreign._types import ForeignCheckpoint
    from shardpoint.foreign.deepspeed_export import export_deepspeed

    weight = torch.ones(2, 3)
    state = {"exp_avg": torch.zeros(2, 3), "exp_avg_sq": torch.zeros(2, 3), "step": torch.tensor(1.0)}
    ckpt = ForeignCheckpoint("deepspeed", "dist", "src", 1, params={"w": weight}, optimizer={"w": state})
    with pytest.raises(CheckpointError, match="parameter groups.*--no-optimizer"):
        export_deepspeed(ckpt, tmp_path / "out", dp=2)
    assert not (tmp_path / "out" / "global_step1").exists()


def test_convert_to_deepspeed_zero3_refuses_weights_without_optimizer_state(tmp_path):
    from shardpoint.errors import CheckpointError
    from shardpoint.foreign._types import ForeignCheckpoint
    from shardpoint.foreign.deepspeed_export import export_deepspeed

    ckpt = ForeignCheckpoint("hf", "hf", "src", 1, params={"w": torch.ones(2, 3)})
    with pytest.raises(CheckpointError, match="fp32 partitions.*--zero-stage 1 or 2"):
        export_deepspeed(ckpt, tmp_path / "out", dp=2, stage=3)
    assert not (tmp_path / "out" / "global_step1").exists()
