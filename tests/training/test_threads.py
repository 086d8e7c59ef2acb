"""tfscale.fit in several threads at once (a TaskPool's): the switches a step's trace needs
are per thread, so concurrent fits give the weights of the same fits run one after the other;
fits that share one strategy run one after the other (``prepare.one_fit_at_a_time``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
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

# A second MirroredStrategy over the other two of the session's 4 logical CPUs (with
# ReductionToOneDevice, as strategy_for's: the default collective all-reduce of a second
# strategy would reuse the first one's collective keys, tensorflow/tensorflow#62790).
_OTHER_DEVICES = tf.distribute.MirroredStrategy(
    ["/device:CPU:2", "/device:CPU:3"], cross_device_ops=tf.distribute.ReductionToOneDevice()
)


def _data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(96, FEATURES)).astype("float32")
    return x, rng.integers(0, CLASSES, size=(96,)).astype("int32")


def _fit(
    model: keras.Model,
    data: tuple[np.ndarray, np.ndarray],
    strategy: tf.distribute.Strategy | None = None,
    callbacks: list[keras.callbacks.Callback] | None = None,
) -> None:
    tfscale.fit(model, *data, batch_size=16, epochs=2, shuffle=False, verbose=0,
                strategy=strategy or strategy_for(2), callbacks=callbacks)  # fmt: skip


def _in_two_threads(run: Callable[[int], None]) -> None:
    """Runs ``run(0)`` and ``run(1)`` at once (from a barrier), re-raising their errors."""
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            start.wait(60)  # both trace their steps at the same time
            run(index)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    # Daemon threads: a fit that never returns fails this test instead of keeping the pytest
    # process from exiting.
    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"fits still running after 120 s: {stuck}"
    assert not errors, errors


def _sequential_weights(strategies: list[tf.distribute.Strategy]) -> list[list[np.ndarray]]:
    models = [tiny_model(None, "sgd"), tiny_model(None, "adam", lr=0.01)]
    for index, model in enumerate(models):
        _fit(model, _data(index + 1), strategies[index])
    return [model.get_weights() for model in models]


def test_two_fits_tracing_at_once_over_two_strategies_give_the_sequential_weights() -> None:
    strategies = [strategy_for(2), _OTHER_DEVICES]
    sequential = _sequential_weights(strategies)
    concurrent = [tiny_model(None, "sgd"), tiny_model(None, "adam", lr=0.01)]
    _in_two_threads(lambda i: _fit(concurrent[i], _data(i + 1), strategies[i]))
    for ours, reference in zip(concurrent, sequential, strict=True):
        assert int(ours.optimizer.iterations.numpy()) == 12
        assert relative_difference(ours.get_weights(), reference) <= 1e-6
    # Keras's own scaling is back for code outside tfscale's steps.
    with strategy_for(2).scope():
        scale = internals.keras_loss_module().scale_loss_for_distribution
        assert float(scale(tf.constant(4.0))) == 2.0


class _Events(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__()
        self.name, self.log = name, log

    def on_train_begin(self, logs: Any = None) -> None:
        self.log.append(f"{self.name} begins")

    def on_train_end(self, logs: Any = None) -> None:
        self.log.append(f"{self.name} ends")


def test_two_fits_sharing_one_strategy_run_one_after_the_other() -> None:
    """Two fits sharing a MirroredStrategy in two threads sometimes hung or trained to other
    weights (inside TensorFlow's runtime, see ``prepare._FIT_LOCKS``): they take turns, and
    each gives the weights of the same fit alone."""
    shared = strategy_for(2)
    sequential = _sequential_weights([shared, shared])
    concurrent = [tiny_model(None, "sgd"), tiny_model(None, "adam", lr=0.01)]
    log: list[str] = []
    _in_two_threads(lambda i: _fit(concurrent[i], _data(i + 1), shared, [_Events(str(i), log)]))
    first, second = log[0].split()[0], log[2].split()[0]
    assert log == [f"{first} begins", f"{first} ends", f"{second} begins", f"{second} ends"]
    for ours, reference in zip(concurrent, sequential, strict=True):
        assert int(ours.optimizer.iterations.numpy()) == 12
        assert relative_difference(ours.get_weights(), reference) <= 1e-6


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
