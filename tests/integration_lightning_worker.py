"""One scenario of the Lightning integration tests, run on every rank (``torchrun`` or plain ``python``).

``python tests/integration_lightning_worker.py SCENARIO WORKDIR``; rank 0 writes what
the test compares to ``WORKDIR/<scenario>.pt``. Scenarios:

* ``ddp-first``: ``strategy="ddp"`` at 2 ranks: run A trains 6 steps uninterrupted;
  run B trains the same and is killed (``os._exit``) after step 5.
* ``ddp-resume``: B resumes from ``ckpt_path="last"`` to step 6; then a copy of B whose
  newest checkpoint has one flipped byte is resumed, which must fail naming the file.
* ``mp-save``: ``ModelParallelStrategy(2, 1)`` with ``fully_shard`` trains 6 steps, validating each
  epoch for a top-2 ``ModelCheckpoint(monitor="val_loss")``.
* ``mp-resume``: the same at one rank resumes from ``last`` (no steps left to train).
* ``ddp-one-rank-refuses``: rank 1 alone adds an object to the checkpoint dict; every
  rank's error and the seconds the save took go to the result.

The data has 2 batches per rank and epoch and ``every_n_train_steps=2``, so every
checkpoint falls on an epoch's last batch: Lightning replays a plain ``DataLoader``'s
epoch from its start when resumed in the middle of one, which no checkpoint can fix.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from shardpoint.integrations.lightning import ShardpointCheckpointIO

DIM, OUT, SAMPLES, BATCH = 8, 4, 16, 4
KILL_AT = 5
START = time.monotonic()


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUT))
        self._sharded = False

    def configure_model(self) -> None:
        mesh = self._device_mesh
        if mesh is None or self._sharded:
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])
        self._sharded = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        # the top-k callback's metric: a per-epoch value that differs between epochs
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class RefusedOnRank1(Tiny):
    """Adds what ``torch.load(weights_only=True)`` cannot read, on rank 1 only."""

    def on_save_checkpoint(self, checkpoint):
        if self.global_rank == 1:
            import argparse

            checkpoint["cfg"] = argparse.Namespace(depth=2)


class KillAt(Callback):
    """A crash: the process ends at once after step ``step``, with no teardown."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            sys.stdout.flush()
            os._exit(17)


def data(val: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(0)  # validation on the training data: its loss falls, so top-k rotates
    x, y = torch.randn(SAMPLES, DIM, generator=g), torch.randn(SAMPLES, OUT, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=not val)


def trainer(run: Path, strategy, devices: int, max_steps: int, *callbacks: Callback, topk: bool = False) -> pl.Trainer:
    """Checkpoints every 2 steps and ``last``; with ``topk`` also the best 2 by ``val_loss``, validating each epoch."""
    if topk:
        callbacks = (*callbacks, ModelCheckpoint(dirpath=run / "topk", monitor="val_loss", save_top_k=2, mode="min"))
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        plugins=[ShardpointCheckpointIO()],
        max_steps=max_steps,
        callbacks=[
            ModelCheckpoint(dirpath=run / "ckpt", every_n_train_steps=2, save_last=True),
            *callbacks,
        ],
        default_root_dir=run,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=None if topk else 0,
    )


def fit(t: pl.Trainer, ckpt_path: str | None = None) -> Tiny:
    model = Tiny()
    t.fit(model, train_dataloaders=data(), val_dataloaders=data(val=True), ckpt_path=ckpt_path)
    log(f"fit done at step {t.global_step}")
    return model


def plain_state(t: pl.Trainer, model: Tiny) -> dict:
    """Weights, optimizer state (incl. param groups), LR and step, as full CPU tensors."""
    opt = t.optimizers[0]
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "lr": opt.param_groups[0]["lr"],
        "global_step": t.global_step,
    }


def full_state(t: pl.Trainer, model: Tiny) -> dict:
    """The same for an FSDP2 model: full tensors keyed by parameter name (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "weights": get_model_state_dict(model, options=opts),
        "optimizer": get_optimizer_state_dict(model, t.optimizers[0], options=opts),
        "global_step": t.global_step,
        "topk": sorted(path for cb in t.checkpoint_callbacks if cb.monitor for path in cb.best_k_models),
    }


def flip_byte_in_newest(src: Path, dst: Path) -> str:
    """Copy run ``src`` to ``dst`` and flip one byte in the largest data file of its newest checkpoint."""
    shutil.copytree(src, dst)
    newest = max((p for p in (dst / "ckpt").iterdir() if p.suffix == ".ckpt"), key=lambda p: p.stat().st_mtime)
    files = json.loads((newest / "shardpoint.json").read_text())["files"]
    name = max(files, key=lambda f: files[f]["size"])
    with open(newest / name, "r+b") as f:
        f.seek(files[name]["size"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return name


def log(text: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s rank {os.environ.get('RANK', 0)}] {text}", flush=True)


def main(scenario: str, work: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    result: dict = {}
    if scenario == "ddp-first":
        t = trainer(work / "A", "ddp", 2, 6)
        result["A"] = plain_state(t, fit(t))
        if rank == 0:
            torch.save(result, work / f"{scenario}.pt")
        fit(trainer(work / "B", "ddp", 2, 6, KillAt(KILL_AT)))
        raise AssertionError("run B was to be killed at step 5")
    if scenario == "ddp-resume":
        t = trainer(work / "B", "ddp", 2, 6)
        result["B"] = plain_state(t, fit(t, ckpt_path="last"))
        flipped = flip_byte_in_newest(work / "B", work / "B-flipped") if rank == 0 else None
        result["flipped"] = t.strategy.broadcast(flipped)
        try:
            fit(trainer(work / "B-flipped", "ddp", 2, 6), ckpt_path="last")
        except Exception as exc:  # noqa: BLE001 - what the test checks
            result["error"] = f"{type(exc).__name__}: {exc}"
    if scenario == "mp-save":
        t = trainer(work / "M", ModelParallelStrategy(2, 1), 2, 6, topk=True)
        result["saved"] = full_state(t, fit(t))
    if scenario == "mp-resume":
        t = trainer(work / "M", ModelParallelStrategy(1, 1), 1, 6)
        result["loaded"] = full_state(t, fit(t, ckpt_path="last"))
    if scenario == "ddp-one-rank-refuses":
        started = time.monotonic()
        try:
            trainer(work / "R", "ddp", 2, 2).fit(RefusedOnRank1(), train_dataloaders=data())
            error = "no error"
        except Exception as exc:  # noqa: BLE001 - what the test checks
            error = f"{type(exc).__name__}: {exc}"
        result["seconds"] = time.monotonic() - started
        result["errors"] = [None, None]
        torch.distributed.all_gather_object(result["errors"], error)
    if rank == 0:
        torch.save(result, work / f"{scenario}.pt")
    if torch.distributed.is_initialized():
        # leave together: a rank whose peer exited first can abort in gloo's teardown at exit
        torch.distributed.barrier()
        if scenario == "ddp-one-rank-refuses":
            # after a fit that failed mid-save, interpreter teardown aborted once in 4 runs in C++
            # ("terminate called without an active exception"); the result is already written
            sys.stdout.flush()
            os._exit(0)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
