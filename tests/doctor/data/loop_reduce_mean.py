"""A custom loop whose loss is written as on one device, tf.reduce_mean of the per-example
losses; Keras's optimizer sums the replicas' gradients, so each update is N times one
device's. The optimizer is built in the scope, so nothing fails."""

import keras
import numpy as np
import tensorflow as tf

strategy = tf.distribute.MirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
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
