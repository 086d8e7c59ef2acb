"""Cases drawn from Keras's callback tests, ``keras/src/callbacks/*_test.py``."""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from .common import compiled, mlp, regression, regressor
from .registry import Case, Run, Train, same_history, same_iterations, same_weights

CALLBACKS = "keras/src/callbacks"
X, Y = regression()
XV, YV = regression(32, seed=9)


def _find(run: Run, kind: type) -> Any:
    return next(c for c in run.fit["callbacks"] if isinstance(c, kind))


def _arrays(*callbacks: Any, **extra: Any) -> dict[str, Any]:
    return {"x": X, "y": Y, "batch_size": 16, "epochs": 3, "callbacks": list(callbacks), **extra}


def _validated(*callbacks: Any, **extra: Any) -> dict[str, Any]:
    return _arrays(*callbacks, validation_data=(XV, YV), **extra)


def _stopped_at(epochs: int) -> Any:
    def check(expected: Run, got: Run) -> None:
        lengths = (len(expected.history.epoch), len(got.history.epoch))
        assert lengths == (epochs, epochs), lengths
        assert got.model.stop_training and expected.model.stop_training

    return check


def _exact(*more: Any) -> list[Any]:
    return [same_weights(), same_history(), same_iterations, *more]


# -- EarlyStopping --------------------------------------------------------------------------------
def _restored_best(expected: Run, got: Run) -> None:
    stopper = _find(got, keras.callbacks.EarlyStopping)
    assert stopper.best_weights is not None and stopper.best_epoch == (
        _find(expected, keras.callbacks.EarlyStopping).best_epoch
    )


# -- ReduceLROnPlateau and schedules ------------------------------------------------------------
def _schedule(epoch: int, lr: float) -> float:
    return lr * 0.5 if epoch > 0 else lr


# -- ModelCheckpoint, CSVLogger, TensorBoard: files --------------------------------------------
class Folder:
    """A fresh temporary folder per side of a case (removed by the interpreter's exit)."""

    def __init__(self) -> None:
        self._handle = tempfile.TemporaryDirectory(prefix="tfscale-parity-")
        self.path = Path(self._handle.name)

    def cleanup(self) -> None:
        self._handle.cleanup()


def _checkpoint_best() -> dict[str, Any]:
    folder = Folder()
    path = str(folder.path / "best.weights.h5")
    saver = keras.callbacks.ModelCheckpoint(
        path, monitor="val_loss", save_best_only=True, save_weights_only=True
    )
    saver.folder = folder  # type: ignore[attr-defined]
    return _validated(saver)


def _checkpoint_every_epoch() -> dict[str, Any]:
    folder = Folder()
    path = str(folder.path / "e{epoch:02d}-{loss:.3f}.keras")
    saver = keras.callbacks.ModelCheckpoint(path)
    saver.folder = folder  # type: ignore[attr-defined]
    return _arrays(saver)


def _saved_files(run: Run) -> list[Path]:
    saver = _find(run, keras.callbacks.ModelCheckpoint)
    return sorted(saver.folder.path.iterdir())


def _same_best_checkpoint(expected: Run, got: Run) -> None:
    weights = []
    for run in (expected, got):
        (saved,) = _saved_files(run)
        with tf.device("/device:CPU:0"):
            model = regressor()
            model.load_weights(str(saved))
        weights.append(model.get_weights())
        _find(run, keras.callbacks.ModelCheckpoint).folder.cleanup()
    same_weights()(Run(_Holder(weights[0]), None, {}, []), Run(_Holder(weights[1]), None, {}, []))


def _same_epoch_checkpoints(expected: Run, got: Run) -> None:
    names = [[p.name for p in _saved_files(run)] for run in (expected, got)]
    assert len(names[0]) == 3
    # The names carry the epoch and its loss to 3 decimals.
    assert names[0] == names[1]
    last = []
    for run in (expected, got):
        with tf.device("/device:CPU:0"):
            last.append(keras.saving.load_model(str(_saved_files(run)[-1])).get_weights())
        _find(run, keras.callbacks.ModelCheckpoint).folder.cleanup()
    same_weights()(Run(_Holder(last[0]), None, {}, []), Run(_Holder(last[1]), None, {}, []))


class _Holder:
    """Weights in the shape ``same_weights`` reads (``get_weights()``)."""

    def __init__(self, weights: list[Any]) -> None:
        self.weights = weights

    def get_weights(self) -> list[Any]:
        return self.weights


