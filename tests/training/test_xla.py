"""jit_compile=True compiles each replica's whole step (forward and backward) with XLA and
applies the update outside it (training/xla.py): recurrent, attention and convolution models
train to the weights of Keras's own one-device jit run; a model XLA cannot compile is
refused before the first step, naming its layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.errors import TrainingError
from tfscale.testing import relative_difference

from .helpers import NoCallModel, strategy_for, tiered

pytestmark = pytest.mark.tf

STEPS, BATCH, LENGTH, VOCAB, CLASSES = 3, 8, 6, 20, 3


def _tokens() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return (
        rng.integers(0, VOCAB, (STEPS * BATCH, LENGTH)).astype("int32"),
        rng.integers(0, CLASSES, (STEPS * BATCH,)).astype("int32"),
    )


def _images() -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Images and a feature vector, as named inputs."""
    rng = np.random.default_rng(4)
    images = rng.normal(size=(STEPS * BATCH, 6, 6, 1)).astype("float32")
    features = rng.normal(size=(STEPS * BATCH, 3)).astype("float32")
    return (
        {"image": images, "features": features},
        rng.integers(0, CLASSES, (STEPS * BATCH,)).astype("int32"),
    )


def _init(seed: int) -> Any:
    return keras.initializers.GlorotUniform(seed)


def _lstm_gru() -> keras.Model:
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 4, embeddings_initializer=_init(1))(inputs)
    h = keras.layers.LSTM(
        4, return_sequences=True, kernel_initializer=_init(2), recurrent_initializer=_init(3)
    )(h)
    h = keras.layers.GRU(4, kernel_initializer=_init(5), recurrent_initializer=_init(6))(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, kernel_initializer=_init(4))(h))


def _transformer() -> keras.Model:
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, embeddings_initializer=_init(1))(inputs)
    # No biases: the key projection's bias has a gradient of zero up to rounding (softmax
    # ignores a shift), so its weights are rounding noise, which no tolerance compares.
    attention = keras.layers.MultiHeadAttention(2, 4, use_bias=False, kernel_initializer=_init(2))
    attended = attention(h, h)
    h = keras.layers.LayerNormalization()(h + attended)
    h = keras.layers.Dense(8, activation="relu", kernel_initializer=_init(3))(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, kernel_initializer=_init(4))(h))


def _conv() -> keras.Model:
    """Named inputs (a dict: XLA's pre-check of the step lowered nested specs wrongly, a bare
    TensorFlow ValueError before the first step)."""
    image = keras.Input((6, 6, 1), name="image")
    features = keras.Input((3,), name="features")
    h = keras.layers.Conv2D(4, 3, activation="relu", kernel_initializer=_init(1))(image)
    # No batch normalization: per-replica batch statistics differ from one device's by
    # design (sync_batchnorm=True makes them global).
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Concatenate()([keras.layers.Flatten()(h), features])
    outputs = keras.layers.Dense(CLASSES, kernel_initializer=_init(2))(h)
    return keras.Model({"image": image, "features": features}, outputs)


# One recurrent model holds both an LSTM and a GRU (each alone was a case of its own, with
# nothing the pair does not exercise: 4 fewer XLA compilations of the suite).
MODELS: dict[str, tuple[Callable[[], keras.Model], Callable[[], Any]]] = {
    "lstm+gru": (_lstm_gru, _tokens),
    "transformer": (_transformer, _tokens),
    "conv": (_conv, _images),
}


