"""model.fit over a keras.utils.PyDataset under MirroredStrategy; with --prepared, the model
is prepared by tfscale first (its fit copies each batch)."""

import sys

import keras
import numpy as np
import tensorflow as tf

import tfscale


class Batches(keras.utils.PyDataset):
    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        super().__init__()
        self.x, self.y = x, y

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[index * 16 : (index + 1) * 16], self.y[index * 16 : (index + 1) * 16]


strategy = tf.distribute.MirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
if "--prepared" in sys.argv:
    model = tfscale.prepare(model)
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
model.fit(Batches(x, y), epochs=1, verbose=0)
