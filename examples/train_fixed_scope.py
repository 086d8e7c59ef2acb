"""The classic mistake, repaired: the model built outside the scope, then rebuilt inside it.

`tfscale doctor --script examples/train_fixed_scope.py` reports no problem: the variables
created outside the scope are shown as moved in by `tfscale.fix_scope` before training.
"""

import keras
import numpy as np
import tensorflow as tf

import tfscale


def build_model() -> keras.Model:
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])


model = build_model()  # outside the scope: plain variables on one device
model.compile(optimizer="adam", loss="mse")
strategy = tf.distribute.MirroredStrategy()
print(f"replicas: {strategy.num_replicas_in_sync}")
model = tfscale.fix_scope(model, strategy)  # the same model, rebuilt inside the scope
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)), rng.normal(size=(64, 1))
model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # trains on every replica
