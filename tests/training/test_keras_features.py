"""What Keras users bring to tfscale.fit: step overrides, compile options, optimizer wrappers,
callbacks and BatchNormalization, each against one-device ``model.fit`` on the same data."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.interop import internals
from tfscale.testing import relative_difference
from tfscale.training.data import RELEASE_THREAD
from tfscale.training.prepare import prepared

from .helpers import strategy_for

pytestmark = pytest.mark.tf

FEATURES = 6


def _data(n: int = 64, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def _regressor(cls: type = keras.Model, **layers: Any) -> keras.Model:
    keras.utils.set_random_seed(5)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh", **layers)(inputs)
    return cls(inputs, keras.layers.Dense(1)(hidden))


def _pair(build: Any, fit: Any, **tfscale_options: Any) -> tuple[Any, Any, Any, Any]:
    """One-device model.fit and tfscale.fit over 2 replicas of the same fresh model.

    ``fit`` is model.fit's keyword arguments, or a function making them (fresh callbacks).
    """
    arguments = fit if callable(fit) else lambda: fit
    reference = build()
    with tf.device("/device:CPU:0"):
        expected = reference.fit(verbose=0, shuffle=False, **arguments())
    model = build()
    history = tfscale.fit(
        model, verbose=0, shuffle=False, strategy=strategy_for(2), **arguments(),
        **tfscale_options,
    )  # fmt: skip
    return reference, expected, model, history


def _same_history(got: Any, expected: Any, tolerance: float = 1e-5) -> None:
    assert set(got.history) == set(expected.history)
    for key, values in expected.history.items():
        assert relative_difference(got.history[key], values) <= tolerance, key


# -- step overrides ---------------------------------------------------------------------------
class TrackedModel(keras.Model):
    """keras-io "customizing what happens in fit": a train_step with its own trackers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    @property
    def metrics(self) -> list[Any]:
        return [self.loss_tracker, self.mae_metric]

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = keras.losses.mean_squared_error(y, y_pred)
            loss = tf.reduce_mean(loss)  # a plain per-replica mean, as on one device
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}


class ManualLossModel(keras.Model):
    """compute_loss written by hand: a mean and an extra penalty, no replica scaling."""

    def compute_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool) -> Any:
        del x, sample_weight, training
        penalty = 0.01 * tf.add_n([tf.reduce_sum(w**2) for w in self.trainable_weights])
        return tf.reduce_mean(tf.square(y - y_pred)) + penalty


class PenaltyLayer(keras.layers.Layer):
    """add_loss of a Keras Loss object: Keras scales it for the replicas twice."""

    def call(self, inputs: Any) -> Any:
        self.add_loss(keras.losses.MeanSquaredError()(tf.zeros_like(inputs), inputs))
        return inputs


def _penalized() -> keras.Model:
    keras.utils.set_random_seed(5)
    dense = keras.layers.Dense
    return keras.Sequential([keras.Input((FEATURES,)), dense(4), PenaltyLayer(), dense(1)])


def _compiled(model: keras.Model, **compile_args: Any) -> keras.Model:
    model.compile(**{"optimizer": keras.optimizers.Adam(0.01), "loss": "mse", **compile_args})
    return model


@pytest.mark.parametrize(
    "build",
    [
        lambda: _compiled(_regressor(TrackedModel)),
        lambda: _compiled(_regressor(ManualLossModel), metrics=["mae"]),
        lambda: _compiled(_penalized()),
    ],
    ids=["train_step-with-trackers", "compute_loss-by-hand", "add_loss-of-a-Loss"],
)
def test_step_and_loss_overrides_give_one_device_weights_and_history(build: Any) -> None:
    x, y = _data()
    reference, expected, model, history = _pair(
        build, {"x": x, "y": y, "batch_size": 16, "epochs": 2}
    )
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    _same_history(history, expected)


class ManualUpdateModel(keras.Model):
    """A train_step that updates weights without the optimizer."""

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(y - self(x, training=True)))
        for variable, gradient in zip(
            self.trainable_variables, tape.gradient(loss, self.trainable_variables), strict=True
        ):
            variable.assign_sub(0.01 * gradient)
        return {"loss": loss}


def test_accumulation_with_a_step_that_bypasses_the_optimizer_is_refused_before_training() -> None:
    x, y = _data()
    model = _compiled(_regressor(ManualUpdateModel))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(tfscale.TrainingError, match="never calls") as info:
        tfscale.fit(
            model, x, y, batch_size=16, accumulation_steps=2, strategy=strategy_for(2), verbose=0
        )
    assert "accumulation_steps=2" in str(info.value)
    assert relative_difference(model.get_weights(), before) == 0.0


