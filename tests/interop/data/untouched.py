"""Trains three things tfscale is not handed, and prints their weights as JSON.

``python untouched.py plain`` never imports tfscale; ``python untouched.py tfscale`` first runs
``tfscale.fit`` on another model (2 replicas) and then the same three. Run by
tests/interop/test_registry.py, which compares the two bit for bit.
"""

import json
import sys

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
RNG = np.random.RandomState(5)
X = RNG.normal(size=(64, 6)).astype("float32")
Y = RNG.normal(size=(64, 2)).astype("float32")


def model(seed: int) -> keras.Model:
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", kernel_initializer=init),
            keras.layers.Dropout(0.2, seed=seed),
            keras.layers.Dense(2, kernel_initializer=init),
        ]
    )


def tape_loop_mirrored() -> list[list[float]]:
    """TensorFlow's distributed custom-loop tutorial shape, with its tf.reduce_mean loss."""
    with STRATEGY.scope():
        net = model(1)
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(net.trainable_variables)
    dataset = STRATEGY.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    )

    @tf.function
    def step(batch: tuple[tf.Tensor, tf.Tensor]) -> None:
        def replica(x: tf.Tensor, y: tf.Tensor) -> None:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(net(x, training=True) - y))
            grads = tape.gradient(loss, net.trainable_variables)
            optimizer.apply_gradients(zip(grads, net.trainable_variables, strict=True))

        STRATEGY.run(replica, args=batch)

    for _ in range(2):
        for batch in dataset:
            step(batch)
    return [w.tolist() for w in net.get_weights()]


def keras_fit_mirrored() -> list[list[float]]:
    with STRATEGY.scope():
        net = model(2)
        net.compile(keras.optimizers.SGD(0.05), "mse")
    net.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return [w.tolist() for w in net.get_weights()]


def one_device_loop() -> list[list[float]]:
    net = model(3)
    optimizer = keras.optimizers.RMSprop(0.01)
    loss_fn = keras.losses.MeanSquaredError()
    for start in range(0, 64, 16):
        with tf.GradientTape() as tape:
            loss = loss_fn(Y[start : start + 16], net(X[start : start + 16], training=True))
        grads = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(grads, net.trainable_variables, strict=True))
    return [w.tolist() for w in net.get_weights()]


if sys.argv[1] == "tfscale":
    import tfscale
    from tfscale.interop import registry

    first = model(9)
    first.compile(keras.optimizers.Adam(0.01), "mse")
    tfscale.fit(first, X, Y, batch_size=16, epochs=1, verbose=0, strategy=STRATEGY)
    left = [
        f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in registry.installed()
    ]
    assert left == [], f"still installed after tfscale.fit: {left}"
    keras.utils.set_random_seed(0)
print(json.dumps([tape_loop_mirrored(), keras_fit_mirrored(), one_device_loop()]))
