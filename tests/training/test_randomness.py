"""Random ops in a step draw per replica: Keras's seed generators hand every replica the
same seed under a strategy (the same dropout mask for example ``i`` of each replica, the same
latent vectors for each replica of a GAN); a prepared model's fold the replica's id in
(``training/randomness.py``), and leave one device's draws as Keras makes them."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.interop import internals
from tfscale.training.randomness import draw_per_replica

from .helpers import strategy_for

pytestmark = pytest.mark.tf


class _Noise(keras.layers.Layer):  # type: ignore[misc]
    """keras-io's VAE sampling layer, reduced: ``keras.random.normal`` seeded by the layer's
    own SeedGenerator."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, x: Any) -> Any:
        return x + keras.random.normal(keras.ops.shape(x), seed=self.seed_generator)


def _model(strategy: tf.distribute.Strategy | None = None) -> Any:
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dropout(0.5, seed=3), _Noise()])
        model.compile(optimizer="sgd", loss="mse")
    return model


def _per_replica(model: Any, strategy: tf.distribute.Strategy, steps: int = 2) -> list[Any]:
    """Each step's outputs of every replica, all replicas given the same input."""
    x = tf.ones((2, 32))

    @tf.function
    def step() -> Any:
        return strategy.run(lambda: model(x, training=True))

    return [[r.numpy() for r in strategy.experimental_local_results(step())] for _ in range(steps)]


def test_keras_gives_every_replica_the_same_numbers() -> None:
    """Upstream's behaviour, which the prepared model changes (fails if Keras stops)."""
    strategy = strategy_for(2)
    for first, second in _per_replica(_model(strategy), strategy):
        np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("prepare", ["prepare", "prepare_loop"])
def test_a_prepared_model_draws_other_numbers_in_each_replica(prepare: str) -> None:
    strategy = strategy_for(2)
    model = _model()  # built outside the scope, as users do
    if prepare == "prepare":
        tfscale.prepare(model, strategy)
    else:
        tfscale.prepare_loop(model, model.optimizer, strategy)
    steps = _per_replica(model, strategy)
    for first, second in steps:
        assert not np.allclose(first, second)
    assert not np.allclose(steps[0][0], steps[1][0])  # and other numbers at each step
    # Both generators (Dropout's, the noise layer's) were changed once: not again.
    tfscale.prepare(model, strategy)
    assert len(internals.seed_generators(model)) == 2 and draw_per_replica(model) == 0


def test_one_device_draws_what_keras_draws() -> None:
    keras_model, prepared = _model(), _model()
    tfscale.prepare(prepared, strategy_for(0))
    x = tf.ones((4, 32))
    for _ in range(2):
        np.testing.assert_array_equal(
            keras_model(x, training=True).numpy(), prepared(x, training=True).numpy()
        )


def test_a_layer_drawing_in_inference_too_trains_under_xla_with_folded_seeds() -> None:
    """The noise layer draws whatever ``training`` says (as keras-io's VAE sampling layer):
    XLA's trial lowering in cross-replica context cannot take it (it failed with "Failed
    getting HLO text: ... located in device"), the first step compiles it, folded seeds and
    all."""
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dropout(0.5), _Noise()]
    )
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).random((32, 8)).astype("float32")
    history = tfscale.fit(
        model,
        x,
        x[:, :4],
        batch_size=16,
        epochs=1,
        verbose=0,
        strategy=strategy_for(2),
        jit_compile=True,
    )
    assert np.isfinite(history.history["loss"]).all()
    assert all(
        getattr(g.__dict__.get("next"), "folds_replica", False)
        for g in internals.seed_generators(model)
    )
