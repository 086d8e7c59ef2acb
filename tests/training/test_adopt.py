"""A model trained, or saved and loaded, outside any strategy (or under another one) continues
under tfscale as it would on one device: ``adopt`` moves its variables into the strategy and
its optimizer's state and tables with them.

Each case trains the first epoch outside any scope and the second under ``tfscale.fit`` (or a
prepared custom loop) on 2 replicas, and compares with one device training both epochs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import relative_difference

from .helpers import DATA, batches, reference_weights, strategy_for, tiered, tiny_model

pytestmark = pytest.mark.tf

BATCH = 32
TOLERANCE = 1e-5


def test_model_built_outside_the_scope_trains_in_place_and_keeps_its_optimizer() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    outside = tiny_model(None, "adam", lr=0.01)
    optimizer = outside.optimizer
    for _ in range(2):  # the second call continues Adam where the first stopped
        tfscale.fit(outside, batches(x, y, 32), steps_per_epoch=3, strategy=strategy, verbose=0)
    assert outside.optimizer is optimizer
    assert int(optimizer.iterations.numpy()) == 6
    expected = reference_weights(x, y, batch=32, steps=3, optimizer="adam", lr=0.01, epochs=2)
    assert relative_difference(outside.get_weights(), expected) <= 1e-5
    kernel = outside.trainable_variables[0].value
    assert strategy.extended.variable_created_in_scope(kernel)


def _adamw_sparing_the_first_kernel() -> Any:
    model = tiny_model(None, keras.optimizers.AdamW(0.01, weight_decay=0.5))
    model.optimizer.exclude_from_weight_decay(var_list=[model.trainable_variables[0]])
    return model


def _loss_scaled_adam() -> Any:
    return tiny_model(None, keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)))


BUILDS: dict[str, Callable[[], Any]] = {
    "adam": lambda: tiny_model(None, "adam", lr=0.01),
    # Keras keeps the weights spared from decay by the key of their tf.Variable: a stale key
    # would decay the first kernel silently.
    "adamw_excluding_a_weight": _adamw_sparing_the_first_kernel,
    # The wrapper and its inner optimizer each hold a table of the variables.
    "loss_scale_optimizer": _loss_scaled_adam,
}


def _one_device(build: Callable[[], Any], epochs: int) -> Any:
    with tf.device("/device:CPU:0"):
        model = build()
        model.fit(batches(*DATA, BATCH), epochs=epochs, verbose=0)
    return model


@pytest.mark.parametrize(
    "name",
    tiered(
        sorted(BUILDS),
        {"adamw_excluding_a_weight": "adam", "loss_scale_optimizer": "adam"},
        "tests/training/test_adopt.py::"
        "test_a_model_trained_outside_the_scope_continues_its_optimizer",
    ),
)
def test_a_model_trained_outside_the_scope_continues_its_optimizer(name: str) -> None:
    expected = _one_device(BUILDS[name], epochs=2)
    model = _one_device(BUILDS[name], epochs=1)
    optimizer = model.optimizer
    tfscale.fit(model, batches(*DATA, BATCH), strategy=strategy_for(2), verbose=0)
    assert model.optimizer is optimizer
    assert int(optimizer.iterations.numpy()) == int(expected.optimizer.iterations.numpy()) == 16
    assert relative_difference(model.get_weights(), expected.get_weights()) <= TOLERANCE
    state = [v.numpy() for v in optimizer.variables]
    assert relative_difference(state, [v.numpy() for v in expected.optimizer.variables]) <= 1e-4


@pytest.mark.full(
    "tests/training/test_adopt.py::"
    "test_model_built_outside_the_scope_trains_in_place_and_keeps_its_optimizer",
)
def test_a_saved_and_loaded_model_continues_under_tfscale(tmp_path: Path) -> None:
    """TensorFlow's save-and-load tutorial: trained under a strategy, saved, loaded without
    one (its optimizer built, with its state), and trained again under a strategy."""
    expected = _one_device(BUILDS["adam"], epochs=2)
    strategy = strategy_for(2)
    model = BUILDS["adam"]()
    tfscale.fit(model, batches(*DATA, BATCH), strategy=strategy, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.built
    tfscale.fit(loaded, batches(*DATA, BATCH), strategy=strategy, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 16
    assert relative_difference(loaded.get_weights(), expected.get_weights()) <= TOLERANCE


def test_a_loop_optimizer_stepped_outside_the_scope_continues_in_a_prepared_loop() -> None:
    """A custom loop's optimizer, not held by the model, that took its first steps on one
    device: the prepared loop's steps continue it."""
    x, y = DATA
    loss_of = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def steps(model: Any, optimizer: Any, epochs: int, strategy: Any = None) -> None:
        def step(xb: Any, yb: Any) -> None:
            with tf.GradientTape() as tape:
                loss = loss_of(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        if strategy is None:
            data, run = batches(x, y, BATCH), tf.function(step)
        else:
            data = strategy.experimental_distribute_dataset(batches(x, y, BATCH))
            run = tf.function(lambda xb, yb: strategy.run(step, args=(xb, yb)))
        for _ in range(epochs):
            for xb, yb in data:
                run(xb, yb)

    def fresh() -> tuple[Any, Any]:
        return tiny_model(None), keras.optimizers.Adam(0.01)

    with tf.device("/device:CPU:0"):
        expected, expected_optimizer = fresh()
        steps(expected, expected_optimizer, epochs=2)
        model, optimizer = fresh()
        steps(model, optimizer, epochs=1)
    strategy = strategy_for(2)
    tfscale.prepare_loop(model, optimizer, strategy=strategy)
    steps(model, optimizer, epochs=1, strategy=strategy)
    assert int(optimizer.iterations.numpy()) == 16
    assert relative_difference(model.get_weights(), expected.get_weights()) <= TOLERANCE


@pytest.mark.full(
    "tests/training/test_adopt.py::"
    "test_a_model_trained_outside_the_scope_continues_its_optimizer[adam]",
)
def test_a_model_trained_on_one_strategy_continues_on_another() -> None:
    """Two replicas, then four (more devices, or an explicit strategy after the chosen one):
    the second strategy moves the variables again, and the optimizer's tables with them."""
    expected = _one_device(BUILDS["adam"], epochs=2)
    model = BUILDS["adam"]()
    tfscale.fit(model, batches(*DATA, BATCH), strategy=strategy_for(2), verbose=0)
    tfscale.fit(model, batches(*DATA, BATCH), strategy=strategy_for(4), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 16
    assert relative_difference(model.get_weights(), expected.get_weights()) <= TOLERANCE
