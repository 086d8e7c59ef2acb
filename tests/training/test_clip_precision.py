"""Clipping by the global norm of the all-reduced gradient; fp16 skips an update when one
replica overflows; bf16 trains; a NaN loss stops with its update number."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import relative_difference
from tfscale.training import Trainer

from .helpers import DATA, batches, reference_weights, strategy_for, tiered, tiny_model

pytestmark = pytest.mark.tf

CLIP = 0.05


def test_global_clipnorm_clips_the_all_reduced_gradient() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy)
    tfscale.fit(
        model,
        batches(x, y, 32),
        steps_per_epoch=3,
        global_clipnorm=CLIP,
        strategy=strategy,
        verbose=0,
    )
    clipped = reference_weights(x, y, batch=32, steps=3, global_clipnorm=CLIP)
    unclipped = reference_weights(x, y, batch=32, steps=3)
    assert relative_difference(model.get_weights(), clipped) <= 1e-5
    assert relative_difference(clipped, unclipped) > 1e-3  # the clip was active


def test_keras_global_clipnorm_under_mirrored_clips_each_replica_instead() -> None:
    """The upstream behaviour tfscale avoids: Keras clips before its all-reduce."""
    x, y = DATA
    strategy = strategy_for(2)
    with strategy.scope():
        model = tiny_model(strategy, optimizer=keras.optimizers.SGD(0.1, global_clipnorm=CLIP))
    model.fit(batches(x, y, 32), steps_per_epoch=3, shuffle=False, verbose=0)
    clipped = reference_weights(x, y, batch=32, steps=3, global_clipnorm=CLIP)
    assert relative_difference(model.get_weights(), clipped) > 1e-3


def test_fp16_skips_the_update_when_one_replica_overflows() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy)
    x_bad = x[:64].copy()
    x_bad[16:32] *= 300.0  # replica 1's half of the first batch overflows float16 gradients
    trainer = Trainer(model, strategy, mixed_precision="fp16", sample_batch=(x[:16], y[:16]))
    scaled = model.optimizer
    assert isinstance(scaled, keras.optimizers.LossScaleOptimizer)  # Keras's, as compile()'s
    before = model.get_weights()
    iterator = iter(strategy.experimental_distribute_dataset(batches(x_bad, y[:64], 32)))
    done, _, logs = trainer.train(iterator, 1)
    assert done == 1 and np.isfinite(float(logs["loss"]))  # the loss itself was finite
    assert int(model.optimizer.iterations.numpy()) == 0  # ... but nothing was applied
    assert relative_difference(model.get_weights(), before) == 0.0
    assert float(scaled.dynamic_scale.numpy()) == 2.0**14
    trainer.train(iterator, 1)  # a clean batch is applied
    assert int(model.optimizer.iterations.numpy()) == 1
    assert relative_difference(model.get_weights(), before) > 0.0


def test_keras_loss_scale_optimizer_alone_applies_one_replicas_overflow() -> None:
    """The upstream behaviour tfscale avoids: Keras judges finiteness on one replica."""
    x, y = DATA
    strategy = strategy_for(2)
    with strategy.scope():
        model = tiny_model(strategy)
        model.compile(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
            model.loss,
        )
    x_bad = x[:32].copy()
    x_bad[16:32] *= 300.0
    model.layers[-1].dtype_policy = "mixed_float16"
    for layer in model.layers:
        layer.dtype_policy = "mixed_float16"
    model.fit(batches(x_bad, y[:32], 32), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1  # applied although replica 1 overflowed


def test_bf16_trains_with_bfloat16_compute_and_float32_weights() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy, "adam", lr=0.01)
    history = tfscale.fit(
        model, x, y, batch_size=32, epochs=2, mixed_precision="bf16", strategy=strategy, verbose=0
    )
    assert model.layers[-1].compute_dtype == "bfloat16"
    assert all(w.dtype == np.float32 for w in model.get_weights())
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[1] < losses[0]


def test_nan_loss_stops_with_the_update_number_and_keeps_finite_weights() -> None:
    x, y = DATA
    x = x[:160].copy()
    x[70] = np.nan  # in the third batch of 32
    strategy = strategy_for(2)
    model = tiny_model(strategy)
    with pytest.raises(tfscale.NonFiniteLossError, match="update 3") as info:
        tfscale.fit(model, batches(x, y[:160], 32), strategy=strategy, verbose=0)
    assert "learning rate" in str(info.value)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_float16_backward_pass_under_a_dynamic_loss_scale_carries_one_devices_magnitudes() -> None:
    """Each replica's scaled loss is divided by N: the dynamic scale halves where one
    device's does, so the same updates are skipped (before the fix each replica carried N
    times one device's values, overflowed sooner: final scale 8192 against 16384, 6 against
    7 updates on this case) and the weights differ only by float16 rounding."""
    from .parity.keras_io_cases import X, Y, _fp16_dynamic

    arguments = {"x": X, "y": Y, "batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    one = _fp16_dynamic()
    start = one.get_weights()
    one.fit(**arguments)
    two = _fp16_dynamic()
    two.set_weights(start)
    tfscale.fit(two, strategy=strategy_for(2), **arguments)
    scales = [float(m.optimizer.dynamic_scale.numpy()) for m in (one, two)]
    updates = [int(m.optimizer.iterations.numpy()) for m in (one, two)]
    assert scales[0] == scales[1] and scales[0] < 32768.0, scales  # it did overflow, alike
    assert updates[0] == updates[1], updates
    assert relative_difference(two.get_weights(), one.get_weights()) <= 2e-2


# -- float8 training (Keras's model.quantize("float8")) ---------------------------------------
def _float8_model(accumulated: bool = False, clip: float | None = None) -> keras.Model:
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)]
    )
    model.quantize("float8")
    optimizer = keras.optimizers.SGD(
        0.1, global_clipnorm=clip, gradient_accumulation_steps=2 if accumulated else None
    )
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _float8_state(model: keras.Model) -> list[tuple[str, np.ndarray]]:
    """Each float8 layer's scales and amax histories, which Keras overwrites every step, by
    their variable's name (the layers' and the model's names differ between two models)."""
    return [(v.name, v.numpy()) for v in model.weights if "scale" in v.name or "amax" in v.name]


