"""Start the ranks of one training run as local processes joined by a gloo process group.

Ranks come from a ``forkserver`` that has already imported torch, so starting four
of them costs a fork each rather than four torch imports. Rank 0 reports every step
over a queue; the parent turns the reports into progress and may preempt the job
by sending SIGTERM to every rank, as a cluster scheduler would, after a given
iteration. The ranks then save at the next step boundary and exit with code 0
(see :mod:`shardpoint.demo.preemption`).

If a rank fails, the others are killed at once rather than left waiting in a
collective, and the failure is raised with the rank's log file named.

A forked rank would see the environment of the forkserver, which is the parent's
as it was when the first run started; each rank therefore takes the parent's
environment as it is when the rank starts (``AWS_*`` settings of an ``s3://`` save
directory set after the first run, for instance).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import shardpoint as sp
from shardpoint.demo.trainer import StepInfo, TrainConfig, Trainer, TrainResult

__all__ = ["RankFailedError", "RunOutcome", "free_port", "run_function", "run_ranks"]

log = logging.getLogger(__name__)

# torch._dynamo: torch.optim.Optimizer imports it on first construction, about 1 s per rank otherwise.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "shardpoint", "shardpoint.demo.trainer"]


class RankFailedError(sp.CheckpointError):
    """A rank of a demo run exited with an error."""


@dataclass
class RunOutcome:
    """How a run ended: every rank's exit code, rank 0's result, and when SIGTERM was sent."""

    exit_codes: list[int | None]
    result: TrainResult
    sigterm_sent_after: int | None
    wall_seconds: float


def free_port() -> int:
    """A TCP port that was free a moment ago (for the gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_logging(rank: int, log_dir: str | None) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    if log_dir:
        handler: logging.Handler = logging.FileHandler(os.path.join(log_dir, f"rank_{rank:02d}.log"))
        root.setLevel(logging.INFO)
    else:
        handler = logging.StreamHandler()
        root.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)


def _rank_main(
    rank: int, world: int, port: int, config: TrainConfig, events: Any, log_dir: str | None, env: dict[str, str]
) -> None:
    """One rank: join the group, train, report.

    Ctrl-C is the parent's to handle (it preempts the ranks with SIGTERM). SIGTERM is
    ignored outside the training loop, where the trainer's handler records it: the
    parent only sends it after a step was reported, and one arriving after the last
    step has nothing left to stop (the run already saved).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    _setup_logging(rank, log_dir)
    started = time.perf_counter()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=2)
    )
    log.info("rank %d of %d joined the gloo group in %.2f s", rank, world, time.perf_counter() - started)
    try:
        report = (lambda info: events.put(("step", info))) if events is not None else None
        result = Trainer(config, on_step=report).run()
        if events is not None:
            events.put(("done", result))
    except BaseException:
        log.exception("rank %d failed", rank)
        raise
    finally:
        dist.destroy_process_group()


def _function_main(rank: int, world: int, port: int, env: dict[str, str], fn: Callable, args: tuple) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=2)
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_function(fn: Callable, world: int, *args: Any, timeout: float = 600.0) -> None:
    """Run the module-level function ``fn(rank, world, *args)`` on ``world`` local gloo ranks.

    Raises:
        RankFailedError: a rank raised (its traceback is printed to stderr) or timed out.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_function_main, args=(r, world, port, env, fn, args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.perf_counter() + timeout
    while any(p.exitcode is None for p in procs):
        failed: list[tuple[int, int | None]] = [
            (i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)
        ]
        if failed or time.perf_counter() > deadline:
            _kill(procs)
            raise RankFailedError(_failure_message(failed, None))
        time.sleep(0.05)
    failed = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RankFailedError(_failure_message(failed, None))


def run_ranks(
    config: TrainConfig,
    *,
    on_step: Callable[[StepInfo], Any] | None = None,
    sigterm_after: int | None = None,
    log_dir: str | None = None,
    timeout: float = 900.0,
) -> RunOutcome:
    """Run ``config`` on ``tp * pp * dp`` local gloo ranks and wait for them.

    Args:
        on_step: called in this process for every step rank 0 reports.
        sigterm_after: send SIGTERM to every rank once rank 0 reports this iteration.
        log_dir: where each rank writes ``rank_NN.log`` (None: warnings to stderr).
        timeout: seconds after which the ranks are killed.

    Raises:
        RankFailedError: a rank exited with an error or the run timed out.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    world = config.tp * config.pp * config.dp
    events = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world, port, config, events if r == 0 else None, log_dir, dict(os.environ)),
            name=f"shardpoint-demo-rank-{r}",
        )
        for r in range(world)
    ]
    start = time.perf_counter()
    for p in procs:
        p.start()
    try:
        result, sent = _watch(procs, events, on_step, sigterm_after, start + timeout, log_dir)
    except BaseException:
        _kill(procs)
        raise
    for p in procs:
        p.join()
    return RunOutcome([p.exitcode for p in procs], result, sent, time.perf_counter() - start)


def _watch(
    procs: list, events: Any, on_step: Callable | None, sigterm_after: int | None, deadline: float, log_dir: str | None
) -> tuple[TrainResult, int | None]:
    """Relay events until every rank has exited; preempt when asked; fail fast on a dead rank."""
    result, sent = None, None
    while True:
        try:
            kind, payload = events.get(timeout=0.1)
        except queue.Empty:
            failed = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed or time.perf_counter() > deadline:
                raise RankFailedError(_failure_message(failed, log_dir)) from None
            if all(p.exitcode is not None for p in procs):
                break
            continue
        if kind == "done":
            result = payload
        elif kind == "step":
            if on_step is not None:
                on_step(payload)
            if sigterm_after is not None and sent is None and payload.iteration >= sigterm_after:
                for p in procs:
                    p.terminate()  # SIGTERM: the ranks save at the next step boundary and exit 0
                sent = payload.iteration
    if result is None:
        raise RankFailedError("the ranks exited without reporting a result" + _log_hint(log_dir))
    return result, sent


def _failure_message(failed: list[tuple[int, int | None]], log_dir: str | None) -> str:
    if not failed:
        return "the demo ranks did not finish in time; they were stopped" + _log_hint(log_dir)
    rank, code = failed[0]
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return f"rank {rank} {how}" + _log_hint(log_dir)


def _log_hint(log_dir: str | None) -> str:
    return f"; see its log under {log_dir}" if log_dir else "; its traceback is printed above"


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()