def _compiled(name: str, jit_compile: bool | str) -> keras.Model:
    model = MODELS[name][0]()
    model.compile(
        # SGD: Adam turns a gradient that is zero up to rounding (attention's key bias) into
        # a full step whose sign is that rounding's.
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    return model


_KERAS: dict[str, list[np.ndarray]] = {}


def _keras_jit(name: str) -> list[np.ndarray]:
    """Keras's own fit with compile(jit_compile=True) on one device: the reference."""
    if name not in _KERAS:
        x, y = MODELS[name][1]()
        with tf.device("/device:CPU:0"):
            model = _compiled(name, True)
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        _KERAS[name] = model.get_weights()
    return _KERAS[name]


def _data(name: str) -> tf.data.Dataset:
    x, y = MODELS[name][1]()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


_JIT_TEST = "tests/training/test_xla.py::test_jit_trains_to_the_weights_of_keras_one_device_jit"
_PAIRS = [(replicas, name) for replicas in (0, 2) for name in MODELS]


# `make test` compiles the convolutional model on 2 replicas; one device (the same compiled
# step on one replica), the transformer and the recurrent model (their ops and while loop
# reach the same compiled step) run in `make test-full`.
@pytest.mark.parametrize(
    ("replicas", "name"),
    tiered(
        _PAIRS,
        {
            **{f"0-{name}": f"2-{name}" for name in MODELS if name != "lstm+gru"},
            "0-lstm+gru": "2-conv",
            "2-lstm+gru": "2-conv",
            "2-transformer": "2-conv",
        },
        _JIT_TEST,
        ids=[f"{replicas}-{name}" for replicas, name in _PAIRS],
    ),
)
def test_jit_trains_to_the_weights_of_keras_one_device_jit(replicas: int, name: str) -> None:
    strategy = strategy_for(replicas)
    with strategy.scope():
        model = _compiled(name, False)
    history = tfscale.fit(model, _data(name), strategy=strategy, jit_compile=True, verbose=0)
    assert model.train_function.options.jit_compile
    assert relative_difference(model.get_weights(), _keras_jit(name)) <= 1e-4
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.full(
    "tests/training/test_xla.py::test_jit_trains_to_the_weights_of_keras_one_device_jit[2-conv]",
)
def test_compile_jit_compile_true_is_the_same_option() -> None:
    strategy = strategy_for(2)
    with strategy.scope():
        model = _compiled("lstm+gru", True)
    tfscale.fit(model, _data("lstm+gru"), strategy=strategy, verbose=0)
    assert model.train_function.options.jit_compile
    assert relative_difference(model.get_weights(), _keras_jit("lstm+gru")) <= 1e-4
    logs = model.evaluate(_data("lstm+gru"), verbose=0, return_dict=True)  # compiled test step
    assert np.isfinite(logs["loss"])


class _HostCall(keras.layers.Layer):
    """A layer running Python on the host: XLA cannot compile tf.numpy_function."""

    def call(self, x: Any) -> Any:
        return tf.ensure_shape(tf.numpy_function(lambda a: a, [x], tf.float32), x.shape)

    def compute_output_shape(self, shape: Any) -> Any:
        return shape


def test_a_model_xla_cannot_compile_is_refused_before_the_first_step_naming_the_layer() -> None:
    strategy = strategy_for(2)
    with strategy.scope():
        inputs = keras.Input((4,))
        h = _HostCall(name="on_the_host")(keras.layers.Dense(3)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1)(h))
        model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 4), "float32"), np.ones((8, 1), "float32"))
    ).batch(4)
    seen: list[int] = []
    callback = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(1))
    with pytest.raises(TrainingError, match=r"layer 'on_the_host' \(_HostCall\)") as raised:
        tfscale.fit(model, data, strategy=strategy, jit_compile=True, callbacks=[callback])
    assert "jit_compile=False" in str(raised.value)
    assert seen == []
    assert relative_difference(model.get_weights(), before) == 0.0
    assert int(model.optimizer.iterations.numpy()) == 0


def test_a_train_step_applying_twice_is_refused_under_jit() -> None:
    class TwoUpdates(keras.Model):
        def train_step(self, data: Any) -> Any:
            x, y = data
            for _ in range(2):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            return {"loss": loss}

    strategy = strategy_for(0)
    with strategy.scope():
        inputs = keras.Input((4,))
        model = TwoUpdates(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 4), "float32"), np.ones((8, 1), "float32"))
    ).batch(4)
    with pytest.raises(TrainingError, match="applies gradients 2 times"):
        tfscale.fit(model, data, strategy=strategy, jit_compile=True, verbose=0)