@pytest.mark.parametrize(
    ("batch", "clip"),
    tiered(
        [(16, None), (15, None), (16, 0.5)],
        {"even": "uneven", "global_clipnorm": "uneven"},
        "tests/training/test_clip_precision.py::"
        "test_float8_training_on_2_replicas_is_one_device_over_the_2_shares",
        ids=["even", "uneven", "global_clipnorm"],
    ),
)
def test_float8_training_on_2_replicas_is_one_device_over_the_2_shares(
    batch: int, clip: float | None
) -> None:
    """A float8 layer quantizes with scales from the amax histories it writes each step
    (Keras's ``overwrite_with_gradient``). Each replica's amax is its share's: they are
    combined by their maximum, as Keras combines accumulated steps, and each replica's
    backward pass carries one device's magnitudes (its loss divided by the batch's examples
    over its own, weighed back), so its gradients' amax is one device's too. Before, each
    replica's copy of the variables kept its own history and the gradients' histories were
    N times one device's: the weights ended up to 0.2 from one device's accumulating fit,
    and the scales and histories up to 2x.

    One device over the whole batch is not the exact reference here: Keras's float8 Dense
    rounds the bias gradient to bfloat16, so a sum of shares rounds otherwise than the
    batch's, and a float8 rounding that flips amplifies it (one device accumulating the 2
    halves, Keras's ``gradient_accumulation_steps=2``, ends 2.5e-3 from its own full-batch
    fit, 7.9e-2 with ``global_clipnorm``). On 2 even shares the weights are exactly that
    accumulating device's; the scales and histories are the full batch's."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 4, size=(64,)).astype("int32")
    fit = {"epochs": 2, "shuffle": False, "verbose": 0}
    model = _float8_model()
    tfscale.fit(model, x, y, batch_size=batch, strategy=strategy_for(2), global_clipnorm=clip,
                **fit)  # fmt: skip
    if batch % 2 == 0:
        # Keras's accumulation quantizes each half-batch's mean, whose gradients (and their
        # amax) are twice the batch's: only the weights compare.
        accumulated = _float8_model(accumulated=True, clip=clip)
        accumulated.fit(x, y, batch_size=batch // 2, **fit)
        assert relative_difference(_kernels(model), _kernels(accumulated)) <= 1e-6
    if clip is None:
        reference = _float8_model()
        reference.fit(x, y, batch_size=batch, **fit)
        state, expected = _float8_state(model), _float8_state(reference)
        assert len(state) == len(expected) == 12  # 6 a layer
        for (name, values), (name_expected, values_expected) in zip(state, expected, strict=True):
            assert name == name_expected
            assert relative_difference(values, values_expected) <= 1e-4, name
        assert relative_difference(_kernels(model), _kernels(reference)) <= 5e-3


def _kernels(model: keras.Model) -> list[np.ndarray]:
    return [v.numpy() for v in model.weights if v.name in ("kernel", "bias")]


class KerasIoStep(keras.Sequential):  # type: ignore[misc]
    """A train_step as keras-io's examples write it: the gradient of the loss as computed,
    with ``scale_loss`` only where ``scaled``."""

    def __init__(self, *args: Any, scaled: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scaled = scaled

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            if self.scaled:
                loss = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        return {"loss": loss}


def _float8_keras_io(scaled: bool) -> keras.Model:
    keras.utils.set_random_seed(3)
    model = KerasIoStep(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)],
        scaled=scaled,
    )
    model.quantize("float8")
    model.compile(
        keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def test_a_float8_train_step_that_never_scales_its_loss_is_refused_before_its_first_update() -> (
    None
):
    """Keras's float8 needs no ``scale_loss`` on one device; over N replicas it is where
    tfscale gives each replica's backward pass one device's magnitudes. Without it the
    float8 layers quantized twice one device's gradients (2 replicas: the scales and
    histories 2x, the weights 0.06 from one device's on batches of 15): refused as the step
    is traced. With ``scale_loss`` the same step trains as one device (the rounding of the
    uneven-split case above)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 4, size=(64,)).astype("int32")
    fit = {"batch_size": 15, "epochs": 2, "shuffle": False, "verbose": 0}
    model = _float8_keras_io(scaled=False)
    with pytest.raises(tfscale.TrainingError, match=r"never passed through self\.optimizer"):
        tfscale.fit(model, x, y, strategy=strategy_for(2), **fit)
    assert int(model.optimizer.iterations.numpy()) == 0
    model, reference = _float8_keras_io(scaled=True), _float8_keras_io(scaled=True)
    tfscale.fit(model, x, y, strategy=strategy_for(2), **fit)
    reference.fit(x, y, **fit)
    for (name, values), (_, expected) in zip(
        _float8_state(model), _float8_state(reference), strict=True
    ):
        assert relative_difference(values, expected) <= 1e-4, name
    assert relative_difference(_kernels(model), _kernels(reference)) <= 5e-3


