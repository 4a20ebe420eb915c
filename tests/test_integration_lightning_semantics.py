"""Lightning's checkpoint semantics through ``ShardpointCheckpointIO``: real Lightning, real Trainer, one process.

What Lightning's own checkpoint tests check of a CheckpointIO (issue 58): the strictness
Lightning decides reaches ``LightningModule.load_state_dict``; ``validate``/``test``/``predict``
restore from a checkpoint before the module is attached; the connector preloads a
checkpoint with no model connected; HPC checkpoints in ``default_root_dir`` are found.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

lightning = pytest.importorskip("lightning.pytorch")

from shardpoint.integrations.lightning import ShardpointCheckpointIO, load_checkpoint_dict  # noqa: E402
from tests.integration_lightning_worker import Tiny, data  # noqa: E402
from tests.test_integration_lightning import assert_same, single_device_trainer  # noqa: E402


class Wider(Tiny):
    """Tiny with one more layer: a checkpoint of Tiny lacks its keys, and Tiny lacks this one's."""

    def __init__(self, lr: float = 0.05):
        super().__init__(lr)
        self.head = torch.nn.Linear(4, 2)


def trained(directory: Path, model: Tiny | None = None) -> tuple[Tiny, Path]:
    model = model or Tiny()
    single_device_trainer(directory, 2).fit(model, train_dataloaders=data())
    return model, directory / "last.ckpt"


def test_load_state_dict_is_called_with_the_strictness_lightning_decides(tmp_path):
    _, path = trained(tmp_path)  # as Lightning's test_strict_loading, through the plugin
    for strict_loading, expected in ((None, True), (True, True), (False, False)):
        model = Tiny()
        model.strict_loading = strict_loading
        with mock.patch.object(model, "load_state_dict") as load:
            single_device_trainer(tmp_path / "again", 2).fit(model, train_dataloaders=data(), ckpt_path=path)
        load.assert_called_once_with(mock.ANY, strict=expected)
        assert sorted(load.call_args.args[0]) == sorted(model.state_dict())  # the saved keys, the live tensors


def test_missing_and_unexpected_keys_fail_as_lightning_unless_strict_loading_is_off(tmp_path):
    source, path = trained(tmp_path)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head.weight", "head.bias"'):
        single_device_trainer(tmp_path / "a", 2).fit(Wider(), train_dataloaders=data(), ckpt_path=path)

    lenient = Wider()
    lenient.strict_loading = False
    head = {k: v.clone() for k, v in lenient.head.state_dict().items()}
    single_device_trainer(tmp_path / "b", 2).fit(lenient, train_dataloaders=data(), ckpt_path=path)
    assert_same(lenient.net.state_dict(), source.net.state_dict(), "the keys both have")
    assert_same(lenient.head.state_dict(), head, "left as initialised")

    _, wide = trained(tmp_path / "wide", Wider())
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "head.bias", "head.weight"'):
        single_device_trainer(tmp_path / "c", 2).validate(Tiny(), dataloaders=data(), ckpt_path=wide)


class Restored(lightning.Callback):
    """Lightning's test_restore_callbacks_in_non_fit_phases callback: its state goes through the checkpoint."""

    def __init__(self):
        self.restored = False

    def state_dict(self):
        return {"restored": self.restored}

    def load_state_dict(self, state):
        self.restored = state["restored"]


def test_validate_test_predict_restore_before_the_module_is_attached(tmp_path):
    class Evaluated(Tiny):
        test_step = Tiny.validation_step

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

    source = Evaluated()
    saver = single_device_trainer(tmp_path, 2)
    saver.callbacks.append(Restored())
    saver.fit(source, train_dataloaders=data())
    saver.callbacks[-1].restored = True
    saver.save_checkpoint(tmp_path / "manual.ckpt")

    for trainer_fn in ("validate", "test", "predict"):  # Lightning's test_restore_callbacks_in_non_fit_phases
        callback, model = Restored(), Evaluated()
        torch.nn.init.zeros_(model.net[0].weight)
        trainer = lightning.Trainer(callbacks=[callback], **_quiet(), **_plugged())
        trainer.strategy.connect(model)  # a restore before the Trainer attaches the module
        trainer._checkpoint_connector.resume_start(tmp_path / "manual.ckpt")
        trainer._checkpoint_connector.restore_callbacks()
        getattr(trainer, trainer_fn)(model, data(), ckpt_path=tmp_path / "manual.ckpt")
        assert callback.restored, trainer_fn
        assert_same(model.state_dict(), source.state_dict(), f"weights after {trainer_fn}")


