"""Interrupted and resumed training ends with the weights of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import tfscale
from tfscale.testing import relative_difference
from tfscale.training import CheckpointConfig
from tfscale.training.checkpoint import saved_position

from .helpers import DATA, strategy_for, tiny_model

pytestmark = pytest.mark.tf

EPOCHS = 4


class _StopAfterEpoch(keras.callbacks.Callback):
    def __init__(self, last: int) -> None:
        super().__init__()
        self.last = last

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.last:
            self.model.stop_training = True


class _Crash(keras.callbacks.Callback):
    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.epoch, self.batch, self.current = epoch, batch, -1

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if (self.current, batch) == (self.epoch, self.batch):
            raise RuntimeError("simulated crash")


_UNINTERRUPTED: list[Any] = []
SEED = 11


def _uninterrupted(folder: Path) -> Any:
    """The same run in one go: the same seed, so the same per-epoch orders of the arrays
    (kept in the checkpoint, which is what makes a resumed epoch see the same batches)."""
    if not _UNINTERRUPTED:
        keras.utils.set_random_seed(SEED)
        x, y = DATA
        strategy = strategy_for(2)
        model = tiny_model(strategy, "adam", lr=0.01)
        tfscale.fit(
            model,
            x,
            y,
            batch_size=32,
            epochs=EPOCHS,
            checkpoint_dir=str(folder),
            strategy=strategy,
            verbose=0,
        )
        _UNINTERRUPTED.append(model.get_weights())
    return _UNINTERRUPTED[0]


@pytest.mark.full(
    "tests/training/test_checkpoint.py::"
    "test_crash_mid_epoch_resumes_from_the_last_step_checkpoint[mid-run]",
)
def test_stopped_after_epoch_2_of_4_and_resumed_equals_uninterrupted(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    x, y = DATA
    strategy = strategy_for(2)
    first = tiny_model(strategy, "adam", lr=0.01)
    keras.utils.set_random_seed(SEED)
    tfscale.fit(
        first,
        x,
        y,
        batch_size=32,
        epochs=EPOCHS,
        checkpoint_dir=str(tmp_path),
        callbacks=[_StopAfterEpoch(1)],
        strategy=strategy,
        verbose=0,
    )
    resumed = tiny_model(strategy, "adam", lr=0.01)  # a fresh process would build this
    history = tfscale.fit(
        resumed,
        x,
        y,
        batch_size=32,
        epochs=EPOCHS,
        checkpoint_dir=str(tmp_path),
        strategy=strategy,
        verbose=0,
    )
    assert history.epoch == [2, 3]
    assert (
        relative_difference(
            resumed.get_weights(), _uninterrupted(tmp_path_factory.mktemp("uninterrupted"))
        )
        <= 1e-5
    )


@pytest.mark.parametrize(
    "crash_epoch",
    [
        1,  # update 14 of 4 epochs; last checkpoint at 12
        # The resumed fit runs one epoch, the last: it must still batch the arrays in that
        # epoch's order of the run it continues, not in Keras's own shuffle (found by the
        # restart loop of the sbatch script on a real Slurm cluster, test_slurm_cluster.py).
        EPOCHS - 1,
    ],
    ids=["mid-run", "last-epoch"],
)
def test_crash_mid_epoch_resumes_from_the_last_step_checkpoint(
    crash_epoch: int,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tensorflow as tf

    from tfscale.cluster.notes import REPORT_ENV, read_checkpoint_note
    from tfscale.launch.elastic import Drop, elastic_line

    x, y = DATA
    strategy = strategy_for(2)
    config = CheckpointConfig(str(tmp_path), every_steps=3)
    # As under tfscale launch: the chief notes each checkpoint in the launcher's report folder.
    report = tmp_path_factory.mktemp("report")
    monkeypatch.setenv(REPORT_ENV, str(report))
    keras.utils.set_random_seed(SEED)
    with pytest.raises(RuntimeError, match="simulated crash"):
        tfscale.fit(
            tiny_model(strategy, "adam", lr=0.01),
            x,
            y,
            batch_size=32,
            epochs=EPOCHS,
            checkpoint_dir=config,
            callbacks=[_Crash(epoch=crash_epoch, batch=5)],
            strategy=strategy,
            verbose=0,
        )
    # The note the launcher's last line reads is the checkpoint the resumed fit starts from.
    note = read_checkpoint_note(str(report))
    position = saved_position(str(tmp_path))
    assert note is not None and position is not None
    assert note.path == tf.train.latest_checkpoint(str(tmp_path))
    assert (note.directory, note.epoch, note.batches) == (
        str(tmp_path),
        position.epoch,
        position.batches,
    )
    assert note.updates == int(note.path.rsplit("-", 1)[1])
    below = Drop(slot=2, label="worker 2", why="exit status 1", starts=1, workers_left=1)
    line = elastic_line(
        workers=2, finished=None, dropped=[], below=below, min_workers=2, checkpoint=note
    )
    assert line is not None and note.path in line
    monkeypatch.delenv(REPORT_ENV)
    resumed = tiny_model(strategy, "adam", lr=0.01)
    history = tfscale.fit(
        resumed,
        x,
        y,
        batch_size=32,
        epochs=EPOCHS,
        checkpoint_dir=config,
        strategy=strategy,
        verbose=0,
    )
    assert history.epoch == list(range(crash_epoch, EPOCHS))
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * len(x) // 32
    assert (
        relative_difference(
            resumed.get_weights(), _uninterrupted(tmp_path_factory.mktemp("uninterrupted"))
        )
        <= 1e-5
    )


@pytest.mark.full(
    "tests/training/test_checkpoint.py::"
    "test_crash_mid_epoch_resumes_from_the_last_step_checkpoint[mid-run]",
    "tests/training/test_parity_examples.py::"
    "test_cases_across_two_worker_processes_match_one_device[paths_across_workers]",
)
def test_resume_mid_epoch_with_an_input_of_unknown_length(tmp_path: Path) -> None:
    """A dataset whose length is unknown (a multi-worker dataset_fn's is hidden the same way):
    Keras learns an epoch's length from the first epoch that ends, and the resumed epoch,
    its first batches skipped, is short; the later epochs must still run every batch."""
    import tensorflow as tf

    x, y = DATA

    def data() -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(32).filter(lambda *_: True)

    def fit(folder: Path, callbacks: list[Any]) -> Any:
        model = tiny_model(strategy_for(2), "adam", lr=0.01)
        config = CheckpointConfig(str(folder), every_steps=3)
        tfscale.fit(model, data(), epochs=EPOCHS, checkpoint_dir=config, callbacks=callbacks,
                    strategy=strategy_for(2), verbose=0)  # fmt: skip
        return model

    uninterrupted = fit(tmp_path / "one", [])
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(tmp_path / "two", [_Crash(epoch=1, batch=5)])  # update 14; checkpoint at 12
    resumed = fit(tmp_path / "two", [])
    steps = EPOCHS * len(x) // 32
    assert int(uninterrupted.optimizer.iterations.numpy()) == steps
    assert int(resumed.optimizer.iterations.numpy()) == steps
    assert relative_difference(resumed.get_weights(), uninterrupted.get_weights()) <= 1e-5


class _StateAtStart(keras.callbacks.Callback):
    """What the model holds when training begins (after the checkpoint's restore)."""

    def on_train_begin(self, logs: Any = None) -> None:
        self.iterations = int(self.model.optimizer.iterations.numpy())
        self.optimizer = [v.numpy().copy() for v in self.model.optimizer.variables]


def test_checkpoint_of_4_replicas_resumes_on_2_at_the_exact_batch(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An elastic job's resume on fewer workers (tests/launch/test_elastic_jobs.py runs the
    processes): the position counts global batches, and the global batch is the same on any
    number of replicas, so 2 replicas go on where 4 stopped: the data position and the
    shuffle seed of the checkpoint, its optimizer state and ``optimizer.iterations``."""
    x, y = DATA
    config = CheckpointConfig(str(tmp_path), every_steps=3)  # saves at 3, 6, 8, 11, ...

    def fit(replicas: int, callbacks: list[Any], folder: Any = config, seed: int = SEED) -> Any:
        model = tiny_model(strategy_for(replicas), "adam", lr=0.01)
        keras.utils.set_random_seed(seed)
        tfscale.fit(model, x, y, batch_size=32, epochs=EPOCHS, checkpoint_dir=folder,
                    callbacks=callbacks, strategy=strategy_for(replicas), verbose=0)  # fmt: skip
        return model

    uninterrupted = fit(4, [], str(tmp_path_factory.mktemp("four")))
    crashed = tiny_model(strategy_for(4), "adam", lr=0.01)
    with pytest.raises(RuntimeError, match="simulated crash"):
        keras.utils.set_random_seed(SEED)
        tfscale.fit(crashed, x, y, batch_size=32, epochs=EPOCHS, checkpoint_dir=config,
                    callbacks=[_Crash(epoch=1, batch=2)],  # after update 11, just saved
                    strategy=strategy_for(4), verbose=0)  # fmt: skip
    saved = saved_position(str(tmp_path))
    assert saved is not None and (saved.epoch, saved.batches) == (1, 3)
    saved_optimizer = [v.numpy() for v in crashed.optimizer.variables]
    assert int(crashed.optimizer.iterations.numpy()) == 11
    start = _StateAtStart()
    resumed = fit(2, [start], seed=SEED + 1)  # a new process would draw another data seed
    assert start.iterations == 11
    assert len(start.optimizer) == len(saved_optimizer)
    for restored, expected in zip(start.optimizer, saved_optimizer, strict=True):
        np.testing.assert_array_equal(restored, expected)
    after = saved_position(str(tmp_path))
    assert after is not None and after.data_seed == saved.data_seed  # the same epoch orders
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * len(x) // 32
    assert relative_difference(resumed.get_weights(), uninterrupted.get_weights()) <= 1e-5
