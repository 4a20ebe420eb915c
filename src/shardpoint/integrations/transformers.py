"""The Hugging Face ``Trainer`` with shardpoint checkpoints: :class:`ShardpointTrainer`.

``ShardpointTrainer`` is ``transformers.Trainer`` with one more keyword,
``checkpointer_options`` (passed to :class:`shardpoint.Checkpointer`: ``async_save``,
``upload_to``, ``keep_best``, ...). What the Trainer keeps in ``checkpoint-N/`` goes
through one ``Checkpointer.save``: the model, the optimizer, the LR scheduler, the grad
scaler, every rank's random streams, and ``trainer_state.json`` as a file committed with
them. A checkpoint appears under its final name only once complete (shardpoint's commit
protocol), ``get_last_checkpoint`` still finds it, and another layout can resume it
(saved by two FSDP2 ranks, resumed by one).

Where it hooks in (transformers 5.x), and why there:

* ``_save_checkpoint`` is replaced whole: a ``TrainerCallback.on_save`` runs only after
  the stock save has written its files. Retention is the Trainer's own rule
  (``save_total_limit``, the newest and ``state.best_model_checkpoint`` protected: see
  :mod:`shardpoint.integrations.trainer_retention`), applied by the Checkpointer after each
  commit, so transformers' ``rotate_checkpoints`` (a plain ``rmtree``) is never called.
* ``_load_optimizer_and_scheduler`` is the first step of a resume at which the model,
  the optimizer and the scheduler all exist (after ``accelerator.prepare``): the one
  load happens there; ``_load_from_checkpoint`` and ``_load_scaler`` have nothing left to do.
* ``_load_rng_state`` runs after the Trainer has skipped the batches already trained
  (skipping draws random numbers): it puts the streams back as the load found them.
* ``_load_best_model`` loads the model alone from the best checkpoint.
* ``train`` checks ``trainer_state.json`` against its checksum before the Trainer
  reads it, and closes the Checkpointer at the end (committing a pending ``async_save``).

Tensors are loaded in place, into the model's own tensors. A whole (unsharded) tensor saved
at another size (a buffer whose size is data, a module that rebuilds itself in
``_load_from_state_dict``) is read at its saved size and handed to the model's own
``load_state_dict``, as the stock Trainer loads it (:mod:`shardpoint.state.resizing`);
a module that refuses it gives ``ShapeMismatchError``, never a damage error.

A ``checkpoint-N`` without ``shardpoint.json`` (written by the stock ``Trainer``) is
handed to the stock code, so a run switched to ``ShardpointTrainer`` resumes from its
last stock checkpoint.

Differences from the stock ``Trainer``, each for a reason:

* checkpoints hold no ``model.safetensors``: the weights are in the sharded files;
  ``trainer.save_model()`` (unchanged) writes the Hugging Face model;
* at the end of training the newest checkpoint is not deleted when ``save_total_limit=1``
  and another one is the best: it is the one the tracker names, the resume point;
* a model sharded at load time (``from_pretrained(distributed_config=...)``:
  transformers' own FSDP2 or tensor parallelism) can be checkpointed and resumed,
  which the stock Trainer refuses;
* DeepSpeed is not supported (its engine keeps its state in its own files), nor are
  checkpoints pushed to the Hub (``save_model`` still pushes the model);
* ``output_dir`` holds two more entries beside the ``checkpoint-N`` folders:
  ``.shardpoint.lock`` (hidden; the writer lock that stops a second job from writing
  the same directory) and ``latest_checkpoint.txt`` (the tracker: the commit point of
  a save, and what a resume trusts over listing folders). They stay in ``output_dir``
  rather than in a checkpoint folder because both are about the directory, and a
  checkpoint folder is deleted by retention. Neither matches ``checkpoint-*``, so
  ``get_last_checkpoint``, ``sort_checkpoints`` and ``rotate_checkpoints`` ignore them.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from shardpoint.integrations import missing_framework

try:
    from transformers import Trainer
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import SaveStrategy, get_last_checkpoint
except ModuleNotFoundError as exc:
    raise missing_framework(exc, "transformers", "transformers") from exc

from shardpoint.catalog.layout import get_layout
from shardpoint.checkpointer import Checkpointer
from shardpoint.integrations import _hf_common as common
from shardpoint.integrations.trainer_retention import TrainerRetention
from shardpoint.parallel.topology import Topology
from shardpoint.state import rng
from shardpoint.state.train_state import TrainState

__all__ = ["TRAINER_STATE_NAME", "ShardpointTrainer"]

log = logging.getLogger(__name__)

LAYOUT = get_layout("hf")
TRAINER_STATE_NAME = "trainer_state.json"  # what transformers reads from checkpoint-N/ itself


class ShardpointTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints are shardpoint checkpoints.

    Args:
        args, kwargs: what ``transformers.Trainer`` takes, positionally and by name.
        checkpointer_options: keyword arguments of :class:`shardpoint.Checkpointer`
            (``async_save``, ``upload_to``, ``keep_best``, ``keep_every``, ``config``, ...).
            Without a ``keep_*`` option, retention is the Trainer's own (``save_total_limit``,
            the newest and the best protected); with one, shardpoint's policies decide alone.
            ``topology`` comes from the job; ``layout`` and the save intervals are the
            Trainer's (``save_steps``).

    Example:
        >>> trainer = ShardpointTrainer(model=model, args=args, train_dataset=ds,
        ...                             checkpointer_options={"async_save": True})
        >>> trainer.train(resume_from_checkpoint=True)   # or a checkpoint-N path
    """

    def __init__(self, *args: Any, checkpointer_options: Mapping[str, Any] | None = None, **kwargs: Any):
        self.checkpointer_options = common.checked_options(checkpointer_options, "ShardpointTrainer")
        self._checkpointers: dict[str, Checkpointer] = {}
        self._rng_after_load: dict[str, Any] | None = None
        self._retention = TrainerRetention(limit=None)  # read by every Checkpointer's retention
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        model = kwargs.get("model", args[0] if args else None)
        # The stock Trainer refuses to checkpoint a model sharded at load time, since its own
        # optimizer file cannot hold sharded state; shardpoint's can. It checks in __init__ only.
        lifted = (  # the args whose save_only_model is set for the check, then put back
            training_args
            if getattr(model, "is_distributed_loading_by_transformers", False)
            and training_args is not None
            and not training_args.save_only_model
            else None
        )
        if lifted is not None:
            lifted.save_only_model = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            if lifted is not None:
                lifted.save_only_model = False
        if self.is_deepspeed_enabled:
            raise ValueError(
                "ShardpointTrainer does not checkpoint DeepSpeed engines (they keep their state in DeepSpeed's own "
                "files); use transformers.Trainer, or FSDP2 / DDP with ShardpointTrainer"
            )

    # ------------------------------------------------------------------ train
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``; a shardpoint checkpoint to resume from is checked before transformers reads it.

        Raises:
            CorruptCheckpointError: the checkpoint's ``trainer_state.json`` or data
                files changed since the save (each damaged file is named).
        """
        output_dir = self.args.output_dir
        if resume_from_checkpoint is True and output_dir is not None and os.path.isdir(output_dir):
            resume_from_checkpoint = get_last_checkpoint(output_dir) or True  # True: transformers says why
        if isinstance(resume_from_checkpoint, (str, os.PathLike)) and common.is_shardpoint_checkpoint(
            resume_from_checkpoint
        ):
            common.verify_recorded(os.fspath(resume_from_checkpoint), [TRAINER_STATE_NAME])
        output = super().train(
            resume_from_checkpoint=resume_from_checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kwargs,
        )
        # after a failure the ranks may not all be here: a pending async save then stays
        # uncommitted (invisible, never half-loaded) instead of waiting on absent ranks
        self.close_checkpointers()
        return output

    def close_checkpointers(self) -> None:
        """Commit a pending ``async_save`` and release the save directories (every rank; ``train`` does it)."""
        checkpointers, self._checkpointers = self._checkpointers, {}
        for ckpt in checkpointers.values():
            ckpt.close()

    # ----------------------------------------------------------------- saving
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """One ``Checkpointer.save`` of everything the stock ``_save_checkpoint`` writes (every rank calls it)."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        self._update_best_checkpoint(run_dir, step)
        self._retention.limit = self.args.save_total_limit
        self._retention.best = self._best_step(run_dir)
        files = None
        if self.args.process_index == 0:
            self._export_callback_states()
            files = {TRAINER_STATE_NAME: self._trainer_state_json()}
        state = self._train_state(with_optimizer=not self.args.save_only_model)
        self._checkpointer(run_dir).save(step, state, metrics=self._metrics_at(step), files=files)

    def _rotate_checkpoints(self, use_mtime: bool = False, output_dir: str | None = None) -> None:
        """Nothing: retention is the Checkpointer's (:class:`TrainerRetention`), applied after each commit."""

    def _update_best_checkpoint(self, run_dir: str, step: int) -> None:
        """``state.best_model_checkpoint`` as the stock save sets it, before ``trainer_state.json`` is written."""
        best = self.state.best_global_step
        strategies = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        if self.args.save_strategy in strategies and best:
            directory = os.path.join(run_dir, LAYOUT.dir_name(best))
            if best == step or os.path.isdir(directory):
                self.state.best_model_checkpoint = directory

    def _best_step(self, run_dir: str) -> int | None:
        """The step of ``state.best_model_checkpoint`` when it is a checkpoint of ``run_dir`` (the Trainer's record)."""
        best = self.state.best_model_checkpoint
        if not best or os.path.dirname(os.path.abspath(best)) != os.path.abspath(run_dir):
            return None
        return LAYOUT.parse_dir_name(os.path.basename(best))

    def _export_callback_states(self) -> None:
        """Stateful callbacks and ``TrainerControl`` into ``state.stateful_callbacks``, as the stock save does."""
        # transformers annotates a list, but TrainerState.__post_init__ makes it a dict by class name
        exported: dict[str, Any] = self.state.stateful_callbacks  # type: ignore[assignment]
        for cb in [*self.callback_handler.callbacks, self.control]:
            if not isinstance(cb, ExportableState):
                continue
            name = cb.__class__.__name__
            if isinstance(exported[name], list):
                exported[name].append(cb.state())
            else:
                exported[name] = cb.state()

    def _trainer_state_json(self) -> bytes:
        """``trainer_state.json`` exactly as ``TrainerState.save_to_json`` writes it."""
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, TRAINER_STATE_NAME)
            self.state.save_to_json(path)
            with open(path, "rb") as f:
                return f.read()

    def _metrics_at(self, step: int) -> dict[str, float]:
        """The best-model metric evaluated at ``step``, recorded in the marker (``inspect``, a user's ``keep_best``).

        Which checkpoint is best is not decided from it: that is ``state.best_model_checkpoint``.
        """
        key = self._best_metric_key()
        if key is None:
            return {}
        for entry in reversed(self.state.log_history):
            if entry.get("step") == step and isinstance(entry.get(key), (int, float)):
                return {key: float(entry[key])}
        return {}

    def _best_metric_key(self) -> str | None:
        metric = self.args.metric_for_best_model
        if metric is None:
            return None
        return metric if metric.startswith("eval_") else f"eval_{metric}"

    # ---------------------------------------------------------------- loading
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Stock checkpoints only: a shardpoint one is loaded whole by ``_load_optimizer_and_scheduler``."""
        if not common.is_shardpoint_checkpoint(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not common.is_shardpoint_checkpoint(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Load model, optimizer, scheduler, scaler and RNG from a shardpoint ``checkpoint`` (every rank).

        The random streams are set by the load and put back again by ``_load_rng_state``,
        after the Trainer's batch skipping has used them; they are restored only at the
        layout they were saved at (another layout has other ranks).
        """
        if not common.is_shardpoint_checkpoint(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        with_optimizer = not self.args.save_only_model
        state = self._train_state(with_optimizer=with_optimizer)
        result, topology = self._load(checkpoint, state, load_optimizer=with_optimizer)
        same_layout = result.metadata.topology == topology.describe()
        self._rng_after_load = rng.capture() if same_layout else None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not common.is_shardpoint_checkpoint(checkpoint):
            super()._load_rng_state(checkpoint)
        elif self._rng_after_load is None:
            log.info(
                "%s was saved at another layout: random streams not restored, reproducibility not guaranteed",
                checkpoint,
            )
        else:
            rng.restore(self._rng_after_load)

    def _load_best_model(self) -> None:
        # retention deletes on rank 0 in the background: once it is done, every rank sees the same directories
        for ckpt in self._checkpointers.values():
            ckpt.wait()
        self.accelerator.wait_for_everyone()
        best = self.state.best_model_checkpoint
        if not common.is_shardpoint_checkpoint(best):
            super()._load_best_model()
            return
        log.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        self._load(best, TrainState(model=self.model), load_optimizer=False, load_rng=False)

    def _finalize_training(self, trial: Any, num_train_samples: int, start_time: float) -> Any:
        """The stock end of training, without its deletion of every checkpoint but the best one.

        With ``save_total_limit=1`` transformers deletes the newest checkpoint at the end
        when it is not the best; here that is the checkpoint the tracker names.
        """
        args = self.args
        limit = args.save_total_limit
        if limit == 1 and self.state.best_model_checkpoint is not None:
            args.save_total_limit = None
        try:
            return super()._finalize_training(trial, num_train_samples, start_time)
        finally:
            args.save_total_limit = limit

    def _load(self, checkpoint: str, state: TrainState, **load_options: Any) -> tuple[Any, Topology]:
        """Load ``checkpoint`` into ``state`` through the Checkpointer of its save directory."""
        root, iteration = common.locate(checkpoint, LAYOUT)
        known = self._checkpointers.get(os.path.abspath(root))
        ckpt = known or Checkpointer(root, layout="hf", topology=self._topology(), **self._load_options())
        try:
            return ckpt.load(state, iteration=iteration, **load_options), ckpt.topology
        finally:
            if known is None:
                ckpt.close()

    # ---------------------------------------------------------------- helpers
    def _checkpointer(self, run_dir: str) -> Checkpointer:
        """The Checkpointer of ``run_dir`` (one per hyperparameter-search trial), created on first use (collective)."""
        root = os.path.abspath(run_dir)
        if root not in self._checkpointers:
            self._checkpointers[root] = Checkpointer(
                root, layout="hf", topology=self._topology(), **self._save_options()
            )
        return self._checkpointers[root]

    def _save_options(self) -> dict[str, Any]:
        """``checkpointer_options``, with the Trainer's own retention rule unless they choose one.

        Given any ``keep_*`` option, shardpoint's policies decide alone; otherwise
        :class:`TrainerRetention` applies ``save_total_limit`` as ``rotate_checkpoints`` does.
        """
        options = {k: v for k, v in self.checkpointer_options.items() if k != "topology"}
        if not any(k in options for k in ("keep_last", "keep_every", "keep_best", "keep")):
            options["keep"] = [self._retention]
        return options

    def _load_options(self) -> dict[str, Any]:
        """What a Checkpointer opened only to load needs of the options (no retention, no uploads)."""
        keep = ("config", "allow_config_mismatch", "verify", "thread_count")
        return {k: v for k, v in self.checkpointer_options.items() if k in keep}

    def _topology(self) -> Topology:
        """The job's layout: transformers' own parallel sizes for a model sharded at load time, else Accelerate's."""
        if "topology" in self.checkpointer_options:
            return self.checkpointer_options["topology"]
        config = getattr(getattr(self.model, "config", None), "distributed_config", None)
        if self.is_distributed_loading_by_transformers and config is not None:
            # transformers' mesh is (pp, dp_replicate, fsdp, tp): tp fastest, then data, then pp, as in Megatron
            tp, pp = config.tp_size or 1, config.pp_size or 1
            return Topology(tp, pp, self.args.world_size // (tp * pp))
        return common.accelerator_topology(self.accelerator)

    def _train_state(self, *, with_optimizer: bool) -> TrainState:
        """What a checkpoint holds: the model always; optimizer, scheduler and scaler unless ``save_only_model``."""
        state = TrainState(
            model=self.model,
            extra={"global_step": self.state.global_step, "flops": float(self.state.total_flos)},
        )
        if with_optimizer:
            state.optimizer = common.unwrap_optimizer(self.optimizer)
            state.scheduler = self.lr_scheduler
            state.grad_scaler = getattr(self.accelerator, "scaler", None)
        return state