# -- compile options and optimizer wrappers ----------------------------------------------------
def test_use_ema_is_finalized_and_swap_ema_weights_validates_with_the_averages() -> None:
    x, y = _data()

    def build() -> keras.Model:
        return _compiled(
            _regressor(), optimizer=keras.optimizers.SGD(0.05, use_ema=True, ema_momentum=0.9)
        )

    def fit() -> dict[str, Any]:
        return {
            "x": x,
            "y": y,
            "batch_size": 16,
            "epochs": 2,
            "validation_data": (x[:32], y[:32]),
            "callbacks": [keras.callbacks.SwapEMAWeights(swap_on_epoch=True)],
        }

    reference, expected, model, history = _pair(build, fit)
    # finalize_variable_values ran: the weights are the moving averages, as on one device.
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    _same_history(history, expected)


def test_a_users_loss_scale_optimizer_trains_like_one_device() -> None:
    x, y = _data()

    def build() -> keras.Model:
        model = _regressor()
        model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)), "mse")
        return model

    reference, expected, model, history = _pair(build, {"x": x, "y": y, "batch_size": 16})
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    _same_history(history, expected)


class _Batches(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.ends: list[int] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.ends.append(batch)


def _has_xla_function(function: Any) -> bool:
    library = function.graph.as_graph_def().library.function
    return any(f.attr["_XlaMustCompile"].b for f in library if "_XlaMustCompile" in f.attr)


@pytest.mark.full(
    "tests/training/test_xla.py::test_jit_trains_to_the_weights_of_keras_one_device_jit[2-conv]",
    "tests/training/test_steps_per_call.py::"
    "test_several_steps_per_call_give_one_devices_weights_history_and_updates[arrays]",
)
def test_compile_options_jit_compile_and_steps_per_execution_are_honoured() -> None:
    x, y = _data(96)

    def build() -> keras.Model:
        return _compiled(_regressor(), jit_compile=True, steps_per_execution=3)

    batches = _Batches()
    reference, _, model, _ = _pair(
        build, {"x": x, "y": y, "batch_size": 16, "callbacks": [batches]}
    )
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    assert int(model.optimizer.iterations.numpy()) == 6
    # Batch hooks once per execution, numbered as model.fit numbers them (both runs fed the
    # same callback): 6 steps in calls of 3, [2, 5] (Keras 3.10 numbers them [0, 3]).
    assert len(batches.ends) == 4 and batches.ends[2:] == batches.ends[:2]
    assert batches.ends[:2] in ([2, 5], [0, 3])
    assert model.train_function.options.jit_compile
    function = model.train_function._multi.get_concrete_function(
        iter(strategy_for(2).experimental_distribute_dataset(tf.data.Dataset.from_tensors((x, y)))),
        tf.constant(3),
    )
    assert _has_xla_function(function)


# -- callbacks -------------------------------------------------------------------------------
class _StopAt(keras.callbacks.Callback):
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


@pytest.mark.full(
    "tests/training/test_checkpoint.py::"
    "test_crash_mid_epoch_resumes_from_the_last_step_checkpoint[mid-run]",
)
def test_backup_and_restore_resumes_at_its_saved_epoch(tmp_path: Path) -> None:
    x, y = _data()
    strategy = strategy_for(2)
    backup = str(tmp_path / "backup")
    model = _compiled(_regressor())
    with pytest.raises(RuntimeError, match="interrupted"):
        tfscale.fit(
            model,
            x,
            y,
            batch_size=16,
            epochs=4,
            shuffle=False,
            callbacks=[keras.callbacks.BackupAndRestore(backup), _StopAt(1)],
            strategy=strategy,
            verbose=0,
        )
    resumed = _compiled(_regressor())
    history = tfscale.fit(
        resumed,
        x,
        y,
        batch_size=16,
        epochs=4,
        shuffle=False,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
        strategy=strategy,
        verbose=0,
    )
    assert history.epoch == [2, 3]
    whole = _compiled(_regressor())
    tfscale.fit(whole, x, y, batch_size=16, epochs=4, shuffle=False, strategy=strategy, verbose=0)
    assert relative_difference(resumed.get_weights(), whole.get_weights()) <= 1e-5


def test_terminate_on_nan_stops_and_returns_the_history_instead_of_raising() -> None:
    x, y = _data()
    y = y.copy()
    y[40] = np.nan  # the third batch of 16
    model = _compiled(_regressor())
    history = tfscale.fit(
        model,
        x,
        y,
        batch_size=16,
        epochs=3,
        shuffle=False,
        callbacks=[keras.callbacks.TerminateOnNaN()],
        strategy=strategy_for(2),
        verbose=0,
    )
    assert model.stop_training and int(model.optimizer.iterations.numpy()) == 2
    assert np.isnan(history.history["loss"][0])
    assert all(np.isfinite(w).all() for w in model.get_weights())
    with pytest.raises(tfscale.NonFiniteLossError, match=r"update 3 \(batch 2 of epoch 0\)"):
        tfscale.fit(
            _compiled(_regressor()), x, y, batch_size=16, shuffle=False,
            strategy=strategy_for(2), verbose=0,
        )  # fmt: skip


def test_a_prepared_models_fit_stops_at_a_non_finite_update_as_tfscale_fit_does() -> None:
    # It used to skip the update silently (the optimizer counted it) and end normally (#25.3).
    x, y = _data()
    y = y.copy()
    y[40] = np.nan  # the third batch of 16
    model = tfscale.prepare(_compiled(_regressor()), strategy_for(2))
    with pytest.raises(tfscale.NonFiniteLossError, match=r"update 3 \(batch 2 of epoch 0\)"):
        model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert all(np.isfinite(w).all() for w in model.get_weights())
    # Not left halted: the next fit on clean data trains.
    model.fit(x[:32], y[:32], batch_size=16, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4


def test_a_prepared_models_fit_with_terminate_on_nan_stops_quietly() -> None:
    x, y = _data()
    y = y.copy()
    y[40] = np.nan
    model = tfscale.prepare(_compiled(_regressor()), strategy_for(2))
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.TerminateOnNaN()])  # fmt: skip
    assert model.stop_training and int(model.optimizer.iterations.numpy()) == 2
    assert np.isnan(history.history["loss"][0]) and len(history.history["loss"]) == 1
    assert all(np.isfinite(w).all() for w in model.get_weights())