def _csv_logger() -> dict[str, Any]:
    folder = Folder()
    logger = keras.callbacks.CSVLogger(str(folder.path / "log.csv"))
    logger.folder = folder  # type: ignore[attr-defined]
    return _validated(logger)


def _same_csv(expected: Run, got: Run) -> None:
    tables = []
    for run in (expected, got):
        logger = _find(run, keras.callbacks.CSVLogger)
        with open(logger.filename, newline="") as handle:
            tables.append(list(csv.DictReader(handle)))
        logger.folder.cleanup()
    assert [list(row) for row in tables[0]] == [list(row) for row in tables[1]]
    assert len(tables[0]) == 3
    for left, right in zip(tables[0], tables[1], strict=True):
        np.testing.assert_allclose(
            [float(v) for v in right.values()], [float(v) for v in left.values()], rtol=1e-4
        )


def _tensorboard() -> dict[str, Any]:
    folder = Folder()
    board = keras.callbacks.TensorBoard(str(folder.path), update_freq="epoch")
    board.folder = folder  # type: ignore[attr-defined]
    return _validated(board)


def _scalars(folder: Path) -> dict[tuple[str, str, int], float]:
    found = {}
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                if not value.HasField("tensor"):
                    found[(events.parent.name, value.tag, event.step)] = value.simple_value
                    continue
                array = tf.make_ndarray(value.tensor)
                if array.size == 1 and array.dtype.kind == "f":  # a scalar, not the graph
                    found[(events.parent.name, value.tag, event.step)] = float(array)
    return found


def _same_tensorboard_scalars(expected: Run, got: Run) -> None:
    logged = []
    for run in (expected, got):
        board = _find(run, keras.callbacks.TensorBoard)
        logged.append(_scalars(board.folder.path))
        board.folder.cleanup()
    assert sorted(logged[0]) == sorted(logged[1])
    tags = {tag for _, tag, _ in logged[0]}
    assert {"epoch_loss", "epoch_learning_rate"} <= tags, tags
    keys = sorted(logged[0])
    np.testing.assert_allclose(
        [logged[1][k] for k in keys], [logged[0][k] for k in keys], rtol=1e-4, atol=1e-7
    )


# -- LambdaCallback and custom callbacks --------------------------------------------------------
def _lambda_events() -> dict[str, Any]:
    events: list[tuple[str, int | None]] = []

    def record(name: str) -> Any:
        def hook(*args: Any, **kwargs: Any) -> None:
            events.append((name, args[0] if args and isinstance(args[0], int) else None))

        return hook

    callback = keras.callbacks.LambdaCallback(
        on_epoch_begin=record("epoch_begin"),
        on_epoch_end=record("epoch_end"),
        on_train_batch_begin=record("batch_begin"),
        on_train_batch_end=record("batch_end"),
        on_train_begin=record("train_begin"),
        on_train_end=record("train_end"),
    )
    callback.events = events  # type: ignore[attr-defined]
    return _validated(callback)


def _same_lambda_events(expected: Run, got: Run) -> None:
    seen = [_find(run, keras.callbacks.LambdaCallback).events for run in (expected, got)]
    assert seen[0] == seen[1]
    assert seen[0][0] == ("train_begin", None) and seen[0][-1] == ("train_end", None)


