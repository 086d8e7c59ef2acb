"""Seed 003's script, unchanged: a TensorFlow op runs before tfscale.choose_strategy(), so the
runtime has started and the multi-worker strategy can no longer be built."""

import numpy as np
import tensorflow as tf

import tfscale

scale = tf.constant(2.0) * 3.0  # starts TensorFlow's runtime
choice = tfscale.choose_strategy()
with choice.strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
tfscale.fit(model, x, x[:, :1], batch_size=16, epochs=1, verbose=0)
print("trained", flush=True)
