"""Bad inputs give tfscale errors that say what to do; callbacks, validation, per-batch logs
and the profiling hooks work. (Models built outside the scope: test_adopt.py.)"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import graphs_traced_by, relative_difference
from tfscale.training import Trainer
from tfscale.training.data import RELEASE_THREAD, EpochOrder, FitInputs
from tfscale.training.prepare import prepared

from .helpers import (
    CLASSES,
    DATA,
    FEATURES,
    batches,
    reference_weights,
    strategy_for,
    tiered,
    tiny_model,
)
from .parity.common import aligned, generator, regression, regressor
from .parity.keras_io_cases import Batches

pytestmark = pytest.mark.tf


def test_uncompiled_model_is_refused_with_a_snippet() -> None:
    strategy = strategy_for(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    with pytest.raises(tfscale.TrainingError, match="not compiled") as info:
        tfscale.fit(model, data=DATA, strategy=strategy, verbose=0)
    assert "model.compile(" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulation_steps": 0}, "accumulation_steps must be a positive integer"),
        ({"steps_per_execution": 1.5}, "steps_per_execution must be a positive integer"),
        ({"mixed_precision": "int8"}, "Unknown mixed_precision"),
        ({"global_clipnorm": -1.0}, "global_clipnorm must be positive"),
        ({"clipnorm": 1.0}, "clipnorm= is not a tfscale option"),
        ({"epochs": -1}, "epochs must be an integer >= 0"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], match: str) -> None:
    strategy = strategy_for(2)
    with pytest.raises(tfscale.TrainingError, match=match):
        tfscale.fit(tiny_model(strategy), *DATA, strategy=strategy, verbose=0, **kwargs)


def test_argument_errors_are_value_errors_as_in_keras() -> None:
    # An `except ValueError` written around model.fit keeps working around tfscale's (#21.6).
    strategy = strategy_for(2)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        tfscale.fit(tiny_model(strategy), *DATA, batch_size=0, strategy=strategy, verbose=0)
    with pytest.raises(ValueError, match="accumulation_steps must be a positive integer"):
        tfscale.prepare(tiny_model(strategy), strategy, accumulation_steps=0)


def test_the_old_clipnorm_is_refused_naming_global_clipnorm_and_kerass_own() -> None:
    strategy = strategy_for(2)
    model = tiny_model(strategy)
    before = model.get_weights()
    for call in (
        lambda: tfscale.fit(model, *DATA, clipnorm=1.0, strategy=strategy, verbose=0),
        lambda: tfscale.prepare(model, strategy, clipnorm=1.0),
        lambda: Trainer(model, strategy, clipnorm=1.0),
    ):
        with pytest.raises(
            tfscale.TrainingError, match="clipnorm= is not a tfscale option"
        ) as info:
            call()
        message = str(info.value)
        assert "global_clipnorm=1.0" in message and "keras.optimizers.Adam(clipnorm=1.0)" in message
    assert prepared(model) is None  # refused before any change
    assert relative_difference(model.get_weights(), before) == 0.0


@pytest.mark.full(
    "tests/training/test_inputs.py::"
    "test_generator_inputs_leave_the_users_arrays_unchanged_and_train_as_one_device"
    "[generator-prepare]",
)
def test_numpy_integers_are_taken_wherever_model_fit_takes_them() -> None:
    x, y = DATA
    integers = {
        "batch_size": 32, "epochs": 3, "initial_epoch": 1, "steps_per_epoch": 4,
        "validation_steps": 2, "validation_batch_size": 16, "validation_freq": 2, "verbose": 0,
        "accumulation_steps": 2, "steps_per_execution": 2, "bucket_bytes": 256,
    }  # fmt: skip
    weights, histories = [], []
    for kind in (int, np.int64):
        strategy = strategy_for(2)
        model = tiny_model(strategy, "adam", lr=0.01)
        history = tfscale.fit(
            model, x, y, shuffle=False, validation_data=(x[:64], y[:64]), strategy=strategy,
            **{name: kind(value) for name, value in integers.items()},
        )  # fmt: skip
        weights.append(model.get_weights())
        histories.append(history.history)
        assert int(model.optimizer.iterations.numpy()) == 2 * 4 // 2
    assert relative_difference(weights[0], weights[1]) == 0.0
    assert histories[0] == histories[1]
    model = tiny_model(strategy_for(2))
    tfscale.prepare(
        model, strategy_for(2), accumulation_steps=np.int32(2), global_clipnorm=np.float32(1)
    )
    state = prepared(model)
    assert state is not None and type(state.options.accumulation_steps) is int


def test_unreadable_or_endless_data_and_keras_accumulation_are_refused() -> None:
    strategy = strategy_for(2)
    endless = batches(*DATA, 32).repeat()
    with pytest.raises(tfscale.TrainingError, match="repeats forever"):
        tfscale.fit(tiny_model(strategy), endless, strategy=strategy, verbose=0)
    with pytest.raises(tfscale.TrainingError, match="cannot read this data"):
        tfscale.fit(tiny_model(strategy), "train.csv", strategy=strategy, verbose=0)
    model = tiny_model(strategy, keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    with pytest.raises(tfscale.TrainingError, match="accumulation_steps=2"):
        tfscale.fit(model, *DATA, strategy=strategy, verbose=0)


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
    history = tfscale.fit(model, inputs, y, batch_size=32, strategy=strategy, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert int(model.optimizer.iterations.numpy()) == len(x) // 32


def _tags(folder: Path) -> set[str]:
    return {
        value.tag
        for path in folder.glob("events.out.tfevents.*")
        for event in tf.compat.v1.train.summary_iterator(str(path))
        for value in event.summary.value
    }


class _Protocol(keras.callbacks.Callback):
    """Records which hooks ran and the logs of the last train end."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.end_logs: dict[str, Any] | None = None

    def on_test_begin(self, logs: Any = None) -> None:
        self.calls.append("test_begin")

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self.calls.append("test_batch_end")

    def on_test_end(self, logs: Any = None) -> None:
        self.calls.append("test_end")

    def on_train_end(self, logs: Any = None) -> None:
        self.end_logs = dict(logs or {})