def _mse_plus_log_of_smallest_label(y_true: Any, y_pred: Any) -> Any:
    """NaN where a label is negative, through a term with no gradient."""
    penalty = tf.stop_gradient(tf.math.log(tf.reduce_min(y_true)))
    return keras.losses.mean_squared_error(y_true, y_pred) + penalty


def test_a_nan_loss_with_a_finite_gradient_is_reported_as_applied() -> None:
    x, y = _data()
    y = np.abs(y) + 0.1
    y[40] = -1.0  # the third batch of 16: its loss is NaN, its gradient finite
    model = _compiled(_regressor(), loss=_mse_plus_log_of_smallest_label)
    with pytest.raises(tfscale.NonFiniteLossError, match="the update was applied") as info:
        tfscale.fit(model, x, y, batch_size=16, shuffle=False, strategy=strategy_for(2), verbose=0)
    assert "of epoch 0, but its gradient was finite" in str(info.value)
    assert int(model.optimizer.iterations.numpy()) >= 3
    assert all(np.isfinite(w).all() for w in model.get_weights())
    # The error, still held here (`info`), does not keep the fit's input alive: its iterator
    # is released as after a fit that returns, not later by the garbage collector.
    for thread in threading.enumerate():
        if thread.name == RELEASE_THREAD:
            thread.join(60)
    state = prepared(model)
    assert state is not None and state.epoch_iterator is not None
    assert state.epoch_iterator() is None


# -- reuse of compiled functions -----------------------------------------------------------------
def test_a_second_fit_reuses_the_compiled_functions() -> None:
    x, y = _data()
    model = _compiled(_regressor())
    strategy = strategy_for(2)
    fit = {"batch_size": 16, "epochs": 2, "validation_data": (x, y), "verbose": 0}
    tfscale.fit(model, x, y, strategy=strategy, **fit)
    train, test = model.train_function, model.test_function
    traces = (
        train._multi.experimental_get_tracing_count(),
        test._multi.experimental_get_tracing_count(),
    )
    tfscale.fit(model, x, y, strategy=strategy, **fit)
    assert model.train_function is train and model.test_function is test
    assert traces == (
        train._multi.experimental_get_tracing_count(),
        test._multi.experimental_get_tracing_count(),
    )


