"""A rank that runs out of memory in a Hugging Face weights save or load fails every rank, never hangs.

The failing rank gets a real allocation failure: its address space is capped
(``RLIMIT_AS``) just above what it holds, so assembling the full tensor cannot be
allocated. Each rank catches its error and then waits in a barrier, as a training
script that goes on would: a rank left in ``batch_isend_irecv`` would never reach it,
and the launch would time out.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

import shardpoint as sp
from tests import distributed

ROWS, COLS = 8192, 8192  # each rank's half of a [16384, 8192] float32 weight: 256 MiB (never touched); the full one 512


class Half(torch.nn.Module):
    """One weight split by rows over 2 ranks (Megatron-style ``sharded_state_dict``)."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.w = torch.nn.Parameter(torch.empty(ROWS, COLS))  # pages untouched: no memory used

    def sharded_state_dict(self):
        return {"w": sp.Shard(self.w, (2 * ROWS, COLS), (self.rank * ROWS, 0))}


def _cap_address_space(extra_mib: int) -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra_mib * 2**20, resource.RLIM_INFINITY))


def _run(rank: int, world: int, directory: str, action: str, starved: int) -> str:
    model = Half(rank)
    if action == "load":
        model.w.data.zero_()
        model.w.data = model.w.data.t().contiguous().t()  # a non-contiguous target: received pieces need landing
    if rank == starved:
        _cap_address_space(192)
    try:
        if action == "save":
            sp.save_hf_weights(model, directory)
        else:
            sp.load_hf_weights(model, directory)
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - the test reads each rank's error
        outcome = f"{type(exc).__name__}: {exc}"
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    dist.barrier()  # what a training script reaches next
    return outcome


def test_out_of_memory_on_the_writing_rank_fails_every_rank_naming_it(tmp_path):
    out = str(tmp_path / "out")
    results = distributed.launch(_run, 2, out, "save", 0, timeout=90)
    assert "memory" in results[0].lower() or "allocate" in results[0].lower(), results[0]
    assert "rank 0" in results[1] and results[1].startswith("CheckpointError"), results[1]
    assert not os.path.exists(f"{out}/model.safetensors")  # nothing half-written is published


class Replicated(torch.nn.Module):
    """One replicated weight, held transposed (non-contiguous): bytes that arrive need a landing buffer."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(ROWS, COLS).t())


def _load(rank: int, world: int, directory: str, starved: int) -> str:
    model = Replicated()
    if rank == starved:
        _cap_address_space(128)
    try:
        sp.load_hf_weights(model, directory)
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - the test reads each rank's error
        outcome = f"{type(exc).__name__}: {exc}"
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    dist.barrier()
    return outcome


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm for a 256 MiB file")
def test_out_of_memory_for_a_landing_buffer_fails_every_rank_naming_it(tmp_path):
    from safetensors.torch import save_file

    directory = tempfile.mkdtemp(dir="/dev/shm")
    try:
        save_file({"w": torch.zeros(COLS, ROWS)}, f"{directory}/model.safetensors")
        results = distributed.launch(_load, 2, directory, 1, timeout=90)
    finally:
        shutil.rmtree(directory)
    assert "allocate" in results[1], results[1]
    assert "rank 1" in results[0] and results[0].startswith("CheckpointError"), results[0]