@pytest.mark.full(
    "tests/training/test_parity_examples.py::"
    "test_cases_across_two_worker_processes_match_one_device[paths_across_workers]",
    "tests/training/test_parity.py::"
    "test_tfscale_fit_matches_one_device_model_fit[callback_methods_keys]",
)
def test_keras_callbacks_and_distributed_validation(tmp_path: Path) -> None:
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy, "adam", lr=0.01)
    csv, protocol = tmp_path / "log.csv", _Protocol()
    history = tfscale.fit(
        model,
        x,
        y,
        batch_size=32,
        epochs=3,
        validation_data=(x[:96], y[:96]),
        callbacks=[
            keras.callbacks.CSVLogger(str(csv)),
            keras.callbacks.EarlyStopping(monitor="loss", patience=5),
            keras.callbacks.ModelCheckpoint(str(tmp_path / "w.weights.h5"), save_weights_only=True),
            keras.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq=2),
            protocol,
        ],
        strategy=strategy,
        verbose=0,
    )
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert len(csv.read_text().strip().splitlines()) == 4
    assert (tmp_path / "w.weights.h5").exists()
    # model.fit's protocol: on_test_* during validation, final logs at on_train_end.
    assert protocol.calls.count("test_begin") == 3 and "test_batch_end" in protocol.calls
    assert protocol.end_logs is not None and set(protocol.end_logs) == set(history.history)
    # TensorBoard got the epoch logs of both loops, the per-batch loss, and the evaluation
    # curves against iterations.
    train, validation = _tags(tmp_path / "tb" / "train"), _tags(tmp_path / "tb" / "validation")
    assert {"epoch_loss", "epoch_accuracy", "batch_loss"} <= train
    assert {"epoch_loss", "epoch_accuracy", "evaluation_loss_vs_iterations"} <= validation
    # Validation on 2 replicas equals Keras's own single-device evaluation.
    with tf.device("/device:CPU:0"):
        expected = keras.Model.evaluate(model, x[:96], y[:96], batch_size=32, verbose=0)
    got = [history.history["val_loss"][-1], history.history["val_accuracy"][-1]]
    assert relative_difference(got, expected) <= 1e-5