def test_a_checkpoint_preloaded_with_no_model_connected_is_the_whole_dict(tmp_path):
    source, path = trained(tmp_path)
    connector = single_device_trainer(tmp_path / "fresh", 2)._checkpoint_connector
    connector.resume_start(path)  # Lightning's test_preloaded_checkpoint_lifecycle
    loaded = connector._loaded_checkpoint
    assert loaded["global_step"] == 2
    assert_same(loaded["state_dict"], source.state_dict(), "weights at full size")


def test_hpc_checkpoints_in_the_root_are_found_and_a_missing_path_is_named_as_given(tmp_path, monkeypatch):
    monkeypatch.setattr("lightning.fabric.plugins.environments.slurm.SLURMEnvironment.detect", lambda: True)
    source, _ = trained(tmp_path / "run")
    hpc = single_device_trainer(tmp_path / "run", 2)
    hpc.strategy.connect(source)
    for n in (0, 3, 33):
        hpc.save_checkpoint(tmp_path / f"hpc_ckpt_{n}.ckpt")
    model = Tiny()
    torch.nn.init.zeros_(model.net[0].weight)
    resumed = lightning.Trainer(default_root_dir=tmp_path, max_steps=3, **_quiet(), **_plugged())
    assert resumed._checkpoint_connector._hpc_resume_path == str(tmp_path / "hpc_ckpt_33.ckpt")
    resumed.fit(model, train_dataloaders=data())  # resumes at step 2 from hpc_ckpt_33 on its own
    assert resumed.global_step == 3 and model.net[0].weight.abs().sum() > 0
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: not existing"):
        missing = lightning.Trainer(default_root_dir=tmp_path, **_quiet(), **_plugged())
        missing.fit(Tiny(), data(), ckpt_path="not existing")


def _quiet() -> dict:
    return {"enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu", "devices": 1}


def _plugged() -> dict:
    return {"plugins": [ShardpointCheckpointIO()], "logger": False, "enable_checkpointing": False}


# ------------------------------------------------------------- ddp_spawn: 2 gloo ranks in spawned processes
EPOCHS = 2


class CountingIO(ShardpointCheckpointIO):
    """Counts the checkpoint saves Lightning asks of the plugin (not the launcher's hand-back of the weights)."""

    saves = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if "pytorch-lightning_version" in checkpoint:
            type(self).saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)


class CountedCheckpoint(lightning.callbacks.ModelCheckpoint):
    """Lightning's ModelCheckpointTestInvocations, counting per rank inside the spawned processes."""

    state_dict_count = 0

    def state_dict(self):
        self.state_dict_count += 1
        return super().state_dict()

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        assert self.best_model_path
        assert self.state_dict_count == EPOCHS, self.state_dict_count
        assert CountingIO.saves == EPOCHS, f"rank {trainer.global_rank}: {CountingIO.saves} saves"


def test_ddp_spawn_trains_saves_once_per_checkpoint_and_hands_the_weights_back(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where the launcher's hand-back goes, in each process
    (tmp_path / "tmp").mkdir()
    model = Tiny()
    trainer = lightning.Trainer(
        strategy="ddp_spawn",
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        plugins=[CountingIO()],
        callbacks=[CountedCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)],
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, train_dataloaders=data())
    assert trainer.state.finished
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith("."))
    assert saved == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    assert trainer.checkpoint_callback.best_model_path.endswith("epoch=1-step=4.ckpt")
    # the main process got the trained weights through the plugin, and the hand-back file is gone
    assert_same(model.state_dict(), load_checkpoint_dict(tmp_path / "ckpt" / saved[-1])["state_dict"], "weights")
    assert not [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()]
