"""``shardpoint demo``: train a tensor-, pipeline- and data-parallel GPT, preempt it, resume, reshard.

Phases, each a fresh set of gloo ranks on this machine (see :mod:`shardpoint.demo.procs`)::

    reference  uninterrupted run at the first layout (reused when the settings match)
    train      same layout; SIGTERM after a third of the iterations -> saves, exits 0
    resume     same layout, from that checkpoint; stops at two thirds (exit interval)
    reshard    another layout (default tp=1 pp=2 dp=2), from the dist checkpoint, to the end

then a table of the phases and ``loss.png`` with the curves. The demo checks itself:
the preempted run must leave a committed checkpoint at the step it stopped with
every rank exiting 0, and the same-layout resume must reproduce the reference losses
bit for bit; otherwise it exits with code 1.

Checkpoints go to ``--dir``: a local directory, or ``s3://bucket/prefix`` (endpoint
and credentials from the standard AWS variables, which the ranks inherit). Rank
logs and ``loss.png`` go to ``--out``, always local: by default ``--dir`` itself when
it is local, else a new temporary directory. The demo only ever clears a directory
or prefix that holds its marker object (``.shardpoint-demo``), or an empty one.

``--nnodes 2`` runs the training on torchrun "nodes" with node-local directories and
object storage, loses a node and resumes on one (see :mod:`shardpoint.demo.cluster`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from rich.console import Console
from rich.progress import Progress

import shardpoint as sp
from shardpoint import commit
from shardpoint.demo.cluster import loopback_s3, run_cluster_demo
from shardpoint.demo.model import GPTConfig
from shardpoint.demo.procs import RunOutcome, run_ranks
from shardpoint.demo.report import PhaseReport, compare_losses, phase_progress, plot_losses, render_table, summary_json
from shardpoint.demo.trainer import StepInfo, TrainConfig
from shardpoint.layout import get_layout
from shardpoint.storage import Storage, open_storage

__all__ = ["DemoSettings", "add_parser", "run", "run_demo"]

_MARKER = ".shardpoint-demo"
_REFERENCE_RECORD = "demo_reference.json"


@dataclass(frozen=True)
class DemoSettings:
    """What ``shardpoint demo`` runs (its flags).

    ``directory`` holds the checkpoints (local or ``s3://bucket/prefix``); ``output``
    the local files, rank logs and ``loss.png`` (None: ``directory`` when local, else
    a new temporary directory).
    """

    directory: str = "runs/demo"
    output: str | None = None
    layout: tuple[int, int, int] = (2, 2, 1)
    reshard_layout: tuple[int, int, int] = (1, 2, 2)
    iters: int = 150
    save_interval: int = 25
    seed: int = 1234
    reuse_reference: bool = True

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


def add_parser(subparsers: Any) -> None:
    """Register ``shardpoint demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="train a tp/pp/dp GPT on local CPU ranks: preempt, resume, reshard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    parser.add_argument(
        "--reshard",
        type=int,
        nargs=3,
        metavar=("TP", "PP", "DP"),
        default=(1, 2, 2),
        help="layout of the last phase (default 1 2 2)",
    )
    parser.add_argument("--iters", type=int, default=DemoSettings.iters, help="training iterations")
    parser.add_argument("--save-interval", type=int, default=DemoSettings.save_interval)
    parser.add_argument(
        "--dir",
        default=DemoSettings.directory,
        help="where the checkpoints go: a local directory or s3://bucket/prefix (default runs/demo)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="local directory for rank logs and loss.png (default: --dir when local, else a temporary directory)",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="run on this many torchrun 'nodes' with node-local dirs and object storage, SIGKILL the last one, "
        "resume on one node at the reshard layout (see shardpoint.demo.cluster)",
    )
    parser.add_argument("--no-reuse", action="store_true", help="rerun the reference even if one matches")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The ``demo`` command: returns 0 when every check passed, 1 otherwise."""
    if args.iters < 6:
        raise sp.CheckpointError(f"--iters must be at least 6 to preempt, resume and reshard; got {args.iters}")
    settings = DemoSettings(
        directory=args.dir,
        output=args.out,
        layout=(args.tp, args.pp, args.dp),
        reshard_layout=tuple(args.reshard),
        iters=args.iters,
        save_interval=args.save_interval,
        reuse_reference=not args.no_reuse,
    )
    _check_layouts(settings)
    world = args.tp * args.pp * args.dp
    if args.nnodes < 1 or world % args.nnodes:
        raise sp.CheckpointError(f"--nnodes {args.nnodes} must divide the world size tp*pp*dp = {world}")
    settings = replace(settings, output=_output_dir(settings))
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notice is noise here
    stream = sys.stderr if args.json else sys.stdout
    # Not a terminal (a log, a pipe): no width to fit, so keep the table on one line per row.
    console = Console(stderr=args.json, width=None if stream.isatty() else 110)
    started = time.perf_counter()
    show = not args.quiet and not args.json
    if args.nnodes > 1:
        with loopback_s3(settings.directory) as remote:
            phases, problems = run_cluster_demo(settings, args.nnodes, remote, settings.output, console, show)
    else:
        phases, problems = run_demo(settings, console, show_progress=show)
    wall = time.perf_counter() - started
    plot = os.path.join(settings.output, "loss.png")
    if args.json:
        print(
            summary_json(
                phases, {"wall_seconds": wall, "problems": problems, "plot": plot, "settings": asdict(settings)}
            )
        )
    else:
        render_table(phases, console)
        for problem in problems:
            console.print(f"[red]✗ {problem}[/red]")
        console.print(
            f"checkpoints under {settings.directory}, logs under {settings.output}, loss curves in {plot}; "
            f"finished in {wall:.1f} s"
        )
    return 1 if problems else 0


def _check_layouts(settings: DemoSettings) -> None:
    """Fail before starting any rank when a layout cannot split the model or the batch."""
    for layout in (settings.layout, settings.reshard_layout):
        config = settings.train_config("", layout)
        config.model.check_layout(config.tp, config.pp)
        sp.divide(
            config.global_batch_size,
            config.dp * config.micro_batch_size,
            f"global_batch_size (over dp={config.dp} x micro_batch_size={config.micro_batch_size})",
        )


def run_demo(
    settings: DemoSettings, console: Console, show_progress: bool = True
) -> tuple[list[PhaseReport], list[str]]:
    """Run the four phases; returns their reports and the checks that failed."""
    storage = open_storage(settings.directory)
    root = storage.root
    out = _output_dir(settings)
    places = [(storage, root, "--dir")] + ([(open_storage(out), out, "--out")] if out != root else [])
    _prepare_directories(places)
    n = settings.iters
    stop_after, problems = max(1, n // 3), []
    progress = phase_progress(console, show_progress, width=22)
    with progress:
        reference = _reference_phase(settings, storage, root, out, progress)
        run_dir = storage.join(root, "run")
        train, preempted = _phase(
            "train (SIGTERM)", settings.train_config(run_dir, settings.layout), out, progress, sigterm_after=stop_after
        )
        problems += _check_preemption(preempted, storage, run_dir)
        stopped = preempted.result.iteration
        exit_at = min(n - 1, max(stopped + 1, 2 * n // 3))
        resume, _ = _phase(
            "resume", settings.train_config(run_dir, settings.layout, exit_interval=exit_at), out, progress
        )
        reshard, _ = _phase("reshard", settings.train_config(run_dir, settings.reshard_layout), out, progress)
    train.note = (
        f"SIGTERM sent after it {preempted.sigterm_sent_after}; saved it {stopped}, exit codes {preempted.exit_codes}"
    )
    resume.note = f"from it {stopped}; exit-interval {exit_at}"
    reshard.note = f"from it {max(resume.losses, default=stopped)} saved at {train.layout_text}"
    for phase in (train, resume, reshard):
        phase.comparison = compare_losses(phase.losses, reference.losses)
    for phase in (train, resume):
        if phase.comparison != "bit-identical":
            problems.append(
                f"{phase.name} at the reference layout is not bit-identical to the reference ({phase.comparison})"
            )
    if max(reshard.losses, default=0) != n:
        problems.append(f"the resharded run stopped at {max(reshard.losses, default=0)}, not {n}")
    phases = [reference, train, resume, reshard]
    plot_losses([train, resume, reshard], reference.losses, os.path.join(out, "loss.png"))
    return phases, problems


def _output_dir(settings: DemoSettings) -> str:
    """The local directory for logs and ``loss.png`` (see :class:`DemoSettings`)."""
    if settings.output is not None:
        return os.path.abspath(settings.output)
    storage = open_storage(settings.directory)
    return storage.root if storage.is_local else tempfile.mkdtemp(prefix="shardpoint-demo-")


def _prepare_directories(places: list[tuple[Storage, str, str]]) -> None:
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


def _phase(
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


def _reference_phase(settings: DemoSettings, storage: Storage, root: str, out: str, progress: Progress) -> PhaseReport:
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
    report, _ = _phase("reference", config, out, progress)
    report.note = "uninterrupted"
    record = {"config": key, "losses": {str(k): v for k, v in report.losses.items()}}
    storage.write_atomic(record_path, json.dumps(record).encode())
    return report


def _check_preemption(outcome: RunOutcome, storage: Storage, run_dir: str) -> list[str]:
    """The preempted run must have exited 0 everywhere with its stop step committed and tracked."""
    problems = []
    if any(code != 0 for code in outcome.exit_codes):
        problems.append(f"after SIGTERM the ranks exited with codes {outcome.exit_codes}, not all 0")
    if outcome.result.exit_reason != "signal":
        problems.append(f"the preempted run ended by {outcome.result.exit_reason!r}, not by the signal")
    _, tracked = commit.read_tracker(storage, run_dir, get_layout("megatron"))
    if tracked != outcome.result.iteration:
        problems.append(f"the tracker names iteration {tracked}, but the run stopped at {outcome.result.iteration}")
    return problems


def main() -> int:
    """``python -m shardpoint.demo.launch`` (same as ``shardpoint demo``)."""
    parser = argparse.ArgumentParser(prog="shardpoint")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["demo", *sys.argv[1:]])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