class _BatchLogs(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.logs: list[dict[str, float]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.logs.append({k: float(v) for k, v in (logs or {}).items()})


@pytest.mark.full(
    "tests/training/test_parity.py::"
    "test_tfscale_fit_matches_one_device_model_fit[callback_methods_keys]",
)
def test_per_batch_logs_are_the_metrics_of_all_replicas_as_on_one_device() -> None:
    x, y = DATA
    logs = []
    for strategy in (strategy_for(0), strategy_for(4)):
        with strategy.scope():
            model = tiny_model(strategy)
            model.compile(
                keras.optimizers.Adam(0.01),
                keras.losses.CategoricalCrossentropy(from_logits=True),
                metrics=["accuracy", keras.metrics.AUC(name="auc", from_logits=True)],
            )
        recorder = _BatchLogs()
        tfscale.fit(
            model, batches(x, keras.utils.to_categorical(y, CLASSES), 32), epochs=1,
            callbacks=[recorder], strategy=strategy, verbose=0,
        )  # fmt: skip
        logs.append(recorder.logs)
    one, four = logs
    assert len(one) == len(four) == len(x) // 32
    for a, b in zip(one, four, strict=True):
        assert set(a) == {"loss", "accuracy", "auc"} == set(b)
        # AUC is not a mean over replicas: it is exact only when every replica's counts
        # are summed first, as tfscale's logs are.
        assert relative_difference([b[k] for k in sorted(b)], [a[k] for k in sorted(a)]) <= 1e-5


class _Timings(keras.callbacks.Callback):
    tfscale_wants_timings = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, float]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        timing = self.model.train_function.timings[-1]
        self.seen.append((timing.fetch_seconds, timing.step_seconds))


class _Clock:
    """A clock that advances one second per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_timing_hook_reports_fetch_and_step_time_and_changes_no_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tfscale.training import function

    # An injected clock: each call reads it at its start, after the fetch and at its end.
    monkeypatch.setattr(function, "time", _Clock())
    x, y = DATA
    strategy = strategy_for(2)
    timed, plain, recorder = tiny_model(strategy), tiny_model(strategy), _Timings()
    for model, callbacks in ((timed, [recorder]), (plain, [])):
        tfscale.fit(
            model,
            batches(x, y, 16),
            steps_per_epoch=6,
            accumulation_steps=2,
            callbacks=callbacks,
            strategy=strategy,
            verbose=0,
        )
    assert len(recorder.seen) == 6
    assert recorder.seen == [(1.0, 1.0)] * 6
    assert relative_difference(timed.get_weights(), plain.get_weights()) <= 1e-5


def test_private_knob_without_all_reduce_lets_replicas_drift_apart() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy)
    trainer = Trainer(model, strategy, all_reduce=False, sample_batch=(x[:16], y[:16]))
    dataset = strategy.experimental_distribute_dataset(batches(x, y, 32))
    trainer.train(iter(dataset), 2)
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
            record.model.distribute_strategy.num_replicas_in_sync
        )
    )
    tfscale.fit(model, batches(x, y, 32), steps_per_epoch=3, callbacks=[record], verbose=0)
    assert seen == [4]  # the session's 4 logical CPUs
    tfscale.fit(
        reference, batches(x, y, 32), steps_per_epoch=3, strategy=strategy_for(4), verbose=0
    )
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5


@pytest.mark.full(
    "tests/training/test_parity_examples.py::"
    "test_cases_across_two_worker_processes_match_one_device[paths_across_workers]",
)
def test_unknown_length_data_ends_each_epoch_with_one_or_several_steps_per_call() -> None:
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
        assert model.steps_per_execution == 1  # the option held for that call only
        weights.append(model.get_weights())
    assert relative_difference(weights[0], weights[1]) <= 1e-6
    expected = reference_weights(x, y, batch=32, steps=8, optimizer="adam", lr=0.01, epochs=2)
    assert relative_difference(weights[0], expected) <= 1e-5
    # The same from the step-level API: an exhausted iterator gives (0, True, ...).
    model = tiny_model(strategy)
    trainer = Trainer(model, strategy, sample_batch=(x[:16], y[:16]))
    iterator = iter(strategy.experimental_distribute_dataset(data))
    results = [trainer.train(iterator, 1)[:2] for _ in range(9)]
    assert results == [(1, False)] * 8 + [(0, True)]


def _join_releases(timeout: float) -> None:
    """Waits for the fits' input-release threads (each up to ``timeout`` seconds)."""
    for thread in threading.enumerate():
        if thread.name == RELEASE_THREAD:
            thread.join(timeout)


def _record_thread(names: dict[int, str], key: int) -> None:
    names[key] = threading.current_thread().name


@pytest.mark.full(
    "tests/training/test_inputs.py::"
    "test_every_iterator_of_a_fit_is_destroyed_off_the_callers_thread",
)
def test_one_distributed_iterator_serves_every_epoch_of_a_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keras makes an iterator per epoch (and a spare one at its end); tfscale.fit gives it
    the epochs as one dataset, so one iterator serves the fit, with the same weights."""
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    made: list[int] = []  # the epoch iterator object each new iterator was made for
    released_by: dict[int, str] = {}  # the thread that dropped each epoch iterator
    original = TFEpochIterator._get_iterator

    def counting(self: Any) -> Any:
        if id(self) not in made:
            weakref.finalize(self, _record_thread, released_by, id(self))
        made.append(id(self))
        return original(self)

    monkeypatch.setattr(TFEpochIterator, "_get_iterator", counting)
    x, y = DATA
    strategy = strategy_for(2)
    dataset = batches(x, y, 32)
    for data in ({"x": x, "y": y, "batch_size": 32, "shuffle": False}, {"x": dataset}):
        made.clear()
        released_by.clear()
        model = tiny_model(strategy, "adam", lr=0.01)
        history = tfscale.fit(
            model, epochs=4, validation_data=(x[:64], y[:64]), strategy=strategy, verbose=0,
            **data,
        )  # fmt: skip
        # Training's: one for the 4 epochs. (Keras's
        # evaluate resets its own every time: validation makes one per epoch.)
        assert made.count(made[0]) == 1, made
        assert history.epoch == [0, 1, 2, 3] and int(model.optimizer.iterations.numpy()) == 32
        # It is destroyed (its prefetch threads joined) off the caller's thread, which does
        # not wait for it: the call returned as training ended (#26).
        _join_releases(30.0)
        assert released_by.get(made[0]) == RELEASE_THREAD, released_by
        expected = reference_weights(x, y, batch=32, steps=8, optimizer="adam", lr=0.01, epochs=4)
        assert relative_difference(model.get_weights(), expected) <= 1e-5
    made.clear()
    keras_model = tiny_model(strategy, "adam", lr=0.01)
    keras_model.fit(dataset, epochs=4, validation_data=(x[:64], y[:64]), verbose=0)
    assert made.count(made[0]) >= 8  # Keras alone: 2 per epoch for training (+1 to build)


def test_every_iterator_of_a_fit_is_destroyed_off_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keras's evaluate makes a new iterator every validation epoch and drops the last one,
    whose destruction can leave the caller idle for up to the iterator's age (60 s at most:
    tf.data's autotuning thread misses its wake-up, docs/ARCHITECTURE.md known problems).
    Under tfscale.fit each dropped one is released in the background when the next is made,
    and the rest when the fit ends: none is destroyed on the caller's thread. (That none is
    kept past the next one: test_fit_inputs_release_what_keras_dropped_when_the_next_comes.)"""
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    made: list[weakref.ref[Any]] = []
    destroyed_by: dict[int, str] = {}
    original = TFEpochIterator._get_iterator

    class Recorded:
        def __init__(self, dataset: Any) -> None:
            self.dataset = dataset

        def __iter__(self) -> Any:
            iterator = iter(self.dataset)
            weakref.finalize(iterator, _record_thread, destroyed_by, len(made))
            made.append(weakref.ref(iterator))
            return iterator

    monkeypatch.setattr(TFEpochIterator, "_get_iterator", lambda self: Recorded(original(self)))
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy, "adam", lr=0.01)
    validation = batches(x[:64], y[:64], 32)
    history = tfscale.fit(
        model, batches(x, y, 32), epochs=4, validation_data=validation, strategy=strategy,
        verbose=0,
    )  # fmt: skip
    # Training's one iterator, and Keras's validation makes two per epoch (the second, a
    # spare made as the first runs out, is dropped by the next epoch's reset).
    assert len(made) == 9, len(made)
    _join_releases(60.0)
    assert sorted(destroyed_by) == list(range(9)), destroyed_by
    assert set(destroyed_by.values()) == {RELEASE_THREAD}, destroyed_by
    # Held and released elsewhere, every validation epoch still read its own batches: the
    # weights and the validation losses of Keras's model.fit on one device.
    monkeypatch.undo()
    with tf.device("/device:CPU:0"):
        reference = tiny_model(None, "adam", lr=0.01)
        expected = reference.fit(
            batches(x, y, 32), epochs=4, validation_data=validation, verbose=0
        ).history
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    assert np.allclose(history.history["val_loss"], expected["val_loss"], rtol=1e-5), (
        history.history["val_loss"],
        expected["val_loss"],
    )


