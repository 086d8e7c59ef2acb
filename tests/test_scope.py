"""check_scope / fix_scope on a real 2-replica MirroredStrategy over logical CPU devices."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.scope import variable_origin
from tfscale.testing import mirrored_on_cpus, relative_difference

# One worker runs this module (make test: --dist loadgroup), so its module fixture runs once.
pytestmark = [
    pytest.mark.tf,
    pytest.mark.xdist_group("scope"),
]


@pytest.fixture(scope="module")
def mirrored() -> Iterator[tf.distribute.MirroredStrategy]:
    yield mirrored_on_cpus(2)


def _build(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Dense(2, name="head"),
        ]
    )


def _data(seed: int, n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, 5)).astype("float32"),
        rng.normal(size=(n, 2)).astype("float32"),
    )


def test_check_scope_names_variables_devices_and_site_of_model_built_outside(
    mirrored: tf.distribute.MirroredStrategy,
) -> None:
    with tfscale.track_variable_creation():
        model = _build()  # the error names this line as the caller
    call_line = test_check_scope_names_variables_devices_and_site_of_model_built_outside.__code__
    site_line = _build.__code__.co_firstlineno + 2  # the `return keras.Sequential(` line
    with pytest.raises(tfscale.ScopeError) as caught:
        tfscale.check_scope(model, mirrored)
    message = str(caught.value)
    assert f"{len(model.weights)} of {len(model.weights)} variables" in message
    assert "created outside strategy.scope()" in message
    assert "hidden/kernel" in message
    assert "/device:CPU:0" in message
    assert (
        f"created at tests/test_scope.py:{site_line} in _build, called from "
        f"tests/test_scope.py:{call_line.co_firstlineno + 4}" in message
    )
    assert "MirroredStrategy (2 replicas on /device:CPU:0, /device:CPU:1)" in message
    assert "tfscale.fix_scope(model, strategy)" in message
    origin = variable_origin(model.weights[0])
    assert origin is not None and origin.strategy is None and origin.num_replicas == 1


def test_check_scope_untracked_model_says_site_is_unknown_and_uses_current_scope(
    mirrored: tf.distribute.MirroredStrategy,
) -> None:
    model = _build()
    with mirrored.scope(), pytest.raises(tfscale.ScopeError, match="creation sites unknown"):
        tfscale.check_scope(model)  # strategy taken from the active scope


def test_check_scope_passes_model_built_inside_and_single_replica_strategies(
    mirrored: tf.distribute.MirroredStrategy,
) -> None:
    with tfscale.track_variable_creation(), mirrored.scope():
        inside = _build()
        inside.compile(optimizer="adam", loss="mse")
    tfscale.check_scope(inside, mirrored)
    tfscale.check_scope(inside)  # strategy taken from the model
    origin = variable_origin(inside.weights[0])
    assert origin is not None and origin.strategy == "MirroredStrategy"
    assert origin.num_replicas == 2
    outside = _build()
    tfscale.check_scope(outside)  # no strategy anywhere: the default one
    tfscale.check_scope(outside, tf.distribute.OneDeviceStrategy("/device:CPU:0"))
    # Variables owned by a multi-replica strategy are wrong for another strategy.
    with pytest.raises(tfscale.ScopeError, match="belong to another MirroredStrategy"):
        tfscale.check_scope(inside, tf.distribute.OneDeviceStrategy("/device:CPU:0"))


def test_check_scope_rejects_non_models() -> None:
    with pytest.raises(tfscale.ScopeError, match="Received: str"):
        tfscale.check_scope("model.keras")


def _train_step(model: keras.Model, seed: int) -> None:
    x, y = _data(seed)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def _optimizer_state(model: keras.Model) -> list[Any]:
    return [np.asarray(v.numpy()) for v in model.optimizer.variables]


def test_fix_scope_mirrors_variables_keeps_predictions_compile_and_optimizer_state(
    mirrored: tf.distribute.MirroredStrategy,
) -> None:
    model = _build(seed=3)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.01, beta_1=0.8),
        loss="mse",
        metrics=[keras.metrics.MeanAbsoluteError(name="mae")],
        steps_per_execution=2,
        jit_compile=False,
    )
    _train_step(model, seed=4)  # builds the optimizer: iterations and moments are non-zero

    fixed = tfscale.fix_scope(model, mirrored)

    tfscale.check_scope(fixed, mirrored)
    assert all(mirrored.extended.variable_created_in_scope(v.value) for v in fixed.weights)
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in fixed.weights)
    x, _ = _data(seed=5)
    assert relative_difference(fixed.predict(x, verbose=0), model.predict(x, verbose=0)) <= 1e-6
    assert relative_difference(fixed.get_weights(), model.get_weights()) == 0.0
    # Compile settings.
    assert fixed.optimizer is not model.optimizer
    assert fixed.optimizer.get_config() == model.optimizer.get_config()
    assert fixed.loss == "mse" and fixed.steps_per_execution == 2
    assert fixed.jit_compile is False
    # Optimizer state (iterations, Adam moments), copied and owned by the strategy.
    assert int(fixed.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 2
    assert relative_difference(_optimizer_state(fixed), _optimizer_state(model)) == 0.0
    assert all(
        mirrored.extended.variable_created_in_scope(v.value) for v in fixed.optimizer.variables
    )
    # The fixed model trains under the strategy, and metrics come from the compile settings.
    # steps_per_execution > 1 under MirroredStrategy fails inside Keras 3.15 itself ("You
    # must feed a value for placeholder tensor", keras-team/keras#19246), so 1 here.
    fixed.steps_per_execution = 1
    history = fixed.fit(*_data(seed=6), batch_size=8, epochs=1, verbose=0)
    assert {"loss", "mae"} <= set(history.history)


class _WithConfig(keras.Model):
    def __init__(self, units: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units)

    def call(self, inputs: Any) -> Any:
        return self.dense(inputs)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "units": self.units}


class _WithoutConfig(keras.Model):
    def __init__(self, layer: keras.layers.Layer) -> None:
        super().__init__()
        self.inner = layer

    def call(self, inputs: Any) -> Any:
        return self.inner(inputs)


def test_fix_scope_subclassed_models(mirrored: tf.distribute.MirroredStrategy) -> None:
    x, _ = _data(seed=7)
    keras.utils.set_random_seed(1)
    with_config = _WithConfig(3)
    expected = with_config(x)
    fixed = tfscale.fix_scope(with_config, mirrored)
    assert isinstance(fixed, _WithConfig)
    assert all(mirrored.extended.variable_created_in_scope(v.value) for v in fixed.weights)
    assert relative_difference(fixed(x), expected) <= 1e-6

    without_config = _WithoutConfig(keras.layers.Dense(3))
    without_config(x)
    with pytest.raises(tfscale.ScopeError, match="cannot rebuild _WithoutConfig") as caught:
        tfscale.fix_scope(without_config, mirrored)
    assert "with strategy.scope():" in str(caught.value)


def test_fix_scope_functional_model_with_lambda_loss_and_unbuilt_optimizer(
    mirrored: tf.distribute.MirroredStrategy,
) -> None:
    keras.utils.set_random_seed(2)
    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(2)(keras.layers.Dense(4, activation="tanh")(inputs))
    model = keras.Model(inputs, outputs)
    # Per-sample: a loss function that returns one scalar for the batch gets gradients
    # multiplied by the replica count under MirroredStrategy in Keras 3.15.
    loss = lambda y, p: keras.ops.mean(keras.ops.abs(y - p), axis=-1)  # noqa: E731
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss)

    fixed = tfscale.fix_scope(model, mirrored)

    assert fixed.loss is loss and not fixed.optimizer.built
    assert all(mirrored.extended.variable_created_in_scope(v.value) for v in fixed.weights)
    x, y = _data(seed=8)
    assert relative_difference(fixed.predict(x, verbose=0), model.predict(x, verbose=0)) <= 1e-6
    # One step from the same weights gives the same weights as the single-device original.
    fixed.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert relative_difference(fixed.get_weights(), model.get_weights()) <= 1e-5