class WeightsAtEpochEnd(keras.callbacks.Callback):
    """Reads the model's weights in every on_epoch_end (what a user's callback sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[np.ndarray]] = []

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.seen.append(self.model.get_weights())


def _same_weights_seen(expected: Run, got: Run) -> None:
    for left, right in zip(
        _find(expected, WeightsAtEpochEnd).seen, _find(got, WeightsAtEpochEnd).seen, strict=True
    ):
        same_weights()(Run(_Holder(left), None, {}, []), Run(_Holder(right), None, {}, []))


class ShrinkAtEpochBegin(keras.callbacks.Callback):
    """Sets weights from a callback (callback_test: a callback changing the model)."""

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.model.set_weights([w * 0.9 for w in self.model.get_weights()])


class NanAfter(keras.callbacks.Callback):
    """Records the loss of every batch (TerminateOnNaN's input)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.losses.append(float((logs or {}).get("loss", np.nan)))


_YNAN = Y.copy()
_YNAN[40] = np.nan  # the third batch of 16


def _nan_keeps_last_finite_weights(expected: Run, got: Run) -> None:
    # Keras applies the NaN update, then stops; tfscale stops before applying it.
    assert expected.model.stop_training and got.model.stop_training
    assert not all(np.isfinite(w).all() for w in expected.model.get_weights())
    assert all(np.isfinite(w).all() for w in got.model.get_weights())
    assert (expected.iterations, got.iterations) == (3, 2)
    assert np.isnan(expected.history.history["loss"][0])
    assert np.isnan(got.history.history["loss"][0])
    with tf.device("/device:CPU:0"):
        model = regressor()
        model.set_weights(got.initial_weights)
        model.fit(X[:32], Y[:32], batch_size=16, shuffle=False, verbose=0)
    same_weights()(Run(model, None, {}, got.initial_weights), got)


# -- BackupAndRestore: interrupted, then resumed ------------------------------------------------
class StopAt(keras.callbacks.Callback):
    """Raises at the end of an epoch: an interrupted run."""

    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def _interrupted_then_resumed(model: Any, train: Train, arguments: dict[str, Any]) -> Any:
    folder = Folder()
    backup = keras.callbacks.BackupAndRestore(str(folder.path))
    first = {**arguments, "callbacks": [backup, StopAt(1)], "epochs": 4}
    try:
        train(model, **first)
    except RuntimeError as error:
        assert "interrupted" in str(error)
    history = train(model, **{**arguments, "epochs": 4, "callbacks": [backup]})
    folder.cleanup()
    return history


def _resumed_epochs(expected: Run, got: Run) -> None:
    assert expected.history.epoch == got.history.epoch == [2, 3]


def _swap_ema() -> Any:
    return compiled(mlp(), optimizer=keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.8))


def _lr(run: Run) -> float:
    return float(np.asarray(run.model.optimizer.learning_rate))


def _same_final_learning_rate(expected: Run, got: Run) -> None:
    assert _lr(got) == _lr(expected)
    assert _lr(got) < 0.01  # the callback lowered it