class _Iterator:
    def __next__(self) -> int:
        return 0


class _Epochs:
    """Keras's EpochIterator as FitInputs sees it: ``iter(self._get_iterator())`` each
    epoch, the new iterator replacing the last only once it is made."""

    def __init__(self) -> None:
        self.current: _Iterator | None = None

    def _get_iterator(self) -> Any:
        return self

    def __iter__(self) -> _Iterator:
        return _Iterator()

    def epoch(self) -> None:
        self.current = iter(self._get_iterator())


def test_fit_inputs_release_what_keras_dropped_when_the_next_comes_and_the_rest_at_the_end() -> (
    None
):
    epochs = _Epochs()
    destroyed_by: dict[str, str] = {}
    inputs = FitInputs()
    inputs.watch(epochs)
    epochs.epoch()
    first = epochs.current
    weakref.finalize(first, _record_thread, destroyed_by, "first")
    del first
    epochs.epoch()  # made while `current` still holds the first: kept
    weakref.finalize(epochs.current, _record_thread, destroyed_by, "second")
    assert destroyed_by == {}
    epochs.epoch()  # the first is only FitInputs' now: released
    _join_releases(30.0)
    assert destroyed_by == {"first": RELEASE_THREAD}
    epochs.epoch()  # the second goes too, while `epochs` itself stays held (still in use)
    weakref.finalize(epochs, _record_thread, destroyed_by, "epochs")
    del epochs
    inputs.release()
    _join_releases(30.0)
    assert destroyed_by == dict.fromkeys(["first", "second", "epochs"], RELEASE_THREAD)


