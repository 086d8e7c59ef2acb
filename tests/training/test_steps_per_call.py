"""Several steps per train function call where nothing can tell (#26).

``tfscale.fit`` given no ``steps_per_execution`` runs ``AUTO_STEPS_PER_EXECUTION`` steps per
call when no callback watches batches, no bar is drawn per batch, no validation and no step
checkpoint are due, each epoch's length is known and the fit runs at least ``AUTO_MIN_STEPS``
steps (``fit.auto_steps_per_execution``). The result must be the one-step-per-call result, and
one device's: the same weights, History and update count, with an epoch length the calls do not
divide (13 steps, 16 per call). The fits here are shorter than ``AUTO_MIN_STEPS`` (a long fit
would only cost time): the tests of the loop itself lower it (``_loop_at_any_length``), and
``test_a_short_fit_runs_one_step_per_call`` keeps its real value.
"""

from __future__ import annotations

import importlib
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import relative_difference
from tfscale.training.fit import AUTO_MIN_STEPS, AUTO_STEPS_PER_EXECUTION, auto_steps_per_execution

from .helpers import strategy_for, tiered

pytestmark = pytest.mark.tf

_EXAMPLES, _BATCH = 200, 16  # 13 steps per epoch, the last one short


@pytest.fixture
def _loop_at_any_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several steps per call however short the fit: these tests are about the loop."""
    # The module (tfscale.training's `fit` is the function of the same name).
    monkeypatch.setattr(importlib.import_module("tfscale.training.fit"), "AUTO_MIN_STEPS", 1)


class _StepsPerCall(keras.callbacks.Callback):  # type: ignore[misc]
    """Reads the train function's steps per call at each epoch's end (no batch hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.seen.append(int(self.model.train_function.steps_per_execution))


class _Batches(keras.callbacks.Callback):  # type: ignore[misc]
    """Watches batches: must see every one."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches.append(batch)


def _data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(_EXAMPLES, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(_EXAMPLES, 1))).astype(
        "float32"
    )


def _model(steps_per_execution: int = 1, dropout: bool = False) -> keras.Model:
    keras.utils.set_random_seed(7)
    # Dropout draws per step (and per replica: not one device's masks): the steps' seeds
    # must line up whether they run one or several per call.
    extra = [keras.layers.Dropout(0.25)] if dropout else []
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            *extra,
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(0.01), "mse", steps_per_execution=steps_per_execution)
    return model


def _inputs(kind: str, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    if kind == "arrays":  # in order: Keras's own shuffle is not tfscale's order
        return {"x": x, "y": y, "batch_size": _BATCH, "shuffle": False}
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(_BATCH)
    if kind == "tf.data":
        return {"x": dataset}
    return {"x": dataset.repeat(), "steps_per_epoch": 13}  # infinite, steps given


@pytest.mark.parametrize(
    "kind",
    tiered(
        ["arrays", "tf.data", "repeated tf.data"],
        {"repeated tf.data": "tf.data", "tf.data": "arrays"},
        "tests/training/test_steps_per_call.py::"
        "test_several_steps_per_call_give_one_devices_weights_history_and_updates",
    ),
)
@pytest.mark.usefixtures("_loop_at_any_length")
def test_several_steps_per_call_give_one_devices_weights_history_and_updates(kind: str) -> None:
    x, y = _data(seed=11)
    reference = _model()
    with tf.device("/device:CPU:0"):
        expected = reference.fit(epochs=3, verbose=0, **_inputs(kind, x, y))
    runs = {}
    for steps in (None, 1):
        model = _model()
        watcher = _StepsPerCall()
        history = tfscale.fit(
            model,
            epochs=3,
            verbose=0,
            callbacks=[watcher],
            strategy=strategy_for(2),
            steps_per_execution=steps,
            **_inputs(kind, x, y),
        )
        runs[steps] = (model, history, watcher.seen)
    auto, one = runs[None], runs[1]
    assert auto[2] == [AUTO_STEPS_PER_EXECUTION] * 3 and one[2] == [1] * 3
    for model, history, _ in (auto, one):
        assert int(model.optimizer.iterations.numpy()) == 3 * 13
        assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
        assert history.epoch == expected.epoch
        difference = relative_difference(history.history["loss"], expected.history["loss"])
        assert difference <= 1e-5, (history.history, expected.history)
    # Against each other: the same steps, only fewer calls.
    assert relative_difference(auto[0].get_weights(), one[0].get_weights()) <= 1e-6


@pytest.mark.usefixtures("_loop_at_any_length")
def test_random_layers_draw_the_same_per_step_with_several_steps_per_call() -> None:
    x, y = _data(seed=16)
    weights = []
    for steps in (None, 1):
        model, watcher = _model(dropout=True), _StepsPerCall()
        tfscale.fit(
            model, x, y, batch_size=_BATCH, epochs=2, verbose=0, callbacks=[watcher],
            strategy=strategy_for(2), steps_per_execution=steps,
        )  # fmt: skip
        assert watcher.seen == [AUTO_STEPS_PER_EXECUTION if steps is None else 1] * 2
        weights.append(model.get_weights())
    assert relative_difference(weights[0], weights[1]) <= 1e-6


def test_a_callback_watching_batches_sees_every_batch() -> None:
    x, y = _data(seed=12)
    model, batches, watcher = _model(), _Batches(), _StepsPerCall()
    tfscale.fit(
        model, x, y, batch_size=_BATCH, epochs=2, verbose=0, callbacks=[batches, watcher],
        strategy=strategy_for(2),
    )  # fmt: skip
    assert watcher.seen == [1, 1]
    assert batches.batches == list(range(13)) * 2


def _decided(model: keras.Model, **overrides: Any) -> int | None:
    x, y = _data(seed=13)
    arguments: dict[str, Any] = {
        "callbacks": [],
        "verbose": 0,
        "fit_arguments": {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(_BATCH)},
        "checkpointing": False,
        "epochs": AUTO_MIN_STEPS,  # of 13 steps each: long enough
    }
    arguments.update(overrides)
    return auto_steps_per_execution(model, strategy_for(2), **arguments)


def test_one_step_per_call_wherever_steps_per_call_would_show() -> None:
    model = _model()
    x, y = _data(seed=14)
    assert _decided(model) == AUTO_STEPS_PER_EXECUTION
    assert _decided(model, verbose=2) == AUTO_STEPS_PER_EXECUTION  # a line per epoch
    # A bar drawn per batch ("auto" is 1), a callback with a batch hook, Keras's own
    # per-batch callbacks, a step checkpoint, validation, an epoch of unknown length.
    assert _decided(model, verbose=1) is None
    assert _decided(model, verbose="auto") is None
    assert _decided(model, callbacks=[_Batches()]) is None
    assert _decided(model, callbacks=[keras.callbacks.TerminateOnNaN()]) is None
    assert _decided(model, callbacks=[keras.callbacks.CallbackList([])]) is None
    assert _decided(model, checkpointing=True) is None
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(_BATCH)
    with_validation = {"x": dataset, "validation_data": dataset}
    assert _decided(model, fit_arguments=with_validation) is None
    assert _decided(model, fit_arguments={"x": dataset, "validation_split": 0.2}) is None
    assert _decided(model, fit_arguments={"x": dataset.repeat()}) is None
    assert (
        _decided(model, fit_arguments={"x": dataset.repeat(), "steps_per_epoch": 5})
        == AUTO_STEPS_PER_EXECUTION
    )
    # steps_per_epoch over a dataset of known length: Keras would count whole calls against
    # its length and restart the iterator each epoch instead of continuing it.
    assert _decided(model, fit_arguments={"x": dataset, "steps_per_epoch": 5}) is None
    # Epoch-level callbacks and tfscale's own do not watch batches.
    epoch_level = [keras.callbacks.History(), keras.callbacks.ReduceLROnPlateau(), _StepsPerCall()]
    assert _decided(model, callbacks=epoch_level) == AUTO_STEPS_PER_EXECUTION
    # compile()'s own steps_per_execution is the user's.
    assert _decided(_model(steps_per_execution=4)) is None


def test_a_short_fit_runs_one_step_per_call() -> None:
    """Below ``AUTO_MIN_STEPS`` steps in all (epochs x steps per epoch) the loop's trace
    costs more than its fewer calls save: one step per call."""
    model = _model()
    x, y = _data(seed=18)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(_BATCH)  # 13 steps an epoch
    enough = -(-AUTO_MIN_STEPS // 13)
    assert _decided(model, epochs=enough) == AUTO_STEPS_PER_EXECUTION
    assert _decided(model, epochs=enough - 1) is None
    repeated = {"x": dataset.repeat(), "steps_per_epoch": AUTO_MIN_STEPS}
    assert _decided(model, fit_arguments=repeated, epochs=1) == AUTO_STEPS_PER_EXECUTION
    repeated["steps_per_epoch"] = AUTO_MIN_STEPS - 1
    assert _decided(model, fit_arguments=repeated, epochs=1) is None
    # And in a fit: 2 epochs of 13 steps, one step per call.
    watcher = _StepsPerCall()
    tfscale.fit(
        model, x, y, batch_size=_BATCH, epochs=2, verbose=0, callbacks=[watcher],
        strategy=strategy_for(2),
    )  # fmt: skip
    assert watcher.seen == [1, 1]


@pytest.mark.full(
    "tests/training/test_steps_per_call.py::"
    "test_several_steps_per_call_give_one_devices_weights_history_and_updates[arrays]",
)
def test_compiles_steps_per_execution_and_an_explicit_one_are_kept() -> None:
    x, y = _data(seed=15)
    for compiled, given, expected in ((4, None, 4), (1, 1, 1), (1, 3, 3)):
        model, watcher = _model(compiled), _StepsPerCall()
        tfscale.fit(
            model, x, y, batch_size=_BATCH, epochs=1, verbose=0, callbacks=[watcher],
            strategy=strategy_for(2), steps_per_execution=given,
        )  # fmt: skip
        assert watcher.seen == [expected]
        assert int(model.optimizer.iterations.numpy()) == 13


class _Traced(keras.layers.Layer):  # type: ignore[misc]
    """Counts its calls in Python: each trace of a step calls it once per replica."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        self.calls += 1
        return inputs


@pytest.mark.usefixtures("_loop_at_any_length")
def test_several_steps_per_call_trace_keras_own_step_once() -> None:
    """The step is traced inside the call's loop only: as often as for one step per call
    (tracing it a second time for the first step doubled the start of a short fit)."""
    x, y = _data(seed=17)
    calls, weights = {}, {}
    for steps in (None, 1):
        keras.utils.set_random_seed(7)
        traced = _Traced()
        model = keras.Sequential([keras.Input((8,)), traced, keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
        watcher = _StepsPerCall()
        tfscale.fit(
            model, x, y, batch_size=_BATCH, epochs=2, verbose=0, callbacks=[watcher],
            strategy=strategy_for(2), steps_per_execution=steps,
        )  # fmt: skip
        assert watcher.seen == [AUTO_STEPS_PER_EXECUTION if steps is None else 1] * 2
        calls[steps], weights[steps] = traced.calls, model.get_weights()
    assert calls[1] > 0 and calls[None] == calls[1], calls
    # The loop of steps trains as one step per call does (the same seed, the same batches).
    assert relative_difference(weights[None], weights[1]) <= 1e-6


class _CustomLogs(keras.Model):  # type: ignore[misc]
    """Keras's trainer_test ``CustomTrainTestStepModel``: its train_step adds a Python float
    (and here a NumPy value) to Keras's logs."""

    def __init__(self) -> None:
        super().__init__(name="custom_logs")
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))

    def train_step(self, data: Any) -> Any:
        logs = super().train_step(data)
        logs["my_custom_metric"] = 10.0
        logs["numpy_value"] = np.float32(3.5)
        return logs


def _custom_logs_model() -> keras.Model:
    keras.utils.set_random_seed(7)
    model = _CustomLogs()
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


@pytest.mark.parametrize(
    "steps",
    tiered(
        [None, 1, 4],
        {"1": "None", "4": "None"},
        "tests/training/test_steps_per_call.py::"
        "test_python_and_numpy_numbers_in_a_steps_logs_give_one_devices_history",
        ids=["None", "1", "4"],
    ),
)
def test_python_and_numpy_numbers_in_a_steps_logs_give_one_devices_history(
    steps: int | None,
) -> None:
    """Several steps per call carry the step's logs through a while loop; Python and NumPy
    numbers there failed with ``'float' object has no attribute 'shape'``."""
    x, y = _data(seed=12)
    reference = _custom_logs_model()
    with tf.device("/device:CPU:0"):
        expected = reference.fit(x, y, batch_size=_BATCH, epochs=2, shuffle=False, verbose=0)
    model = _custom_logs_model()
    history = tfscale.fit(
        model, x, y, batch_size=_BATCH, epochs=2, shuffle=False, verbose=0,
        strategy=strategy_for(2), steps_per_execution=steps,
    )  # fmt: skip
    assert history.history["my_custom_metric"] == expected.history["my_custom_metric"] == [10.0] * 2
    assert history.history["numpy_value"] == expected.history["numpy_value"] == [3.5] * 2
    assert relative_difference(history.history["loss"], expected.history["loss"]) <= 1e-5
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
