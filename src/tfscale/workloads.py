"""Embedded reference models and data for the demo, benchmarks and tests (no download).

``digits()`` is the 8x8 handwritten-digits set that scikit-learn ships as ``load_digits``
(1,797 images of the UCI "Optical Recognition of Handwritten Digits" data, CC BY 4.0; see
``tfscale/data/README.md``), stored in the package as ``data/digits.npz`` (45 KB) so that
tfscale does not depend on scikit-learn: Keras imports scikit-learn at start-up wherever it
is installed (its ``keras.wrappers``), which costs every TensorFlow process about 0.8 s of CPU.
``build_model`` returns small compiled Keras models sized for it; the
``synthetic_*`` helpers make seeded random data of any shape for throughput measurements.
Build models inside ``strategy.scope()`` when they are meant for a strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Digits",
    "build_model",
    "digits",
    "synthetic_classification",
    "synthetic_images",
]

_KINDS = ("mlp", "cnn")


@dataclass(frozen=True)
class Digits:
    """The digits set split into train and test arrays.

    Attributes:
        x_train: float32 images in [0, 1], shape ``(n, 8, 8, 1)``.
        y_train: int32 labels 0..9, shape ``(n,)``.
        x_test: held-out images.
        y_test: held-out labels.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def digits(test_fraction: float = 0.2, seed: int = 0) -> Digits:
    """Loads the handwritten digits (scikit-learn's ``load_digits``), shuffled with ``seed``
    and split.

    Args:
        test_fraction: Share of the 1,797 images held out for testing.
        seed: Seed of the shuffle that precedes the split.

    Returns:
        Train and test arrays; images are ``(n, 8, 8, 1)`` float32 scaled to [0, 1].
    """
    from importlib import resources

    with resources.files("tfscale").joinpath("data/digits.npz").open("rb") as handle:
        stored = np.load(handle)
        # Pixels 0..16 as uint8; scikit-learn's float64 images / 16, bit for bit.
        images = (stored["images"].astype(np.float64) / 16.0).astype(np.float32)[..., None]
        labels = stored["target"].astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    images, labels = images[order], labels[order]
    cut = len(labels) - round(len(labels) * test_fraction)
    return Digits(images[:cut], labels[:cut], images[cut:], labels[cut:])


def synthetic_classification(
    n: int, features: int = 32, classes: int = 10, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random features and labels that a model can partly learn.

    Labels come from a fixed random linear map of the features, so loss falls in training.

    Returns:
        ``(x, y)``: float32 ``(n, features)`` and int32 ``(n,)``.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    w = rng.standard_normal((features, classes)).astype(np.float32)
    y = np.argmax(x @ w, axis=1).astype(np.int32)
    return x, y


def synthetic_images(
    n: int, size: int = 8, channels: int = 1, classes: int = 10, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random images ``(n, size, size, channels)`` with learnable labels."""
    x, y = synthetic_classification(n, size * size * channels, classes, seed)
    return x.reshape(n, size, size, channels), y


def build_model(
    kind: str = "cnn",
    *,
    input_shape: tuple[int, ...] = (8, 8, 1),
    classes: int = 10,
    width: int = 32,
    optimizer: Any = "adam",
    learning_rate: float | None = 1e-2,
    seed: int = 0,
) -> Any:
    """A small compiled Keras classifier (sparse categorical cross-entropy, accuracy).

    Args:
        kind: ``"mlp"`` (two dense layers) or ``"cnn"`` (two 3x3 convolutions, then dense).
        input_shape: Shape of one example.
        classes: Number of output classes (logits).
        width: Units / filters of the hidden layers.
        optimizer: A Keras optimizer or its name (``"adam"``, ``"sgd"``).
        learning_rate: Learning rate when ``optimizer`` is a name; None keeps the default.
        seed: Seed of the weight initialisers, so that two builds are identical.

    Returns:
        A compiled ``keras.Model``. Build it inside ``strategy.scope()`` for a strategy.

    Raises:
        ValueError: ``kind`` is not ``"mlp"`` or ``"cnn"``.
    """
    import keras

    if kind not in _KINDS:
        raise ValueError(f"Unknown workload kind {kind!r}; allowed: {', '.join(_KINDS)}.")
    init = keras.initializers.GlorotUniform

    def dense(units: int, activation: str | None, offset: int) -> Any:
        return keras.layers.Dense(
            units, activation=activation, kernel_initializer=init(seed + offset)
        )

    inputs = keras.Input(shape=input_shape)
    if kind == "mlp":
        h = keras.layers.Flatten()(inputs)
        h = dense(width * 4, "relu", 1)(h)
        h = dense(width * 4, "relu", 2)(h)
    else:
        h = inputs
        for i in range(2):
            h = keras.layers.Conv2D(
                width, 3, padding="same", activation="relu", kernel_initializer=init(seed + 10 + i)
            )(h)
        h = keras.layers.MaxPooling2D(2)(h)
        h = keras.layers.Flatten()(h)
        h = dense(width * 2, "relu", 3)(h)
    outputs = dense(classes, None, 4)(h)
    model = keras.Model(inputs, outputs, name=f"tfscale_{kind}")
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
        if learning_rate is not None:
            optimizer.learning_rate = learning_rate
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model
