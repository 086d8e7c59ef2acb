"""Seed 001's script, unchanged: Keras's model.fit under MultiWorkerMirroredStrategy with a
dataset, which Keras 3.15 cannot run ("Attempt to convert a value (PerReplica...)")."""

import numpy as np
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16)
model.fit(dataset, epochs=1, verbose=0)
print("trained", flush=True)
