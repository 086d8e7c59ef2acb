"""The right way: build and compile the model inside strategy.scope().

`tfscale doctor --script examples/train_in_scope.py --epochs 3` reports no problem and
shows the device each replica ran on.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf


def build_model() -> keras.Model:
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])


parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()

strategy = tf.distribute.MirroredStrategy()
print(f"replicas: {strategy.num_replicas_in_sync}")
with strategy.scope():
    model = build_model()
    model.compile(optimizer="adam", loss="mse")
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)), rng.normal(size=(64, 1))
model.fit(x, y, batch_size=16, epochs=args.epochs, verbose=0)