@pytest.mark.full(
    "tests/training/test_inputs.py::"
    "test_an_array_fits_train_function_is_one_function_without_partial_batch_conds",
)
def test_arrays_are_cut_per_replica_by_graph_ops_alone_as_tf_distribute_splits_them() -> None:
    """An array fit's input has no Python in it (no ``from_generator`` / ``py_function``:
    nothing waits on Python per batch), and on one worker it yields each replica's share of
    each global batch, exactly what ``experimental_distribute_dataset`` makes of the global
    batches (short last batches and replicas left empty included)."""
    for replicas in (2, 4):
        strategy = strategy_for(replicas)
        for count, batch in ((13, 8), (9, 4), (5, 8)):
            x = np.arange(count * 2, dtype=np.float32).reshape(count, 2)
            y = np.arange(count)
            kw: dict[str, Any] = {"epochs": range(1, 3), "shuffle": True, "seed": 5}
            whole = EpochOrder((x, y, None), batch, **kw).dataset
            shares = EpochOrder((x, y, None), batch, replicas=replicas, **kw).dataset

            def seen(distributed: Any, local: Any = strategy.experimental_local_results) -> Any:
                return [[t.numpy().tolist() for t in local(y)] for _, y in distributed]

            expected = seen(strategy.experimental_distribute_dataset(whole))
            got = seen(strategy.distribute_datasets_from_function(lambda _, d=shares: d))
            assert got == expected, (replicas, count, batch)
    assert len(expected) == 2 and [] in expected[0], expected  # 5 examples: replicas left empty

    def ops(dataset: tf.data.Dataset) -> set[str]:
        graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph().numpy())
        functions = [node.op for f in graph.library.function for node in f.node_def]
        return {node.op for node in graph.node} | set(functions)

    python = {"PyFunc", "PyFuncStateless", "EagerPyFunc", "GeneratorDataset"}
    assert not ops(shares) & python, ops(shares)
    made_in_python = tf.data.Dataset.from_generator(
        lambda: iter([1]), output_signature=tf.TensorSpec((), tf.int32)
    )
    assert ops(made_in_python) & python  # what the check finds when Python is there