def test_what_the_trial_cannot_see_is_refused_at_the_first_step_before_any_update() -> None:
    class HostLoss(keras.Model):
        def train_step(self, data: Any) -> Any:
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            host = tf.ensure_shape(tf.numpy_function(lambda a: a, [loss], tf.float32), [])
            return {"loss": loss, "host": host}

    strategy = strategy_for(2)
    with strategy.scope():
        inputs = keras.Input((4,))
        model = HostLoss(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 4), "float32"), np.ones((8, 1), "float32"))
    ).batch(4)
    with pytest.raises(TrainingError, match="an op outside the model's layers"):
        tfscale.fit(model, data, strategy=strategy, jit_compile=True, verbose=0)
    assert relative_difference(model.get_weights(), before) == 0.0
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("replicas", [0, 2])
def test_a_model_without_call_is_compiled_at_its_first_step(replicas: int) -> None:
    """The trial lowers ``model(x)``, which a model without ``call`` cannot run (it raised
    Keras's NotImplementedError): such a model's step is compiled and checked at the first
    step, and trains to the weights of Keras's own one-device fit without XLA."""
    x = np.random.default_rng(3).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def model() -> Any:
        keras.utils.set_random_seed(5)
        built = NoCallModel(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
        built.compile(optimizer=keras.optimizers.SGD(0.05))
        return built

    reference = model()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    compiled = model()
    tfscale.fit(
        compiled,
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        strategy=strategy_for(replicas),
        jit_compile=True,
        verbose=0,
    )
    assert relative_difference(compiled.get_weights(), reference.get_weights()) <= 1e-5


def _masked_tagger(strategy: tf.distribute.Strategy) -> Any:
    """Per-token logits over zero-padded sequences (``mask_zero``: the loss is masked)."""
    with strategy.scope():
        keras.utils.set_random_seed(7)
        inputs = keras.Input((6,), dtype="int32")
        hidden = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
        model.compile(
            keras.optimizers.SGD(0.5),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


@pytest.mark.full(
    "tests/training/test_xla.py::test_jit_trains_to_the_weights_of_keras_one_device_jit[2-conv]",
)
def test_a_masked_mean_under_jit_stays_each_replicas_own_as_under_keras() -> None:
    """Outside XLA a masked mean is made each replica's share of the batch's (an all-reduce
    of the unmasked tokens, tests/training/parity ``masked_token_loss``); inside the compiled
    step no all-reduce can run, so each replica's mean stays its own (docs/training.md,
    "Losses normalized over the batch"): Keras's own fit under the same strategy, where the
    halves of each batch hold different token counts."""
    rng = np.random.default_rng(21)
    tokens = rng.integers(1, 20, size=(32, 6)).astype("int32")
    lengths = np.where(np.arange(32) % 8 < 4, 2, 6)  # 8 and 24 tokens in each batch's halves
    tokens[np.arange(6)[None, :] >= lengths[:, None]] = 0
    tags = (tokens % 3).astype("int32")
    strategy = strategy_for(2)
    keras_model = _masked_tagger(strategy)
    keras_model.fit(tokens, tags, batch_size=8, shuffle=False, verbose=0)
    model = _masked_tagger(strategy)
    tfscale.fit(model, tokens, tags, batch_size=8, shuffle=False, verbose=0,
                strategy=strategy, jit_compile=True)  # fmt: skip
    assert relative_difference(model.get_weights(), keras_model.get_weights()) <= 1e-4
    exact = _masked_tagger(strategy)
    tfscale.fit(exact, tokens, tags, batch_size=8, shuffle=False, verbose=0, strategy=strategy)
    assert relative_difference(exact.get_weights(), keras_model.get_weights()) > 1e-3