# -- BatchNormalization and sparse gradients ---------------------------------------------------
def _batchnorm() -> keras.Model:
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, use_bias=False),  # a bias before BN gets no gradient
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    return _compiled(model)


def test_sync_batchnorm_normalizes_with_the_global_batch_as_one_device() -> None:
    x, y = _data()
    fit = {"x": x, "y": y, "batch_size": 16, "epochs": 2}
    reference, _, synced, _ = _pair(_batchnorm, fit, sync_batchnorm=True)
    assert relative_difference(synced.get_weights(), reference.get_weights()) <= 1e-5
    _, _, local, _ = _pair(_batchnorm, fit)  # Keras's default: each replica's own statistics
    assert relative_difference(local.get_weights(), reference.get_weights()) > 1e-4


class _Penalty(keras.layers.Layer):
    """An ``add_loss`` of a mean: half the activations' mean square."""

    def call(self, inputs: Any) -> Any:
        self.add_loss(0.5 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def _penalized_batchnorm(synchronized: bool = False) -> keras.Model:
    """A penalty before and after a BatchNormalization layer."""
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, use_bias=False),
            _Penalty(),
            keras.layers.BatchNormalization(synchronized=synchronized),
            _Penalty(),
            keras.layers.Dense(1),
        ]
    )
    return model.compile("sgd", "mse") or model


@pytest.mark.full(
    "tests/training/test_keras_features.py::"
    "test_sync_batchnorm_normalizes_with_the_global_batch_as_one_device",
    "tests/training/test_custom_loops.py::"
    "test_added_losses_stay_each_replicas_own_in_a_prepared_loop",
)
def test_added_losses_stay_each_replicas_own_around_a_synchronized_batchnorm() -> None:
    """A layer's added losses are one list that MirroredStrategy's replica threads share, and
    the synchronized BatchNormalization's all-reduce makes the threads interleave: a replica
    entering the model cleared the penalty another had added before the layer (its gradient
    lacked it: the weights ended 5.6e-3 apart) and read the one added after it twice (the
    epochs' losses 3% and 6% above one device's). tfscale keeps each replica's own list
    (``internals.losses_per_replica``); Keras's own fit under the strategy does both."""
    x, y = _data()
    fit = {"x": x, "y": y, "batch_size": 16, "epochs": 2}
    reference, expected, model, history = _pair(_penalized_batchnorm, fit, sync_batchnorm=True)
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    _same_history(history, expected)

    # Keras's own fit, the probe: only where no prepared loop or model of an earlier test is
    # still alive in this process (a fit's input-release thread may hold one a while), whose
    # switch (internals.losses_per_thread) keeps every thread's losses its own, Keras's too.
    gc.collect()
    if internals.losses_kept_per_thread():
        return
    with strategy_for(2).scope():
        own = _penalized_batchnorm(synchronized=True)
    keras_history = own.fit(verbose=0, shuffle=False, **fit)
    inflated = relative_difference(keras_history.history["loss"], expected.history["loss"])
    assert inflated > 1e-3  # if Keras fixes it: docs/training.md's row
    assert relative_difference(own.get_weights(), reference.get_weights()) > 1e-3


class RecordingSGD(keras.optimizers.SGD):  # type: ignore[misc]
    """SGD that records the type of each gradient it is given (at trace time)."""

    seen: list[str] = []  # noqa: RUF012

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        RecordingSGD.seen.append(f"{type(gradient).__name__} {tuple(variable.shape)}")
        super().update_step(gradient, variable, learning_rate)


def test_embedding_gradients_stay_sparse_through_the_all_reduce() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 500, (32, 5)).astype("int32")
    y = rng.normal(size=(32, 1)).astype("float32")

    def build() -> keras.Model:
        keras.utils.set_random_seed(5)
        inputs = keras.Input((5,), dtype="int32")
        hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(500, 4)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(RecordingSGD(0.1), "mse")
        return model

    RecordingSGD.seen.clear()
    reference, _, model, _ = _pair(build, {"x": x, "y": y, "batch_size": 16})
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    # The embedding's update got slices on one device and on each of the 2 replicas.
    embedding = [seen for seen in RecordingSGD.seen if seen.endswith("(500, 4)")]
    assert embedding == ["IndexedSlices (500, 4)"] * 3


