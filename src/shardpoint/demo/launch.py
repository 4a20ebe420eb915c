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
import logging
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Any

from rich.console import Console

import shardpoint as sp
from shardpoint.catalog.layout import get_layout
from shardpoint.commands import plain_help
from shardpoint.demo.cluster import loopback_s3, run_cluster_demo
from shardpoint.demo.phases import DemoSettings, output_dir, prepare_directories, reference_phase, run_phase
from shardpoint.demo.procs import RunOutcome
from shardpoint.demo.report import PhaseReport, compare_losses, phase_progress, plot_losses, render_table, summary_json
from shardpoint.lifecycle import commit
from shardpoint.storage.base import Storage, open_storage

__all__ = ["DemoSettings", "add_parser", "run", "run_demo"]


def add_parser(subparsers: Any) -> None:
    """Register ``shardpoint demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="train a tp/pp/dp GPT on local CPU ranks: preempt, resume, reshard",
        description=plain_help(__doc__),
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
    parser.add_argument(
        "--local-interval",
        type=int,
        metavar="N",
        help="with --nnodes 2 or more: also keep a non-persistent local tier every N steps, lose every node, "
        "replace node 1 by an empty one and resume from the local tier (the table shows the steps lost)",
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
        local_interval=args.local_interval,
    )
    _check_layouts(settings)
    _check_local_interval(settings, args.nnodes)
    world = args.tp * args.pp * args.dp
    if args.nnodes < 1 or world % args.nnodes:
        raise sp.CheckpointError(f"--nnodes {args.nnodes} must divide the world size tp*pp*dp = {world}")
    output = output_dir(settings)
    settings = replace(settings, output=output)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notice is noise here
    stream = sys.stderr if args.json else sys.stdout
    # Not a terminal (a log, a pipe): no width to fit, so keep the table on one line per row.
    console = Console(stderr=args.json, width=None if stream.isatty() else 110)
    started = time.perf_counter()
    show = not args.quiet and not args.json
    if args.nnodes > 1:
        with loopback_s3(settings.directory) as remote:
            phases, problems = run_cluster_demo(settings, args.nnodes, remote, output, console, show)
    else:
        phases, problems = run_demo(settings, console, show_progress=show)
    wall = time.perf_counter() - started
    written = os.path.join(output, "loss.png")
    plot = written if os.path.exists(written) else None  # none without matplotlib (plot_losses says so)
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
            f"checkpoints under {settings.directory}, logs under {settings.output}, "
            f"{f'loss curves in {plot}' if plot else 'no plot (no matplotlib)'}; "
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


def _check_local_interval(settings: DemoSettings, nnodes: int) -> None:
    """``--local-interval`` needs other nodes to hold replicas, and must save more often than the persistent tier."""
    every = settings.local_interval
    if every is None:
        return
    if nnodes < 2:
        raise sp.CheckpointError(f"--local-interval {every} needs --nnodes 2 or more (replicas live on other nodes)")
    if not 0 < every < settings.save_interval:
        raise sp.CheckpointError(
            f"--local-interval {every} must be between 1 and --save-interval {settings.save_interval} - 1: "
            "the local tier is the one saved more often"
        )


def run_demo(
    settings: DemoSettings, console: Console, show_progress: bool = True
) -> tuple[list[PhaseReport], list[str]]:
    """Run the four phases; returns their reports and the checks that failed."""
    storage = open_storage(settings.directory)
    root = storage.root
    out = output_dir(settings)
    places = [(storage, root, "--dir")] + ([(open_storage(out), out, "--out")] if out != root else [])
    prepare_directories(places)
    n = settings.iters
    stop_after, problems = max(1, n // 3), []
    progress = phase_progress(console, show_progress, width=22)
    with progress:
        reference = reference_phase(settings, storage, root, out, progress)
        run_dir = storage.join(root, "run")
        train, preempted = run_phase(
            "train (SIGTERM)", settings.train_config(run_dir, settings.layout), out, progress, sigterm_after=stop_after
        )
        problems += _check_preemption(preempted, storage, run_dir)
        stopped = preempted.result.iteration
        exit_at = min(n - 1, max(stopped + 1, 2 * n // 3))
        resume, _ = run_phase(
            "resume", settings.train_config(run_dir, settings.layout, exit_interval=exit_at), out, progress
        )
        reshard, _ = run_phase("reshard", settings.train_config(run_dir, settings.reshard_layout), out, progress)
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