CASES = [
    Case(
        "early_stopping_min_delta",
        f"{CALLBACKS}/early_stopping_test.py::test_early_stopping",
        regressor,
        lambda: _arrays(
            keras.callbacks.EarlyStopping(monitor="loss", min_delta=1.0, patience=0), epochs=6
        ),
        checks=_exact(_stopped_at(3)),
    ),
    Case(
        "early_stopping_restore_best_weights",
        f"{CALLBACKS}/early_stopping_test.py::test_early_stopping_with_restore_best_weights",
        lambda: regressor(optimizer=keras.optimizers.SGD(0.3)),
        lambda: _validated(
            keras.callbacks.EarlyStopping(patience=1, restore_best_weights=True), epochs=6
        ),
        checks=_exact(_restored_best),
    ),
    Case(
        "early_stopping_baseline",
        f"{CALLBACKS}/early_stopping_test.py::test_early_stopping_baseline",
        regressor,
        lambda: _validated(keras.callbacks.EarlyStopping(baseline=1e-3, patience=1), epochs=5),
        checks=_exact(_stopped_at(2)),
    ),
    Case(
        "early_stopping_start_from_epoch",
        f"{CALLBACKS}/early_stopping_test.py::test_early_stopping_with_start_from_epoch",
        regressor,
        lambda: _validated(
            keras.callbacks.EarlyStopping(
                monitor="val_loss", min_delta=10.0, patience=0, start_from_epoch=2
            ),
            epochs=6,
        ),
        checks=_exact(_stopped_at(4)),
    ),
    Case(
        "reduce_lr_on_plateau",
        f"{CALLBACKS}/reduce_lr_on_plateau_test.py::test_reduces_lr_with_model_fit",
        regressor,
        lambda: _validated(
            keras.callbacks.ReduceLROnPlateau(patience=0, factor=0.5, min_delta=10.0),
        ),
        checks=_exact(_same_final_learning_rate),
    ),
    Case(
        "reduce_lr_on_plateau_cooldown_min_lr",
        f"{CALLBACKS}/reduce_lr_on_plateau_test.py::test_cooldown / test_min_lr",
        regressor,
        lambda: _validated(
            keras.callbacks.ReduceLROnPlateau(
                monitor="loss", patience=0, factor=0.2, min_delta=10.0, cooldown=1, min_lr=5e-4
            ),
            epochs=4,
        ),
        checks=_exact(_same_final_learning_rate),
    ),
    Case(
        "learning_rate_scheduler",
        f"{CALLBACKS}/learning_rate_scheduler_test.py::test_updates_learning_rate",
        regressor,
        lambda: _arrays(keras.callbacks.LearningRateScheduler(_schedule)),
        checks=_exact(_same_final_learning_rate),
    ),
    Case(
        "model_checkpoint_save_best_only",
        f"{CALLBACKS}/model_checkpoint_test.py::test_model_checkpoint_options (save_best_only)",
        regressor,
        _checkpoint_best,
        checks=_exact(_same_best_checkpoint),
    ),
    Case(
        "model_checkpoint_every_epoch",
        f"{CALLBACKS}/model_checkpoint_test.py::test_model_checkpoint_loading (.keras)",
        regressor,
        _checkpoint_every_epoch,
        checks=_exact(_same_epoch_checkpoints),
    ),
    Case(
        "csv_logger",
        f"{CALLBACKS}/csv_logger_test.py::test_CSVLogger",
        lambda: regressor(metrics=["mae"]),
        _csv_logger,
        checks=_exact(_same_csv),
    ),
    Case(
        "tensorboard_epoch_scalars",
        f"{CALLBACKS}/tensorboard_test.py::test_TensorBoard_basic",
        regressor,
        _tensorboard,
        checks=_exact(_same_tensorboard_scalars),
    ),
    Case(
        "lambda_callback_event_order",
        f"{CALLBACKS}/lambda_callback_test.py::test_lambda_callback",
        regressor,
        _lambda_events,
        checks=_exact(_same_lambda_events),
    ),
    Case(
        "callback_reads_weights_at_epoch_end",
        f"{CALLBACKS}/callback_test.py::test_model_property (model read in a hook)",
        regressor,
        lambda: _arrays(WeightsAtEpochEnd()),
        checks=_exact(_same_weights_seen),
    ),
    Case(
        "callback_sets_weights_at_epoch_begin",
        f"{CALLBACKS}/callback_test.py (a callback changing the model)",
        regressor,
        lambda: _arrays(ShrinkAtEpochBegin()),
    ),
    Case(
        "terminate_on_nan",
        f"{CALLBACKS}/terminate_on_nan_test.py::test_TerminateOnNaN",
        regressor,
        lambda: _arrays(keras.callbacks.TerminateOnNaN(), NanAfter(), y=_YNAN),
        checks=[_nan_keeps_last_finite_weights],
        known_difference=(
            "Keras applies the update whose loss is NaN and then stops (its weights are NaN, "
            "iterations 3); tfscale skips a non-finite update on every replica and stops, so "
            "its weights are those after the 2 finite batches (checked against one device "
            "trained on those 2 batches)"
        ),
    ),
    Case(
        "backup_and_restore_resume",
        f"{CALLBACKS}/backup_and_restore_test.py::test_backup_restore_on_train_end",
        regressor,
        lambda: {"x": X, "y": Y, "batch_size": 16},
        procedure=_interrupted_then_resumed,
        checks=_exact(_resumed_epochs),
    ),
    Case(
        "swap_ema_weights_on_epoch",
        f"{CALLBACKS}/swap_ema_weights_test.py::test_swap_ema_weights_on_epoch",
        _swap_ema,
        lambda: _validated(keras.callbacks.SwapEMAWeights(swap_on_epoch=True)),
    ),
    Case(
        "swap_ema_weights_for_evaluation",
        f"{CALLBACKS}/swap_ema_weights_test.py::test_swap_ema_weights",
        _swap_ema,
        lambda: _validated(keras.callbacks.SwapEMAWeights(swap_on_epoch=False)),
    ),
    Case(
        "history_and_progbar_logger",
        f"{CALLBACKS}/history_test.py / progbar_logger_test.py (verbose=2)",
        lambda: regressor(metrics=["mae"]),
        lambda: _validated(verbose=2),
    ),
    Case(
        "early_stopping_with_steps_per_epoch",
        f"{CALLBACKS}/early_stopping_test.py (dataset, steps_per_epoch)",
        regressor,
        lambda: {
            "x": tf.data.Dataset.from_tensor_slices((X, Y)).batch(16).repeat(),
            "steps_per_epoch": 2,
            "epochs": 6,
            "callbacks": [keras.callbacks.EarlyStopping(monitor="loss", min_delta=1.0)],
        },
        checks=_exact(_stopped_at(2)),
    ),
]