def _reads_of_train_function(fit: Any) -> set[str]:
    """The iterator ops the train function that ``fit()`` traced reads its batches with;
    checks that it traced its step inline (no nested function: one multi-device function
    fewer for TensorFlow to instantiate, 0.04 CPU-s of a small fit)."""
    traced = graphs_traced_by(fit)
    steps = [g for g in traced if "multi_step" in g.name]
    assert steps, "the fit traced no train function"
    assert not [g.name for g in traced if "one_step" in g.name]
    return {op.type for g in steps for op in g.get_operations() if op.type.startswith("Iterator")}


def test_an_array_fits_train_function_is_one_function_without_partial_batch_conds(
    tmp_path: Path,
) -> None:
    """A small fit's own cost (#41). Its train function traces the step inline; and on one
    worker, an array fit's epochs repeat endlessly: tf.distribute reads an infinite
    dataset without its partial-batch handling (an optional and a ``cond`` per replica
    around each read, traced and instantiated with every train function: 0.05 of a small
    fit's 0.6 CPU-s, benchmarks/fit_cost.py), and each epoch still runs its steps, uneven
    last batch included. A fit that checkpoints keeps the finite epochs (a resumed epoch
    ends where its data ends) and the conds, which is what the check sees."""
    x, y = DATA
    x, y = x[:90], y[:90]  # two batches of 32 and one of 26 an epoch
    strategy = strategy_for(2)
    model = tiny_model(strategy)

    def fit(**kw: Any) -> None:
        tfscale.fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                    strategy=strategy, steps_per_execution=1, **kw)  # fmt: skip

    assert _reads_of_train_function(fit) == {"IteratorGetNext"}
    assert int(model.optimizer.iterations.numpy()) == 6
    expected = reference_weights(x, y, batch=32, steps=3, epochs=2)
    assert relative_difference(model.get_weights(), expected) <= 1e-5
    model = tiny_model(strategy)
    assert "IteratorGetNextAsOptional" in _reads_of_train_function(
        lambda: fit(checkpoint_dir=str(tmp_path))
    )


