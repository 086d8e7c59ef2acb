"""tfscale.fit in several threads at once (a TaskPool's): the switches a step's trace needs
are per thread, so concurrent fits give the weights of the same fits run one after the other."""

from __future__ import annotations

import threading
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale import internals
from tfscale.testing import relative_difference

from .helpers import CLASSES, FEATURES, strategy_for, tiny_model

pytestmark = pytest.mark.tf


def _data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(96, FEATURES)).astype("float32")
    return x, rng.integers(0, CLASSES, size=(96,)).astype("int32")


def _fit(model: keras.Model, data: tuple[np.ndarray, np.ndarray]) -> None:
    tfscale.fit(model, *data, batch_size=16, epochs=2, shuffle=False, verbose=0,
                strategy=strategy_for(2))  # fmt: skip


def test_two_fits_tracing_at_once_in_two_threads_give_the_sequential_weights() -> None:
    datasets = [_data(1), _data(2)]
    sequential = [tiny_model(None, "sgd"), tiny_model(None, "adam", lr=0.01)]
    for model, data in zip(sequential, datasets, strict=True):
        _fit(model, data)
    concurrent = [tiny_model(None, "sgd"), tiny_model(None, "adam", lr=0.01)]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(model: keras.Model, data: tuple[np.ndarray, np.ndarray]) -> None:
        try:
            start.wait(60)  # both trace their steps at the same time
            _fit(model, data)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    # Daemon threads: a fit that never returns fails this test instead of keeping the pytest
    # process from exiting.
    threads = [
        threading.Thread(target=run, args=pair, daemon=True)
        for pair in zip(concurrent, datasets, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"fits still running after 120 s: {stuck}"
    assert not errors, errors
    for ours, reference in zip(concurrent, sequential, strict=True):
        assert int(ours.optimizer.iterations.numpy()) == 12
        assert relative_difference(ours.get_weights(), reference.get_weights()) <= 1e-6
    # Keras's own scaling is back for code outside tfscale's steps.
    with strategy_for(2).scope():
        scale = internals.keras_loss_module().scale_loss_for_distribution
        assert float(scale(tf.constant(4.0))) == 2.0


_STRANGER = keras.optimizers.SGD(0.1)


class _StepWithAnotherOptimizer(keras.Sequential):  # type: ignore[misc]
    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        gradients = tape.gradient(loss, self.trainable_variables)
        _STRANGER.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        return {}


def test_an_optimizer_tfscale_did_not_prepare_is_still_refused_inside_the_replica_step() -> None:
    model = _StepWithAnotherOptimizer(
        [keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)], name="stranger"
    )
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(tfscale.TrainingError, match="tfscale did not prepare"):
        _fit(model, _data(3))