def test_a_float8_custom_loop_with_compute_average_loss_trains_as_one_device() -> None:
    """A prepared custom loop's loss divided by the global batch
    (``tf.nn.compute_average_loss``) carries one device's magnitudes without ``scale_loss``:
    not refused (the refusal above is for a fit's step), and the scales and histories are
    one device's, the weights within the float8 rounding."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 4, size=(64,)).astype("int32")
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def train(replicas: int) -> keras.Model:
        strategy = strategy_for(replicas)
        with strategy.scope():
            model = _float8_model()
        optimizer = model.optimizer
        if replicas > 1:
            tfscale.prepare_loop(model, optimizer, strategy)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)

        def step(features: tf.Tensor, labels: tf.Tensor) -> None:
            with tf.GradientTape() as tape:
                predictions = model(features, training=True)
                loss = tf.nn.compute_average_loss(
                    per_example(labels, predictions), global_batch_size=16
                )
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))

        @tf.function  # type: ignore[misc]
        def train_step(batch: Any) -> None:
            strategy.run(step, args=batch)

        for _ in range(2):
            for batch in strategy.experimental_distribute_dataset(dataset):
                train_step(batch)
        return model

    model, reference = train(2), train(0)
    for (name, values), (_, expected) in zip(
        _float8_state(model), _float8_state(reference), strict=True
    ):
        assert relative_difference(values, expected) <= 1e-4, name
    assert relative_difference(_kernels(model), _kernels(reference)) <= 5e-3