# -- generator-backed inputs: TensorFlow writes into the user's arrays --------------------------
def test_tensorflow_writes_into_generator_arrays_under_mirrored_strategy() -> None:
    """The upstream bug :func:`tfscale.training.data.copied_batches` guards against, with
    TensorFlow alone: ``from_generator`` over views of 64-byte-aligned arrays, distributed
    over 2 replicas and read inside a tf.function, as Keras reads it; ``t - 1`` writes
    into the first replica's rows of the caller's array. If this fails, TensorFlow no
    longer aliases them and the copy in ``copied_batches`` can go.

    Whether TensorFlow may reuse a buffer is decided at run time, and under load a batch
    is sometimes left alone (one run in the suite saw fewer than 4 batches written): each
    attempt must write into the first replica's rows only, and one of 3 into all of them.
    """
    original = np.arange(1, 65, dtype="float32").reshape(64, 1)
    strategy = strategy_for(2)
    first_replica = [b + r for b in range(0, 64, 16) for r in range(8)]
    written = []
    for _ in range(3):
        y = aligned(original)

        def generate(y: np.ndarray = y) -> Any:
            for start in range(0, 64, 16):
                yield y[start : start + 16]

        dataset = tf.data.Dataset.from_generator(
            generate, output_signature=tf.TensorSpec((None, 1), tf.float32)
        )
        iterator = iter(strategy.experimental_distribute_dataset(dataset))

        @tf.function
        def step(iterator: Any) -> Any:
            return strategy.run(lambda t: tf.reduce_sum(tf.square(t - 1.0)), args=(next(iterator),))

        for _ in range(4):
            step(iterator)
        changed = np.flatnonzero(y != original).tolist()
        assert set(changed) <= set(first_replica), changed
        written.append(changed)
        if changed == first_replica:
            break
    # Rows 0-7 of each batch of 16: the first replica's share.
    assert written[-1] == first_replica, written


_GENERATOR_INPUTS = [
    (kind, how) for kind in ("py_dataset", "generator") for how in ("tfscale.fit", "prepare")
]


# `make test` runs a generator by prepare + model.fit; the other kind and line (the same
# adapter into the same input plan) in `make test-full`.
@pytest.mark.parametrize(
    ("kind", "how"),
    tiered(
        _GENERATOR_INPUTS,
        {
            "py_dataset-prepare": "generator-prepare",
            "generator-tfscale.fit": "py_dataset-tfscale.fit",
            "py_dataset-tfscale.fit": "generator-prepare",
        },
        "tests/training/test_inputs.py::"
        "test_generator_inputs_leave_the_users_arrays_unchanged_and_train_as_one_device",
        ids=[f"{kind}-{how}" for kind, how in _GENERATOR_INPUTS],
    ),
)
def test_generator_inputs_leave_the_users_arrays_unchanged_and_train_as_one_device(
    kind: str, how: str
) -> None:
    """Keras's model.fit under the same MirroredStrategy changes y in place (the bug
    above, through Keras); tfscale.fit, and model.fit of a prepared model, copy each batch
    and train as one device does on the untouched data."""
    x0, y0 = regression(seed=11)
    strategy = strategy_for(2)

    def data(x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
        if kind == "generator":
            return {"x": generator(x, y, 16)()}  # batches that are views of x and y
        return {"x": Batches(x, y, 16)}  # keras-io's PyDataset of views

    epochs = 1 if kind == "generator" else 2  # a generator is read once
    with tf.device("/device:CPU:0"):
        reference = regressor()
        reference.fit(**data(x0.copy(), y0.copy()), epochs=epochs, shuffle=False, verbose=0)
    x, y = aligned(x0), aligned(y0)
    model = regressor()
    if how == "prepare":
        prepared = tfscale.prepare(model, strategy)
        prepared.fit(**data(x, y), epochs=epochs, shuffle=False, verbose=0)
    else:
        tfscale.fit(model, **data(x, y), epochs=epochs, shuffle=False, strategy=strategy, verbose=0)
    assert np.array_equal(x, x0) and np.array_equal(y, y0), f"{how} changed the data"
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    x, y = aligned(x0), aligned(y0)
    with strategy.scope():
        keras_model = regressor()
    keras_model.fit(**data(x, y), epochs=epochs, shuffle=False, verbose=0)
    assert not np.array_equal(y, y0), "Keras under Mirrored no longer changes y: see above"
