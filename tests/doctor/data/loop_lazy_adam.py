"""A custom loop as users write it: Adam created in the scope and built by its first
apply_gradients inside strategy.run. Under the collective all-reduce (MirroredStrategy on
CPUs) its first step fails; with ``--prepared`` it adds tfscale's one line."""

import sys

import keras
import numpy as np
import tensorflow as tf

strategy = tf.distribute.MirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    optimizer = keras.optimizers.Adam()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
if "--prepared" in sys.argv:
    import tfscale

    tfscale.prepare_loop(model, optimizer)


def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return loss


@tf.function
def train(batch):
    return strategy.run(step, args=batch)


rng = np.random.default_rng(0)
data = tf.data.Dataset.from_tensor_slices(
    (rng.random((32, 8), dtype=np.float32), rng.integers(0, 4, 32))
).batch(16)
for batch in strategy.experimental_distribute_dataset(data):
    train(batch)
print("trained", int(optimizer.iterations.numpy()))
