"""A c10d backend that keeps NCCL's rules on CPU: gloo underneath, NCCL's contract on top.

The multi-rank tests run with it as the default backend (``tests/distributed.py``),
so the default group stands for a trainer's NCCL group. It rejects, on that group:

- tensor collectives on CPU tensors made from shardpoint's code: NCCL only moves GPU
  tensors, and an object collective on it pickles onto the current GPU
  (``all_gather_object`` of an optimizer slice is an out-of-memory at scale); our
  control traffic belongs on the gloo control group (:mod:`shardpoint.parallel.comm`);
- collectives from a thread other than the main thread (a background save racing
  the trainer's collectives on one communicator hangs NCCL);
- object payloads (``uint8`` tensors) over :data:`PAYLOAD_LIMIT` bytes;

and counts every call (:data:`CALLS`), so tests can assert that a step which does
not save makes no collective on the default group.

Calls from the test's own code, the demo trainer and frameworks it drives are
allowed, as a trainer's would be: a call is ours when the innermost frame outside
torch is in ``src/shardpoint`` (outside ``demo/`` and ``bench.py``).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

NAME = "strict"
PAYLOAD_LIMIT = 64 * 1024
CALLS: dict[str, int] = {}

_PACKAGE = str(Path(__file__).resolve().parents[1] / "src" / "shardpoint")
_USER_PARTS = (f"{_PACKAGE}/demo/", f"{_PACKAGE}/bench.py")
_TORCH = str(Path(torch.__file__).resolve().parent)


class StrictBackendError(RuntimeError):
    """A collective that NCCL would not survive."""


def _ours() -> str | None:
    """The shardpoint frame (file:line) that made this call, or None for a trainer's own call.

    The innermost frame outside torch decides: DCP's collectives run on behalf of the
    shardpoint code that called DCP, while a trainer's callback that shardpoint calls
    (a forward pass computing validation logits) makes the trainer's own calls.
    """
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH) and name != __file__:
            if name.startswith(_PACKAGE) and not name.startswith(_USER_PARTS):
                return f"{name[len(_PACKAGE) + 1 :]}:{frame.f_lineno}"
            return None
        frame = frame.f_back
    return None


class StrictProcessGroup(dist.ProcessGroup):
    def __init__(self, inner: dist.ProcessGroup, rank: int, size: int):
        super().__init__(rank, size)
        self.inner = inner

    def getBackendName(self) -> str:
        return NAME

    def _check(self, op: str, tensors: list[torch.Tensor]) -> None:
        CALLS[op] = CALLS.get(op, 0) + 1
        if threading.current_thread() is not threading.main_thread():
            raise StrictBackendError(f"{op} on the default group from thread {threading.current_thread().name}")
        where = _ours()
        if where is None:
            return
        cpu = [t for t in tensors if t.device.type == "cpu"]
        if cpu:
            raise StrictBackendError(f"{op} of a CPU tensor {tuple(cpu[0].shape)} on the default group from {where}")
        big = [t for t in tensors if t.dtype == torch.uint8 and t.numel() > PAYLOAD_LIMIT]
        if big:
            raise StrictBackendError(f"{op}: an object payload of {big[0].numel()} bytes from {where}")

    def allreduce(self, tensors, opts=None):
        self._check("allreduce", tensors)
        return self.inner.allreduce(tensors, opts or dist.AllreduceOptions())

    def broadcast(self, tensors, opts=None):
        self._check("broadcast", tensors)
        return self.inner.broadcast(tensors, opts or dist.BroadcastOptions())

    def allgather(self, outputs, inputs, opts=None):
        self._check("allgather", inputs)
        return self.inner.allgather(outputs, inputs, opts or dist.AllgatherOptions())

    def _allgather_base(self, output, input, opts=None):
        self._check("allgather", [input])
        return self.inner._allgather_base(output, input, opts or dist.AllgatherOptions())

    def gather(self, outputs, inputs, opts=None):
        self._check("gather", inputs)
        return self.inner.gather(outputs, inputs, opts or dist.GatherOptions())

    def scatter(self, outputs, inputs, opts=None):
        self._check("scatter", outputs)
        return self.inner.scatter(outputs, inputs, opts or dist.ScatterOptions())

    def reduce_scatter(self, outputs, inputs, opts=None):
        self._check("reduce_scatter", outputs)
        return self.inner.reduce_scatter(outputs, inputs, opts or dist.ReduceScatterOptions())

    def _reduce_scatter_base(self, output, input, opts=None):
        self._check("reduce_scatter", [output])
        return self.inner._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self._check("alltoall", [input])
        return self.inner.alltoall_base(
            output, input, output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions()
        )

    def send(self, tensors, dst, tag=0):
        self._check("send", tensors)
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        self._check("recv", tensors)
        return self.inner.recv(tensors, src, tag)

    def barrier(self, opts=None):
        self._check("barrier", [])
        return self.inner.barrier(opts or dist.BarrierOptions())


def _create(opts, backend_options):
    """c10d's extended creator API: it names the group, which DeviceMesh looks groups up by."""
    inner = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    pg = StrictProcessGroup(inner, opts.group_rank, opts.group_size)
    pg.name = opts.group_id
    return pg


def register() -> None:
    """Make ``"strict"`` a backend name for ``init_process_group`` / ``new_group`` in this process."""
    if not hasattr(dist.Backend, NAME.upper()):
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


def calls() -> int:
    return sum(CALLS.values())
