"""The bench runs end to end at a tiny size (a smoke test: speed is reported, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_bench_json(directory: str, env: dict[str, str] | None = None, ranks: int = 2, *extra: str) -> dict:
    """``shardpoint bench`` at 2 MB, one round, as a subprocess; its one report."""
    command = [sys.executable, "-m", "shardpoint.cli", "bench", "--size", "2MB", "--ranks", str(ranks), "--repeat", "1"]
    out = subprocess.run(
        [*command, *extra, "--dir", directory, "--json", "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (report,) = json.loads(out.stdout)
    return report


def test_bench_reports_every_measurement_and_target(tmp_path):
    killed = killed_bench(tmp_path / "disk")
    user = tmp_path / "disk" / f"run-{dead_pid()}"  # a user's folder beside the bench's (issue 54, defect 4)
    user.mkdir()
    (user / "model_final.pt").write_bytes(b"a week of training")
    report = run_bench_json(str(tmp_path / "disk"))
    names = {row["name"] for row in report["rows"]}
    for expected in (
        "memory copy",
        "sequential write+fsync",
        "torch.save per rank",
        "dcp save",
        "dcp load",
        "shardpoint save",
        "shardpoint load",
        "shardpoint async stall",
        "shardpoint load (resharded)",
    ):
        assert expected in names
    assert all(row["median_s"] > 0 for row in report["rows"])
    assert set(report["ratios"]) >= {"async stall / memory copy", "resharded load / same-layout load"}
    assert all(isinstance(check["met"], bool) for check in report["ratios"].values())
    written = report["bytes_written_per_rank"]
    assert len(written) == 2 and all(b >= report["state_bytes_per_rank"] for b in written)
    # the bench cleans up after itself and after a killed bench, and leaves the user's folder as it was
    assert [p.name for p in (tmp_path / "disk").iterdir()] == [user.name] and not killed.exists()
    assert [p.name for p in user.iterdir()] == ["model_final.pt"]


def test_bench_measures_a_bf16_preset(tmp_path):
    """The moe preset is bf16, which numpy has no type for: every raw baseline must still take it."""
    report = run_bench_json(str(tmp_path / "disk"), None, 1, "--shapes", "moe")
    names = {row["name"] for row in report["rows"]}
    assert {"sequential write+fsync", "sequential read", "shardpoint save", "dcp load"} <= names


def test_scale_bench_counts_collectives_and_simulates_planning():
    command = [sys.executable, "-m", "shardpoint.cli", "bench", "--scale", "2", "--simulate-ranks", "16"]
    out = subprocess.run([*command, "--repeat", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    (row,) = report["coordination"]
    assert row["ranks"] == 2 and row["calls"]["sp save"] <= row["calls"]["dcp save"]
    assert row["save ratio"] > 0 and row["load ratio"] > 0
    assert set(report["bytes read per stored byte"]) == {"dp=4", "tp2·dp2"}
    (planning,) = report["planning"]
    assert planning["ranks"] == 16 and planning["first save: rank-0 planning s"] > 0
    # the first save's check and the load's plan, the way before beside today's (issue 59)
    assert planning["check s (before)"] > 0 and planning["check s (rank 0)"] > 0 and planning["check s (split)"] > 0
    assert planning["rank-0 peak MB (rank 0)"] > 0 and planning["other rank KB (rank 0)"] > 0
    assert planning["busiest rank peak MB (split)"] > 0
    (load,) = report["load planning"]
    assert load["unpickling .metadata s (before)"] > 0 and load["reading the index s (today)"] > 0
    assert load["load plan s (today)"] > 0 and load["chunks per rank"] == 300
    assert load["busiest planner s (split)"] > 0 and load["until reads begin s (split)"] > 0


def test_store_bench_compares_the_clients_with_shardpoint_on_one_server(s3_server, bucket):
    """``bench --store``: every installed client's raw rates and shardpoint's ratios to s3fs, same server."""
    command = [sys.executable, "-m", "shardpoint.cli", "bench", "--store", f"{bucket}/bench", "--size", "4MB"]
    out = subprocess.run(
        [*command, "--ranks", "2", "--repeat", "1", "--json", "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        env=s3_server.env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    rates = report["rates"]
    for step in ("upload", "download", "small put", "small get", "ranged"):
        assert rates[f"s3fs {step}"] > 0
    assert rates["shardpoint save"] > 0 and rates["shardpoint load"] > 0
    assert report["save ÷ s3fs upload"] > 0 and report["load ÷ s3fs download"] > 0
    for line in report["missing"]:  # a client that is not installed is named, with how to add it
        assert "pip install" in line


def test_the_moe_preset_holds_whole_experts_by_global_id_at_every_expert_parallel_size():
    """ep=4 at 4 ranks, and the same experts, each on one rank, at the reshard phases' 2 and 1."""
    from shardpoint.commands.bench_states import is_expert_key, preset_state

    def experts(world: int) -> list[set[str]]:
        states = [preset_state("moe", 8_000_000, rank, world, 4) for rank in range(world)]
        return [{k for k in s if is_expert_key(k)} for s in states]

    at4, at2, at1 = experts(4), experts(2), experts(1)
    assert all(len(keys) == len(at4[0]) > 0 for keys in at4)  # 32 local experts each, 3 matrices, 3 kinds
    assert set().union(*at4) == set().union(*at2) == at1[0]
    assert sum(len(k) for k in at4) == len(at1[0])  # no expert on two ranks
    assert "layers.0.experts.127.w2.exp_avg" in at4[3] and "layers.0.experts.64.w1.weight" in at2[1]


