"""The plan's facts read from real Keras models: variable bytes, optimizer slots, and the
activations of the traced forward and backward pass."""

from __future__ import annotations

from typing import Any

import pytest

import tfscale
from tfscale.testing import mirrored_on_cpus

pytestmark = pytest.mark.tf


def _mlp(optimizer: Any = "adam") -> Any:
    import keras

    inputs = keras.Input((20,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def test_plan_counts_the_models_bytes_per_replica() -> None:
    strategy = mirrored_on_cpus(2)
    with strategy.scope():
        model = _mlp()
    plan = tfscale.plan_memory(model, 16, strategy=strategy)
    trainable = (20 * 64 + 64 + 64 * 2 + 64 * 3 + 3) * 4  # BatchNorm's gamma and beta
    everything = trainable + 64 * 2 * 4  # and its moving mean and variance
    assert plan.options.replicas == 2
    assert [d.device for d in plan.devices] == ["/device:CPU:0", "/device:CPU:1"]
    assert plan.shared_allocator
    row = plan.devices[0]
    assert row.parts["weights"] == everything
    assert row.parts["gradients"] == trainable
    # Adam's moments; its iteration count (int64) and learning rate (float32).
    assert row.parts["optimizer"] == 2 * trainable + 8 + 4
    assert row.parts["input"] == 2 * 16 * 20 * 4
    # At least the hidden layer's output and the relu's, kept for the backward pass.
    assert row.parts["activations"] >= 2 * 16 * 64 * 4
    assert not model.optimizer.built  # probed on a fresh optimizer, not built


@pytest.mark.parametrize(("optimizer", "slots"), [("sgd", 0), ("rmsprop", 1), ("adamw", 2)])
def test_optimizer_slots_are_probed_or_counted(optimizer: str, slots: int) -> None:
    from tfscale.training.memory.facts import optimizer_slots

    model = _mlp(optimizer)
    probed, _ = optimizer_slots(model.optimizer, model.trainable_variables)
    model.optimizer.build(model.trainable_variables)
    counted, _ = optimizer_slots(model.optimizer, model.trainable_variables)
    assert probed == counted == slots


def test_activations_grow_with_the_batch() -> None:
    model = _mlp()
    small = tfscale.plan_memory(model, 64).facts.activation_bytes
    large = tfscale.plan_memory(model, 256).facts.activation_bytes
    assert 3.5 <= large / small <= 4.5


def test_a_model_without_inputs_needs_input_shape() -> None:
    import keras

    class Sub(keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x: Any) -> Any:
            return self.dense(x)

    model = Sub()
    model(__import__("numpy").zeros((1, 5), "float32"))
    with pytest.raises(tfscale.TrainingError, match="input_shape="):
        tfscale.plan_memory(model, 8)
    plan = tfscale.plan_memory(model, 8, input_shape=(5,))
    assert plan.devices[0].parts["weights"] == (5 * 4 + 4) * 4


def test_bad_options_are_refused() -> None:
    model = _mlp()
    with pytest.raises(tfscale.TrainingError, match="yes/no"):
        tfscale.plan_memory(model, 8, remat="yes")  # type: ignore[arg-type]
    with pytest.raises(tfscale.TrainingError, match="accumulation_steps"):
        tfscale.plan_memory(model, 8, accumulation_steps=0)
    with pytest.raises(tfscale.TrainingError, match="per-replica batch"):
        tfscale.plan_memory(model, 0)
