"""Checkpoint and resume for ``tfscale.fit``: weights, optimizer, position in the data.

Keras's ``BackupAndRestore`` resumes at the start of the epoch it saved in; a run stopped
mid-epoch then trains that epoch's first batches twice. :class:`CheckpointCallback` also saves
how many batches of the epoch were done and, on resume, drops them before the first step
(``StepFunction.skip``), so a resumed run trains on exactly the batches the uninterrupted run
would have, when the input gives the same batches in the same order (a dataset, arrays with
``shuffle=False``, or arrays with ``shuffle=True`` and ``checkpoint_dir``, which ``fit``
shuffles with a permutation fixed per epoch: ``training/data.py``).

Written with ``tf.train.CheckpointManager``, whose index file is replaced only after the data
files are complete, so a crash mid-write leaves the previous checkpoint as the latest. Under
MultiWorkerMirroredStrategy every worker takes part in saving (reading distributed variables
can need collectives); only the chief writes to ``directory``, the others to a scratch folder
that is removed (the pattern of TensorFlow's multi-worker guide). Saves happen only between
optimizer updates (never with gradients half accumulated).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from tfscale.cluster.notes import REPORT_ENV, CheckpointNote, write_checkpoint_note
from tfscale.errors import TrainingError, explain
from tfscale.interop import internals
from tfscale.training.adopt import all_variables
from tfscale.training.memory.oom import note_checkpoints
from tfscale.training.prepare import prepared

__all__ = ["CheckpointCallback", "CheckpointConfig", "SavedPosition", "saved_position"]


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint; ``fit(checkpoint_dir=...)`` accepts one.

    Attributes:
        directory: Folder of the checkpoints (written by the chief).
        every_steps: Also save every this many optimizer updates (besides every epoch);
            None saves at epoch ends only.
        max_to_keep: Checkpoints kept on disk.
    """

    directory: str
    every_steps: int | None = 100
    max_to_keep: int = 2


@dataclass(frozen=True)
class SavedPosition:
    """Where the latest checkpoint of a folder stands, read without restoring it.

    Attributes:
        epoch: The epoch to resume at.
        batches: Batches of that epoch already trained.
        data_seed: The seed of the arrays' per-epoch order (None if not saved).
    """

    epoch: int
    batches: int
    data_seed: int | None


def _read_int(reader: Any, name: str) -> int | None:
    key = f"{name}/.ATTRIBUTES/VARIABLE_VALUE"
    return int(reader.get_tensor(key)) if reader.has_tensor(key) else None


def saved_position(directory: str) -> SavedPosition | None:
    """The position of ``directory``'s latest checkpoint, or None when it has none.

    ``fit`` needs it before Keras starts (to order the arrays from the resumed epoch on);
    the restore itself happens in :meth:`CheckpointCallback.on_train_begin`.
    """
    latest = tf.train.latest_checkpoint(directory)
    if latest is None:
        return None
    try:
        reader = tf.train.load_checkpoint(latest)
    except (tf.errors.OpError, ValueError):
        return None  # on_train_begin's restore explains what is wrong with it
    epoch, batches = _read_int(reader, "epoch"), _read_int(reader, "batches")
    if epoch is None or batches is None:
        return None
    return SavedPosition(epoch, batches, _read_int(reader, "data_seed"))


def _task_id(strategy: tf.distribute.Strategy) -> int:
    resolver = getattr(strategy, "cluster_resolver", None)
    return int(getattr(resolver, "task_id", 0) or 0)


class CheckpointCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Saves every epoch and every ``every_steps`` updates; restores and skips on resume.

    Args:
        config: Where and how often.
        strategy: The training strategy (decides who writes where).
        data_seed: The seed of the arrays' per-epoch order (``data.EpochOrder``), saved so
            that a resumed run orders its epochs as the run it continues.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        strategy: tf.distribute.Strategy,
        data_seed: int | None = None,
    ) -> None:
        super().__init__()
        self._data_seed = data_seed
        self.config = config
        self.strategy = strategy
        self._chief = bool(strategy.extended.should_checkpoint)
        self._checkpoint: tf.train.Checkpoint | None = None
        self._manager: tf.train.CheckpointManager | None = None
        self._scratch: str | None = None
        self._epoch: tf.Variable | None = None
        self._batches: tf.Variable | None = None
        self._last_saved_update = 0
        self._seen = 0  # batches of the current epoch, the skipped ones included
        self._skip_first_epoch = 0
        self._skip_first_epoch_done = 0
        self._epoch_now = 0

    # -- set-up --------------------------------------------------------------------------
    def _build(self) -> None:
        model = self.model
        with self.strategy.scope():
            self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            self._batches = tf.Variable(0, dtype=tf.int64, trainable=False, name="batches")
        state = prepared(model)
        extra: dict[str, Any] = {}
        if state is not None:
            for index, update in enumerate(state.updates()):
                extra[f"update_{index}"] = update.checkpointed()
        if self._data_seed is not None:
            extra["data_seed"] = tf.Variable(self._data_seed, dtype=tf.int64, trainable=False)
        self._checkpoint = tf.train.Checkpoint(
            model=model,
            optimizer=model.optimizer,
            epoch=self._epoch,
            batches=self._batches,
            **extra,
        )
        directory = self.config.directory
        if not self._chief:
            directory = os.path.join(self.config.directory, f".worker-{_task_id(self.strategy)}")
            self._scratch = directory
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, directory, max_to_keep=self.config.max_to_keep
        )

    def _updates(self) -> int:
        return int(self.model.optimizer.iterations.numpy())

    def _between_updates(self) -> bool:
        state = prepared(self.model)
        return state is None or all(u.pending_micro_batches() == 0 for u in state.updates())

    def _save(self, epoch: int, batches: int) -> None:
        assert self._manager is not None and self._epoch is not None and self._batches is not None
        self._epoch.assign(epoch)
        self._batches.assign(batches)
        updates = self._updates()
        path = self._manager.save(checkpoint_number=updates)
        self._last_saved_update = updates
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        report = os.environ.get(REPORT_ENV)
        if self._chief and report and os.path.isdir(report):
            # Under tfscale launch: the launcher's last line says where to resume from.
            note = CheckpointNote(self.config.directory, path, epoch, batches, updates)
            write_checkpoint_note(report, note)

    def _restore(self, latest: str) -> None:
        """Restores ``latest``, refusing a checkpoint of another model before any training."""
        assert self._checkpoint is not None
        # A failed restore may have assigned part of the model (or its optimizer) already:
        # their values are put back, so the refused run leaves the model as it was.
        variables = all_variables(self.model)
        saved = [v.numpy() for v in variables]
        try:
            # The model alone first: every weight must be in the checkpoint, with its shape.
            status = tf.train.Checkpoint(model=self.model).restore(latest)
            status.expect_partial()  # the rest of the checkpoint is read just below
            status.assert_existing_objects_matched()
            self._checkpoint.restore(latest).expect_partial()
        except (AssertionError, ValueError, tf.errors.OpError) as error:
            for variable, value in zip(variables, saved, strict=True):
                variable.assign(value)
            first = str(error).strip().splitlines()[0][:300]
            raise TrainingError(
                explain(
                    f"checkpoint_dir holds a checkpoint that does not fit model "
                    f"{self.model.name!r}, so training cannot resume from it.",
                    received=f"{latest}: {first}",
                    allowed="a folder with no checkpoint, or checkpoints of this model",
                    fix="give this model its own checkpoint_dir (or delete the old checkpoints "
                    "if they are not needed)",
                )
            ) from None

    # -- Keras hooks ---------------------------------------------------------------------
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._build()
        note_checkpoints(self.model, self.config.directory)  # named by an out-of-memory error
        latest = tf.train.latest_checkpoint(self.config.directory)
        if latest is None:
            return
        assert self._checkpoint is not None
        assert self._epoch is not None and self._batches is not None
        self._restore(latest)
        epoch, batches = int(self._epoch.numpy()), int(self._batches.numpy())
        internals.set_initial_epoch(self.model, epoch)
        self._skip_first_epoch = batches
        self._last_saved_update = self._updates()
        function = self.model.train_function
        if batches and function is not None and hasattr(function, "skip"):
            function.skip = batches

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch_now = epoch
        self._seen = self._skip_first_epoch_done = self._skip_first_epoch
        self._skip_first_epoch = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # Keras passes the index of the last batch of this call of the train function.
        done = batch + 1
        if self.params.get("steps"):
            done = min(done, int(self.params["steps"]))
        self._seen = self._skip_first_epoch_done + done
        every = self.config.every_steps
        if not every or not self._between_updates():
            return
        if self._updates() - self._last_saved_update >= every:
            self._save(self._epoch_now, self._seen)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._save(epoch + 1, 0)
        state = prepared(self.model)
        if self._skip_first_epoch_done and state is not None and state.epoch_iterator:
            # The resumed epoch skipped its first batches: Keras must not take its length
            # for every epoch's when the input's length is unknown (a multi-worker
            # dataset_fn): the next epoch would stop short.
            iterator = state.epoch_iterator()
            if iterator is not None:
                internals.forget_learned_epoch_length(iterator)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        internals.set_initial_epoch(self.model, None)