def test_the_lora_preset_stores_the_frozen_base_once_and_reports_both_rows(tmp_path):
    """``--shapes lora`` (the issue's preset; ``--frozen-base`` is its older name): bytes are counted, so asserted."""
    report = run_bench_json(str(tmp_path / "disk"), None, 1, "--shapes", "lora", "--size", "16MB")
    lora, full = report["lora"], report["full fine-tune"]
    assert report["bytes ratio"] <= 1.05  # a save after the first holds the trained part only
    assert lora["bytes per save"]["full"] > 5 * lora["bytes per save"]["once"]  # 95% of the parameters are frozen
    assert full["bytes per save"]["once"] == full["bytes per save"]["full"]  # nothing frozen: nothing referred to
    assert report["time ratio"] > 0 and report["full fine-tune ratio"] > 0
    assert not any((tmp_path / "disk").iterdir())


def dead_pid() -> int:
    """The pid of a process that has exited."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def killed_bench(directory: Path) -> Path:
    """What a bench killed before its clean-up leaves: its marked folder, with a checkpoint in it."""
    from shardpoint.commands.bench_dirs import BENCH_MARKER

    pid = dead_pid()
    folder = directory / f"run-{pid}"
    (folder / "iter_0000001").mkdir(parents=True)
    (folder / BENCH_MARKER).write_text(str(pid))
    return folder


def test_a_bench_run_removes_what_killed_runs_left_and_nothing_else(tmp_path):
    """A killed bench leaves checkpoints behind (in /dev/shm: memory); the next run removes them, not live ones,
    and not a user's folder that merely looks like a run's (issue 54, defect 4)."""
    import os

    from shardpoint.commands.bench_dirs import BENCH_MARKER, run_dir

    killed = killed_bench(tmp_path)
    user = tmp_path / f"run-{dead_pid()}"  # a user's experiment whose number is no live pid
    user.mkdir()
    (user / "model_final.pt").write_bytes(b"a week of training")
    live = tmp_path / f"run-{os.getppid()}"  # a run still going (this test's parent process)
    live.mkdir()
    (live / BENCH_MARKER).write_text(str(os.getppid()))
    (tmp_path / "run-notes").mkdir()  # not a run's folder
    path = run_dir(str(tmp_path), "run")
    assert path == str(tmp_path / f"run-{os.getpid()}") and os.path.isdir(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"run-{os.getppid()}", "run-notes", f"run-{os.getpid()}", user.name]
    )
    assert not killed.exists()
    assert (user / "model_final.pt").read_bytes() == b"a week of training"


def test_a_user_folder_named_as_this_bench_would_name_its_own_is_refused_not_taken(tmp_path):
    """The bench deletes its folder when done: a user's ``run-<this pid>`` must not become it."""
    import os

    import pytest

    from shardpoint.commands.bench_dirs import run_dir

    user = tmp_path / f"run-{os.getpid()}"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not this bench's"):
        run_dir(str(tmp_path), "run")
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]
