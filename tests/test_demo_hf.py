"""Hugging Face export and import of the demo GPT, checked against our own model's logits.

The checkpoint is trained and saved at tp=2 pp=2 with forward validation, so the
logits our model produced at save time (gathered over tp, from the last stage) are
stored beside it: the export must merge the tp/pp shards into a GPT2LMHeadModel
that reproduces them.
"""

from __future__ import annotations

import pytest
import torch

from shardpoint.demo.hf import export_hf, import_hf
from shardpoint.demo.pipeline import forward_logits
from shardpoint.demo.trainer import TrainConfig, Trainer
from tests.distributed import launch
from tests.test_demo_training import config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("hf") / "run")
    launch(_train, 4, config(root, (2, 2, 1), train_iters=3, save_interval=3))
    saved = torch.load(f"{root}/iter_0000003/validation_logits.pt")
    return root, saved


def _train(rank: int, world: int, cfg: TrainConfig) -> None:
    Trainer(cfg).run()


def _hf_logits(directory: str, tokens: torch.Tensor) -> torch.Tensor:
    model, info = transformers.GPT2LMHeadModel.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def test_export_merges_tp_pp_shards_into_identical_hf_model(trained, tmp_path):
    root, saved = trained
    export_hf(root, str(tmp_path / "hf"))
    logits = _hf_logits(str(tmp_path / "hf"), saved["tokens"])
    assert logits.shape == saved["logits"].shape == (2, 64, 256)
    assert (logits - saved["logits"]).abs().max() <= 1e-4


def _load_release(rank: int, world: int, roots: list[str], tokens: torch.Tensor) -> list[torch.Tensor | None]:
    out = []
    for root in roots:
        trainer = Trainer(config(root, (2, 2, 1)))
        result = trainer.ckpt.load(trainer.state)
        assert result.release and result.iteration == 0
        out.append(forward_logits(trainer.model, trainer.ps, tokens))
    return out


def test_import_writes_release_checkpoints_our_model_loads(trained, tmp_path):
    """HF -> release checkpoint (dist, written offline; torch, one file per tp x pp rank) -> same logits."""
    root, saved = trained
    export_hf(root, str(tmp_path / "hf"))
    hf = _hf_logits(str(tmp_path / "hf"), saved["tokens"])
    roots = [str(tmp_path / "dist"), str(tmp_path / "torch")]
    import_hf(str(tmp_path / "hf"), roots[0], tp=2, pp=2)
    import_hf(str(tmp_path / "hf"), roots[1], tp=2, pp=2, format="torch")
    assert (tmp_path / "torch" / "release" / "mp_rank_01_001" / "model_optim_rng.pt").exists()
    assert (tmp_path / "dist" / "latest_checkpointed_iteration.txt").read_text() == "release"
    last_stage = launch(_load_release, 4, roots, saved["tokens"])[2]
    for logits in last_stage:
        assert (logits - hf).abs().max() <= 1e-4


def test_import_rejects_a_layout_that_does_not_divide(trained, tmp_path):
    import shardpoint as sp

    root, _ = trained
    export_hf(root, str(tmp_path / "hf"))
    with pytest.raises(sp.TopologyMismatchError, match="num_attention_heads"):
        import_hf(str(tmp_path / "hf"), str(tmp_path / "dst"), tp=3, pp=1)
    assert not (tmp_path / "dst").exists()
