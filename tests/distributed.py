"""Run a function on N real processes joined by a gloo process group (CPU).

The default group uses the strict backend (:mod:`tests.strict_backend`: gloo with
NCCL's rules enforced on shardpoint's calls); ``SP_TEST_BACKEND=gloo`` runs plain gloo.

Children start from a forkserver that has already imported torch, so a rank starts
in well under a second instead of re-importing torch. Each rank's return value is
written with ``torch.save`` and handed back; a rank that raises makes ``launch``
raise with that rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

_CTX = mp.get_context("forkserver")
# torch._dynamo is imported by every optimizer's construction: preloading it saves ~1 s per rank
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "numpy", "shardpoint"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    rank: int, world: int, port: int, out: str, env: dict[str, str], fn: Callable, args: tuple, backend: str
) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        backend = os.environ.get("SP_TEST_BACKEND", backend)
        if backend == "strict":
            from tests import strict_backend

            strict_backend.register()
        timeout = timedelta(seconds=float(os.environ.get("SP_TEST_TIMEOUT", 60)))
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        result = fn(rank, world, *args)
        torch.save(result, f"{out}/result_{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent through a file
        with open(f"{out}/error_{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


class RankFailure(AssertionError):
    def __init__(self, codes: list[int | None], errors: dict[int, str]):
        self.codes = codes
        self.errors = errors
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"exit codes {codes}\n{detail}")


def launch(
    fn: Callable,
    world: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    expect_failure: bool = False,
    backend: str = "strict",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return each rank's result.

    ``backend`` of the default group: ``"strict"`` (NCCL's rules on gloo) or ``"gloo"``.

    With ``expect_failure`` the exit codes are returned instead of raising (for
    tests that kill ranks on purpose). A rendezvous port taken by someone else
    between choosing and binding it is retried with another port.
    """
    for attempt in range(3):
        try:
            return _launch_once(fn, world, args, env, timeout, expect_failure, backend)
        except RankFailure as failure:
            taken = any("address already in use" in tb.lower() for tb in failure.errors.values())
            if not taken or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _launch_once(
    fn: Callable,
    world: int,
    args: tuple,
    env: dict[str, str] | None,
    timeout: float,
    expect_failure: bool,
    backend: str,
) -> list[Any]:
    out = tempfile.mkdtemp(prefix="sp-ranks-")
    port = free_port()
    procs = [
        _CTX.Process(target=_child, args=(r, world, port, out, env or {}, fn, args, backend)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    if expect_failure:
        return codes
    errors = {
        r: Path(f"{out}/error_{r}.txt").read_text() for r in range(world) if os.path.exists(f"{out}/error_{r}.txt")
    }
    if errors or any(c != 0 for c in codes):
        raise RankFailure(codes, errors)
    return [torch.load(f"{out}/result_{r}.pt", weights_only=False) for r in range(world)]
