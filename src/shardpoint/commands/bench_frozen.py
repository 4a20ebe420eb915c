"""``shardpoint bench --frozen-base``: saves of a fine-tune over a frozen base, with the base stored once and without.

The model is LoRA-shaped: per layer a frozen ``h × h`` base matrix and two trainable
adapter matrices with AdamW, of the rank that makes the base 95% of the bytes a save
holds (the issue's state: ``6 · r · h`` bytes of adapters and moments per ``h²`` of base,
so ``r ≈ h / 114``), at a Llama-7B width (``h`` = 4096, ``r`` = 36: 576 KiB adapters,
whose per-item cost in DCP's format, about 1.6 KB each, stays under 1%; at ``h`` = 1024
it was 4%). Two Checkpointers save the same state after every step, one
with ``dedup=True`` (the default) and one with ``dedup=False``, in alternating order
(the disk is shared and noisy). Per save after the first:

- ``bytes / save ÷ trained``: what the save's own directory holds, over the bytes of the
  trained tensors and their optimizer state (target <= 1.05: the base costs nothing);
- ``save time, stored once ÷ full``: median of per-round ratios (target <= 0.2);
- the same ratio for a full fine-tune (nothing frozen), where storing once must cost
  nothing (target within 2%);
- ``hash GB/s``: how fast the frozen bytes are checked unchanged (xxh3-128, one core).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from typing import Any

import torch

from shardpoint.commands import bench_dirs

__all__ = ["report"]

FROZEN_SHARE = 0.95  # of the bytes a save holds: the frozen base
FROZEN_TARGETS = {"bytes ratio": 1.05, "time ratio": 0.2, "full fine-tune ratio": 1.02}


class _Lora(torch.nn.Module):
    def __init__(self, layers: int, hidden: int, frozen: bool):
        super().__init__()
        rank = max(1, round(hidden * (1 / FROZEN_SHARE - 1) / 6))  # adapters + 2 moments: 6·r·h per h²
        gen = torch.Generator().manual_seed(0)
        self.base = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(hidden, hidden, generator=gen), requires_grad=not frozen)
            for _ in range(layers)
        )
        self.down = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(rank, hidden, generator=gen)) for _ in range(layers)
        )
        self.up = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(hidden, rank)) for _ in range(layers))


def _state(size: int, frozen: bool) -> Any:
    import shardpoint as sp

    hidden = 4096
    layers = max(1, round(size / (4 * hidden * hidden)))
    model = _Lora(layers, hidden, frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return sp.TrainState(model=model, optimizer=opt)


def _step(state: Any) -> None:
    for p in state.model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    state.optimizer.step()


def _trained_bytes(state: Any) -> int:
    params = [p for p in state.model.parameters() if p.requires_grad]
    return sum(3 * p.nbytes for p in params)  # the tensor, exp_avg and exp_avg_sq


def _saves(directory: str, size: int, repeat: int, frozen: bool) -> dict[str, Any]:
    """Interleaved saves with dedup on and off; per-round seconds and the bytes each save's directory holds."""
    import shardpoint as sp
    from shardpoint.lifecycle import commit
    from shardpoint.storage.base import LocalStorage

    state = _state(size, frozen)
    roots = {mode: os.path.join(directory, mode) for mode in ("once", "full")}
    ckpts = {
        "once": sp.Checkpointer(roots["once"], keep_last=2),
        "full": sp.Checkpointer(roots["full"], keep_last=2, dedup=False),
    }
    seconds: dict[str, list[float]] = {"once": [], "full": []}
    stored: dict[str, list[int]] = {"once": [], "full": []}
    for iteration in range(1, repeat + 2):
        _step(state)
        order = ("once", "full") if iteration % 2 else ("full", "once")
        for mode in order:
            start = time.perf_counter()
            path = ckpts[mode].save(iteration, state)
            seconds[mode].append(time.perf_counter() - start)
            meta = commit.read_marker(LocalStorage(roots[mode]), path)
            stored[mode].append(meta.stored_bytes)
    for ckpt in ckpts.values():
        ckpt.close()
    ratios = [a / b for a, b in zip(seconds["once"][1:], seconds["full"][1:])]
    return {
        "trained bytes": _trained_bytes(state),
        "bytes per save": {mode: statistics.median(v[1:]) for mode, v in stored.items()},
        "first save bytes": stored["once"][0],
        "seconds": {mode: statistics.median(v[1:]) for mode, v in seconds.items()},
        "time ratio": statistics.median(ratios),
    }


def _hash_rate(size: int) -> float:
    from shardpoint.formats.dedup import tensor_digest

    tensor = torch.randn(max(1, size // 4))
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        tensor_digest(tensor)
        rounds.append(time.perf_counter() - start)
    return tensor.nbytes / min(rounds) / 1e9


def measure(directory: str, size: int, repeat: int) -> dict[str, Any]:
    """Every row for one directory."""
    root = bench_dirs.run_dir(directory, "shardpoint-bench-frozen")
    try:
        lora = _saves(os.path.join(root, "lora"), size, repeat, frozen=True)
        full = _saves(os.path.join(root, "fft"), size, repeat, frozen=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "dir": directory,
        "lora": lora,
        "full fine-tune": full,
        "bytes ratio": lora["bytes per save"]["once"] / lora["trained bytes"],
        "time ratio": lora["time ratio"],
        "full fine-tune ratio": full["time ratio"],
        "hash GB/s": _hash_rate(min(size, 1 << 30)),
    }


def report(size: int, repeat: int, dirs: list[str], as_json: bool, quiet: bool) -> int:
    """Run on every directory and print tables (or one JSON list)."""
    from rich.console import Console

    from shardpoint.commands._output import new_table

    console = Console(stderr=True, quiet=quiet or as_json)
    found = []
    for directory in dirs:
        os.makedirs(directory, exist_ok=True)
        console.print(f"frozen base: {size / 1e9:.2f} GB, {repeat} saves after the first, in {directory}...")
        found.append(measure(directory, size, repeat))
    if as_json:
        print(json.dumps(found, indent=1))
        return 0
    for rows in found:
        lora = rows["lora"]
        table = new_table("measure", "value", "target", "", title=f"{rows['dir']}: frozen base stored once")
        once, full = lora["bytes per save"]["once"], lora["bytes per save"]["full"]
        table.add_row("bytes / save, stored once", f"{once / 1e6:.1f} MB", "", "")
        table.add_row("bytes / save, every tensor", f"{full / 1e6:.1f} MB", "", "")
        table.add_row("trained tensors + optimizer", f"{lora['trained bytes'] / 1e6:.1f} MB", "", "")
        for key, label in (
            ("bytes ratio", "bytes / save ÷ trained"),
            ("time ratio", "save time, stored once ÷ full"),
            ("full fine-tune ratio", "full fine-tune, dedup on ÷ off"),
        ):
            limit = FROZEN_TARGETS[key]
            ok = rows[key] <= limit
            table.add_row(label, f"{rows[key]:.3f}", f"<= {limit}", "[green]met[/green]" if ok else "[red]missed[/red]")
        table.add_row("hash of frozen bytes", f"{rows['hash GB/s']:.1f} GB/s", "", "")
        Console().print(table)
    return 0
