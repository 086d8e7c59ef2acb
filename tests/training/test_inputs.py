"""Bad inputs give tfscale errors that say what to do; callbacks, validation and the
profiling hooks work."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import relative_difference
from tfscale.training import Trainer
from tfscale.training.callbacks import wants_batch_logs
from tfscale.training.data import make_input

from .helpers import CLASSES, DATA, FEATURES, batches, strategy_for, tiny_model


def test_global_batch_not_divisible_lists_valid_sizes() -> None:
    x, y = DATA
    strategy = strategy_for(4)
    with pytest.raises(tfscale.TrainingError, match="cannot be split evenly") as info:
        tfscale.fit(tiny_model(strategy), (x, y), batch_size=30, strategy=strategy, verbose=0)
    assert "28, 32" in str(info.value)
    with pytest.raises(tfscale.TrainingError, match="cannot be split evenly"):
        tfscale.fit(tiny_model(strategy), batches(x, y, 30), strategy=strategy, verbose=0)


def test_uncompiled_model_is_refused_with_a_snippet() -> None:
    strategy = strategy_for(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    with pytest.raises(tfscale.TrainingError, match="not compiled") as info:
        tfscale.fit(model, DATA, strategy=strategy, verbose=0)
    assert "model.compile(" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulation_steps": 0}, "accumulation_steps must be a positive integer"),
        ({"steps_per_execution": 1.5}, "steps_per_execution must be a positive integer"),
        ({"mixed_precision": "int8"}, "Unknown mixed_precision"),
        ({"clipnorm": -1.0}, "clipnorm must be positive"),
        ({"epochs": 0}, "epochs must be a positive integer"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], match: str) -> None:
    strategy = strategy_for(2)
    with pytest.raises(tfscale.TrainingError, match=match):
        tfscale.fit(tiny_model(strategy), DATA, strategy=strategy, verbose=0, **kwargs)


def test_unreadable_or_endless_data_and_keras_accumulation_are_refused() -> None:
    strategy = strategy_for(2)
    endless = batches(*DATA, 32).repeat()
    with pytest.raises(tfscale.TrainingError, match="repeats forever"):
        tfscale.fit(tiny_model(strategy), endless, strategy=strategy, verbose=0)
    with pytest.raises(tfscale.TrainingError, match="cannot read this data"):
        tfscale.fit(tiny_model(strategy), "train.csv", strategy=strategy, verbose=0)
    model = tiny_model(strategy, keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    with pytest.raises(tfscale.TrainingError, match="accumulation_steps=2"):
        tfscale.fit(model, DATA, strategy=strategy, verbose=0)


def test_model_built_outside_the_scope_is_repaired_with_a_warning() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    outside = tiny_model(None)
    if importlib.util.find_spec("tfscale.scope") is None:
        with pytest.raises(tfscale.TrainingError, match="outside the strategy's scope"):
            tfscale.fit(outside, (x, y), strategy=strategy, verbose=0)
        return
    inside = tiny_model(strategy)
    with pytest.warns(tfscale.TfscaleWarning, match="outside the strategy's scope"):
        tfscale.fit(outside, batches(x, y, 32), steps_per_epoch=3, strategy=strategy, verbose=0)
    tfscale.fit(inside, batches(x, y, 32), steps_per_epoch=3, strategy=strategy, verbose=0)
    assert relative_difference(outside.get_weights(), inside.get_weights()) <= 1e-5


def test_multi_input_arrays_as_a_dict() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    with strategy.scope():
        left = keras.Input((6,), name="left")
        right = keras.Input((FEATURES - 6,), name="right")
        merged = keras.layers.Concatenate()([left, right])
        model = keras.Model([left, right], keras.layers.Dense(CLASSES)(merged))
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    inputs = {"left": x[:, :6], "right": x[:, 6:]}
    history = tfscale.fit(model, (inputs, y), batch_size=32, strategy=strategy, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert int(model.optimizer.iterations.numpy()) == len(x) // 32


def test_keras_callbacks_and_distributed_validation(tmp_path: Path) -> None:
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy, "adam", lr=0.01)
    csv = tmp_path / "log.csv"
    history = tfscale.fit(
        model,
        (x, y),
        batch_size=32,
        epochs=3,
        validation_data=(x[:96], y[:96]),
        callbacks=[
            keras.callbacks.CSVLogger(str(csv)),
            keras.callbacks.EarlyStopping(monitor="loss", patience=5),
            keras.callbacks.ModelCheckpoint(str(tmp_path / "w.weights.h5"), save_weights_only=True),
            keras.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq=2),
        ],
        strategy=strategy,
        verbose=0,
    )
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(csv.read_text().strip().splitlines()) == 4
    assert (tmp_path / "w.weights.h5").exists()
    # TensorBoard got the epoch logs of both loops and the per-batch loss every 2 updates.
    tags = {
        part: {
            value.tag
            for path in (tmp_path / "tb" / part).glob("events.out.tfevents.*")
            for event in tf.compat.v1.train.summary_iterator(str(path))
            for value in event.summary.value
        }
        for part in ("train", "validation")
    }
    assert {"epoch_loss", "epoch_accuracy", "batch_loss"} <= tags["train"]
    assert {"epoch_loss", "epoch_accuracy"} <= tags["validation"]
    # Validation on 2 replicas equals Keras's own single-process evaluation.
    with tf.device("/device:CPU:0"):
        expected = keras.Model.evaluate(model, x[:96], y[:96], batch_size=32, verbose=0)
    got = [history.history["val_loss"][-1], history.history["val_accuracy"][-1]]
    assert relative_difference(got, expected) <= 1e-5


def test_batch_logs_only_when_a_callback_reads_them_and_training_is_the_same() -> None:
    reader = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)
    assert wants_batch_logs([reader]) and wants_batch_logs([keras.callbacks.ProgbarLogger()])
    assert not wants_batch_logs([keras.callbacks.History(), keras.callbacks.EarlyStopping()])
    x, y = DATA
    strategy = strategy_for(2)
    results = []
    batch_losses = _BatchLosses()
    for callbacks in ([], [keras.callbacks.CSVLogger(os.devnull), batch_losses]):
        model = tiny_model(strategy, "adam", lr=0.01)
        history = tfscale.fit(
            model,
            (x, y),
            batch_size=32,
            epochs=2,
            callbacks=callbacks,
            strategy=strategy,
            verbose=0,
        )
        results.append((model.get_weights(), history.history["loss"]))
    (quiet_weights, quiet_loss), (logged_weights, logged_loss) = results
    assert relative_difference(quiet_weights, logged_weights) <= 1e-5
    assert relative_difference(quiet_loss, logged_loss) <= 1e-5
    assert len(batch_losses.losses) == 2 * len(x) // 32
    # The last batch's running loss of an epoch is the epoch's loss.
    assert relative_difference(batch_losses.losses[-1], logged_loss[-1]) <= 1e-5


class _BatchLosses(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.losses.append(float(logs["loss"]))


class _Timings(keras.callbacks.Callback):
    tfscale_wants_timings = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, float]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.seen.append((logs["fetch_seconds"], logs["step_seconds"]))


def test_timing_hook_reports_fetch_and_step_time_and_changes_no_result() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    timed, plain, recorder = tiny_model(strategy), tiny_model(strategy), _Timings()
    for model, callbacks in ((timed, [recorder]), (plain, [])):
        tfscale.fit(
            model,
            batches(x, y, 16),
            steps_per_epoch=3,
            accumulation_steps=2,
            callbacks=callbacks,
            strategy=strategy,
            verbose=0,
        )
    assert len(recorder.seen) == 3
    assert all(fetch >= 0.0 and step > 0.0 for fetch, step in recorder.seen)
    assert relative_difference(timed.get_weights(), plain.get_weights()) <= 1e-5


def test_private_knob_without_all_reduce_lets_replicas_drift_apart() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy)
    pipeline = make_input(batches(x, y, 32), batch_size=None, strategy=strategy)
    trainer = Trainer(model, strategy, nominal_batch=32, sample_batch=pipeline.sample())
    trainer._set_gradient_all_reduce(False)
    trainer.train(iter(pipeline.distributed()), 2)
    assert trainer.all_reduce_traces == 0
    kernel = model.trainable_variables[0].value
    copies = [c.numpy() for c in strategy.experimental_local_results(kernel)]
    assert relative_difference(copies[0], copies[1]) > 1e-4


def test_no_strategy_given_uses_choose_strategy_over_every_device() -> None:
    x, y = DATA
    model = tiny_model(None)  # built in no scope, trained with strategy=None
    reference = tiny_model(strategy_for(4))
    seen: list[int] = []
    record = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: seen.append(
            record.model._distribute_strategy.num_replicas_in_sync
        )
    )
    with pytest.warns(tfscale.TfscaleWarning, match="outside the strategy's scope"):
        tfscale.fit(model, batches(x, y, 32), steps_per_epoch=3, callbacks=[record], verbose=0)
    assert seen == [4]  # the session's 4 logical CPUs
    tfscale.fit(
        reference, batches(x, y, 32), steps_per_epoch=3, strategy=strategy_for(4), verbose=0
    )
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5


def test_one_update_per_call_ends_unknown_length_data_like_the_looped_function() -> None:
    # 250 examples in batches of 32: 8 batches, the last one of 26 split over 2 replicas;
    # filter() hides the length, so each epoch ends at the data's end. On one worker
    # steps_per_execution=1 reads with a plain get_next and ends on OutOfRangeError;
    # steps_per_execution=3 runs the looped function with get_next_as_optional.
    x, y = DATA[0][:250], DATA[1][:250]
    strategy = strategy_for(2)
    data = batches(x, y, 32).filter(lambda a, b: True)
    assert int(data.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    weights = []
    for steps_per_execution in (1, 3):
        model = tiny_model(strategy, "adam", lr=0.01)
        history = tfscale.fit(
            model,
            data,
            epochs=2,
            steps_per_execution=steps_per_execution,
            strategy=strategy,
            verbose=0,
        )
        assert int(model.optimizer.iterations.numpy()) == 2 * 8
        assert len(history.history["loss"]) == 2
        weights.append(model.get_weights())
    assert relative_difference(weights[0], weights[1]) <= 1e-6
    # The same from the step-level API: an exhausted iterator gives (0, True, {}).
    model = tiny_model(strategy)
    pipeline = make_input(data, batch_size=None, strategy=strategy)
    trainer = Trainer(model, strategy, nominal_batch=32, sample_batch=pipeline.sample())
    iterator = iter(pipeline.distributed())
    results = [trainer.train(iterator, 1, logs=False)[:2] for _ in range(9)]
    assert results == [(1, False)] * 8 + [(0, True)]