@pytest.mark.full(
    "tests/training/test_kerashub.py::"
    "test_tfscale_fit_matches_one_device_model_fit[gpt2_causal_lm_adam]",
)
def test_a_transformer_block_trains_with_gradients_of_unknown_static_shape() -> None:
    """Dense on (batch, time, features) inputs has a kernel gradient of static shape (None, n)."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 50, (32, 6)).astype("int32")
    y = rng.integers(0, 2, (32,)).astype("int32")

    def build() -> keras.Model:
        keras.utils.set_random_seed(5)
        inputs = keras.Input((6,), dtype="int32")
        h = keras.layers.Embedding(50, 8)(inputs)
        attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
        h = keras.layers.LayerNormalization()(h + attended)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(8)(keras.layers.Dense(16)(h)))
        outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(inputs, outputs)
        # SGD: the attention's key bias gets an exactly zero gradient (softmax ignores a
        # constant shift), and Adam would turn its rounding noise into full-size steps.
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    reference, expected, model, history = _pair(build, {"x": x, "y": y, "batch_size": 8})
    # Over the whole model: the key bias stays at rounding noise (1e-11) on both sides, where
    # a per-array relative difference would compare noise with noise.
    flat = [np.concatenate([w.ravel() for w in m.get_weights()]) for m in (model, reference)]
    assert relative_difference(flat[0], flat[1]) <= 1e-6
    _same_history(history, expected)


class _Batches16(keras.utils.PyDataset):  # type: ignore[misc]
    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        super().__init__()
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x) // 16

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        part = slice(index * 16, (index + 1) * 16)
        return self.x[part], self.y[part]


@pytest.mark.full(
    "tests/training/test_inputs.py::"
    "test_generator_inputs_leave_the_users_arrays_unchanged_and_train_as_one_device"
    "[generator-prepare]",
)
def test_generators_and_py_datasets_lose_no_batch() -> None:
    """Keras's own fit under a strategy reads one batch of a generator to build the model
    and then trains without it; tfscale builds from the input's element spec."""
    x, y = _data()

    def generator() -> Any:
        for start in range(0, len(x), 16):
            yield x[start : start + 16], y[start : start + 16]

    for make in (generator, lambda: _Batches16(x, y)):
        reference, expected, model, history = _pair(
            lambda: _compiled(_regressor()),
            lambda: {"x": make()},  # noqa: B023
        )
        assert int(model.optimizer.iterations.numpy()) == len(x) // 16
        assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
        _same_history(history, expected)


def _masked_regressor() -> keras.Model:
    """A regressor with a boolean mask input, as KerasHub's models take ``padding_mask``."""
    keras.utils.set_random_seed(5)
    values = keras.Input((FEATURES,), name="values")
    mask = keras.Input((FEATURES,), dtype="bool", name="mask")
    kept = keras.layers.Lambda(lambda t: t[0] * keras.ops.cast(t[1], t[0].dtype))([values, mask])
    hidden = keras.layers.Dense(8, activation="tanh")(kept)
    return _compiled(keras.Model([values, mask], keras.layers.Dense(1)(hidden)))


@pytest.mark.full(
    "tests/training/test_kerashub.py::"
    "test_tfscale_fit_matches_one_device_model_fit[bert_classifier_adam]",
)
def test_a_boolean_input_trains_as_one_device_where_keras_own_fit_fails() -> None:
    """Keras's own fit under a strategy averages the first batch over the replicas to build
    the model (``_maybe_symbolic_build``), which no boolean tensor survives (``AddN`` of
    bool): every model with a boolean input, KerasHub's ``padding_mask`` among them, fails
    before its first step. tfscale builds from the input's element spec."""
    x, y = _data()
    mask = np.random.default_rng(8).random(x.shape) > 0.3
    fit = {"x": {"values": x, "mask": mask}, "y": y, "batch_size": 16, "epochs": 2}
    reference, expected, model, history = _pair(_masked_regressor, fit)
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    _same_history(history, expected)

    prepared_model = _masked_regressor()
    tfscale.prepare(prepared_model, strategy=strategy_for(2))
    prepared_model.fit(verbose=0, shuffle=False, **fit)
    assert relative_difference(prepared_model.get_weights(), reference.get_weights()) <= 1e-5

    with strategy_for(2).scope():
        own = _masked_regressor()
    with pytest.raises(tf.errors.InvalidArgumentError, match="of bool is not in the list"):
        own.fit(verbose=0, shuffle=False, **fit)  # if Keras fixes it: docs/training.md's row
