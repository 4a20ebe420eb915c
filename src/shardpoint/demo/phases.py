"""The pieces of ``shardpoint demo`` that the one-node and the two-node demos share.

:class:`DemoSettings` (the flags), the output and checkpoint directories (created, or
the previous demo's run cleared, never someone else's files), one training phase run
under a progress bar, and the uninterrupted reference run (reused when recorded).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Any

from rich.progress import Progress

import shardpoint as sp
from shardpoint.demo.model import GPTConfig
from shardpoint.demo.procs import RunOutcome, run_ranks
from shardpoint.demo.report import PhaseReport
from shardpoint.demo.trainer import StepInfo, TrainConfig
from shardpoint.storage.base import Storage, open_storage

__all__ = ["DemoSettings", "output_dir", "prepare_directories", "reference_phase", "run_phase"]

_MARKER = ".shardpoint-demo"
_REFERENCE_RECORD = "demo_reference.json"


@dataclass(frozen=True)
class DemoSettings:
    """What ``shardpoint demo`` runs (its flags).

    ``directory`` holds the checkpoints (local or ``s3://bucket/prefix``); ``output``
    the local files, rank logs and ``loss.png`` (None: ``directory`` when local, else
    a new temporary directory). ``local_interval``: the multi-node demo's local tier
    (None: none; the reference run never has one).
    """

    directory: str = "runs/demo"
    output: str | None = None
    layout: tuple[int, int, int] = (2, 2, 1)
    reshard_layout: tuple[int, int, int] = (1, 2, 2)
    iters: int = 150
    save_interval: int = 25
    seed: int = 1234
    reuse_reference: bool = True
    local_interval: int | None = None

    def train_config(self, save: str, layout: tuple[int, int, int], **overrides: Any) -> TrainConfig:
        tp, pp, dp = layout
        return TrainConfig(
            save=save,
            tp=tp,
            pp=pp,
            dp=dp,
            model=GPTConfig(),
            train_iters=self.iters,
            save_interval=self.save_interval,
            seed=self.seed,
            validate_forward=True,
            warmup_iters=max(1, self.iters // 10),
            **overrides,
        )


def output_dir(settings: DemoSettings) -> str:
    """The local directory for logs and ``loss.png`` (see :class:`DemoSettings`)."""
    if settings.output is not None:
        return os.path.abspath(settings.output)
    storage = open_storage(settings.directory)
    return storage.root if storage.is_local else tempfile.mkdtemp(prefix="shardpoint-demo-")


def prepare_directories(places: list[tuple[Storage, str, str]]) -> None:
    """Create the demo's directories (or prefixes), or clear the previous demo's run in them.

    ``places`` are ``(storage, root, flag)``. One that holds anything but not the
    demo's marker is refused, never cleared: it may hold someone's checkpoints. All
    are checked before any is touched, so one may lie inside another.
    """
    for storage, root, flag in places:
        if storage.exists(root) and not storage.is_dir(root):
            raise sp.CheckpointError(f"{root} is a file; pass another {flag}")
        names = storage.listdir(root)
        if names and _MARKER not in names:
            raise sp.CheckpointError(f"{root} exists and was not created by `shardpoint demo`; pass another {flag}")
    for storage, root, _ in places:
        for name in ("run", "logs"):
            storage.remove(storage.join(root, name))
        storage.makedirs(root)
        storage.write_atomic(
            storage.join(root, _MARKER),
            b"created by `shardpoint demo`; its subdirectories are replaced by the next demo run\n",
        )


def run_phase(
    name: str, config: TrainConfig, out: str, progress: Progress, sigterm_after: int | None = None
) -> tuple[PhaseReport, RunOutcome]:
    """Run one phase with a progress bar, rank logs under ``out``; returns its report and how its ranks ended."""
    task = progress.add_task(name, total=config.train_iters, loss="-")

    def on_step(info: StepInfo) -> None:
        progress.update(task, completed=info.iteration, loss=f"{info.loss:.3f}")

    log_dir = os.path.join(out, "logs", name.split()[0])
    os.makedirs(log_dir, exist_ok=True)
    outcome = run_ranks(config, on_step=on_step, sigterm_after=sigterm_after, log_dir=log_dir)
    result = outcome.result
    report = PhaseReport(
        name,
        (config.tp, config.pp, config.dp),
        dict(result.losses),
        sum(s.seconds for s in result.saves),
        sum(s.bytes for s in result.saves),
        outcome.wall_seconds,
        exit_codes=list(outcome.exit_codes),
    )
    return report, outcome


def reference_phase(settings: DemoSettings, storage: Storage, root: str, out: str, progress: Progress) -> PhaseReport:
    """The uninterrupted run, or the recorded one when its settings match (``--no-reuse`` reruns it).

    The record lives beside the reference checkpoints (on object storage too).
    """
    ref_dir = storage.join(root, "reference")
    record_path = storage.join(ref_dir, _REFERENCE_RECORD)
    config = settings.train_config(ref_dir, settings.layout)
    key = json.loads(json.dumps(asdict(replace(config, save=""))))
    if settings.reuse_reference and storage.exists(record_path):
        record = json.loads(storage.read_bytes(record_path))
        if record.get("config") == key:
            losses = {int(k): float(v) for k, v in record["losses"].items()}
            return PhaseReport(
                "reference (reused)", settings.layout, losses, 0.0, 0, 0.0, note=f"recorded in {record_path}"
            )
    storage.remove(ref_dir)
    report, _ = run_phase("reference", config, out, progress)
    report.note = "uninterrupted"
    record = {"config": key, "losses": {str(k): v for k, v in report.losses.items()}}
    storage.write_atomic(record_path, json.dumps(record).encode())
    return report
