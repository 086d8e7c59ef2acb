"""Tiny seeded data and models shared by the parity cases."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

FEATURES = 6
SEED = 5


def aligned(array: Any, align: int = 64) -> Any:
    """A copy of ``array`` whose memory starts on an ``align``-byte boundary.

    TensorFlow aliases (zero-copy) numpy memory that is 64-byte aligned, and under
    MirroredStrategy writes into the arrays a generator or PyDataset returns when it does
    (``tfscale.training.data.copied_batches``). Where the allocator puts an array differs
    from one process to the next, so the parity data is always aligned: the worst case,
    every run, instead of a failure in some runs only.
    """
    buffer = np.empty(array.size + align, dtype=array.dtype)
    offset = (-buffer.ctypes.data % align) // array.itemsize
    out = buffer[offset : offset + array.size].reshape(array.shape)
    out[...] = array
    return out


def regression(n: int = 64, seed: int = 3, features: int = FEATURES) -> tuple[Any, Any]:
    """Fresh random linear-regression data (never zeros)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x @ rng.normal(size=(features, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return aligned(x), aligned(y)


def classification(
    n: int = 64, classes: int = 3, seed: int = 4, features: int = FEATURES
) -> tuple[Any, Any]:
    """Random inputs with integer labels that depend on them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(features, classes)), axis=1).astype("int32")
    return aligned(x), aligned(y)


def binary(n: int = 64, seed: int = 6, features: int = FEATURES) -> tuple[Any, Any]:
    """Random inputs with 0/1 float labels."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x @ rng.normal(size=(features, 1)) > 0).astype("float32")
    return aligned(x), aligned(y)


def tokens(
    n: int = 48, length: int = 8, vocab: int = 30, seed: int = 8, pad: bool = False
) -> tuple[Any, Any]:
    """Random token sequences (optionally zero-padded at the end) with 0/1 labels."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, vocab, size=(n, length)).astype("int32")
    if pad:
        lengths = rng.integers(2, length + 1, size=n)
        x[np.arange(length)[None, :] >= lengths[:, None]] = 0
    y = (x[:, :3].sum(axis=1) % 2).astype("int32")
    return aligned(x), aligned(y)


def mlp(
    outputs: int = 1,
    activation: str | None = None,
    cls: type = keras.Model,
    width: int = 8,
    features: int = FEATURES,
    **dense: Any,
) -> Any:
    """A seeded functional MLP (uncompiled)."""
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(width, activation="tanh", **dense)(inputs)
    return cls(inputs, keras.layers.Dense(outputs, activation=activation)(hidden))


def compiled(model: Any, **compile_args: Any) -> Any:
    """``model.compile`` with Adam(0.01) and MSE unless given."""
    arguments: dict[str, Any] = {"optimizer": keras.optimizers.Adam(0.01), "loss": "mse"}
    arguments.update(compile_args)
    model.compile(**arguments)
    return model


def dense_gradients(optimizer: Any) -> Any:
    """``optimizer``, its ``apply`` handed each ``tf.IndexedSlices`` as the dense tensor
    (duplicate ids summed before the update: the mathematically defined gradient)."""
    sparse_apply = optimizer.apply

    def apply(grads: Any, trainable_variables: Any = None) -> Any:
        dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return sparse_apply(dense, trainable_variables)

    optimizer.apply = apply
    return optimizer


def with_dense_gradients(build: Callable[[], Any]) -> Callable[[], Any]:
    """``build``, its compiled model's optimizer handed dense gradients.

    The reference of a case whose batches repeat an ``Embedding`` id under Adam, AdamW, Nadam,
    RMSprop or Adagrad: tfscale makes the dense gradient's update there, where Keras's
    one-device sparse update squares each lookup's entry on its own (docs/training.md,
    "Sparse gradients").
    """

    def make() -> Any:
        model = build()
        dense_gradients(model.optimizer)
        return model

    return make


def regressor(**compile_args: Any) -> Any:
    """The compiled tiny regression MLP."""
    return compiled(mlp(), **compile_args)


def classifier(classes: int = 3, **compile_args: Any) -> Any:
    """The compiled tiny softmax classifier (sparse labels, accuracy)."""
    arguments: dict[str, Any] = {
        "loss": "sparse_categorical_crossentropy",
        "metrics": ["accuracy"],
    }
    arguments.update(compile_args)
    return compiled(mlp(classes, "softmax"), **arguments)


def generator(x: Any, y: Any, batch: int, sw: Any = None) -> Callable[[], Iterator[Any]]:
    """A function making a finite Python generator of batches, in order."""

    def make() -> Iterator[Any]:
        for start in range(0, len(x), batch):
            part = slice(start, start + batch)
            yield (x[part], y[part]) if sw is None else (x[part], y[part], sw[part])

    return make


def dataset(x: Any, y: Any, batch: int, *extra: Any) -> tf.data.Dataset:
    """A batched, unshuffled dataset."""
    return tf.data.Dataset.from_tensor_slices((x, y, *extra)).batch(batch)


def relative_difference_of_arrays(a: Any, b: Any) -> float:
    """tfscale's weight metric over two arrays or weight lists."""
    from tfscale.testing import relative_difference

    return relative_difference(a, b)


def relative_difference_of(got: Any, expected: Any) -> float:
    """tfscale's weight metric between two models' weights."""
    return relative_difference_of_arrays(got.get_weights(), expected.get_weights())
