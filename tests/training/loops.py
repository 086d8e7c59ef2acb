"""Custom training loops as users write them, each a function of the strategy it runs under
and of the one line tfscale adds (``prepare``: None runs the loop unchanged).

Transcribed, shapes kept and sizes shrunk so that they run in seconds on CPUs:

- ``tutorial_loop``: TensorFlow's "Custom training with tf.distribute.Strategy"
  (tensorflow/docs, site/en/tutorials/distribute/custom_training.ipynb): a ``Sequential`` CNN
  without ``Input`` and with L2 regularizers, Adam, ``compute_loss`` with
  ``tf.nn.compute_average_loss`` + ``tf.nn.scale_regularization_loss``, ``train_step`` under
  ``strategy.run`` in ``distributed_train_step``, the accuracy metric. The dataset is not
  shuffled (the comparison needs one order) and its images are 12x12 random values.
- ``guide_loop``: Keras's "Writing a training loop from scratch in TensorFlow"
  (keras-team/keras-io, guides/writing_a_custom_training_loop_in_tensorflow.py): its
  ``get_model`` MLP, a ``SparseCategoricalCrossentropy(from_logits=True)`` object, Adam and
  the ``@tf.function`` ``train_step`` with ``optimizer.apply(grads, model.trainable_weights)``
  and its metric. The guide trains on one device; here its step is the replica step of
  ``strategy.run`` inside a ``tf.function``, the way the tutorial distributes a step.
- ``user_loop``: the shape many users copy: model and optimizer created in the scope and
  not built, a per-example loss vector handed to ``tape.gradient``, ``@tf.function``
  around ``strategy.run``.
- ``convention_loop``: one small loop whose loss is written in a given convention.
- ``dcgan_loop``: TensorFlow's "Deep Convolutional Generative Adversarial Network"
  (tensorflow/docs, site/en/tutorials/generative/dcgan.ipynb): a generator and a
  discriminator, two Adam optimizers, a ``BinaryCrossentropy(from_logits=True)`` object whose
  means make ``generator_loss`` and ``discriminator_loss`` (a sum of two), and the
  ``train_step`` with two tapes and two ``apply_gradients``. Everything is created outside
  any scope, as the tutorial (which has no strategy) does, and ``prepare`` is called once per
  model; the step runs under ``strategy.run`` as the tutorial distributes a step. Dense
  layers stand in for the convolutions, and the noise is read with the images instead of
  drawn by ``tf.random.normal`` (each replica draws its own: not one device's numbers).
- ``multi_worker_loop``: TensorFlow's "Custom training loop with Keras and
  MultiWorkerMirroredStrategy" (tensorflow/docs,
  site/en/tutorials/distribute/multi_worker_with_ctl.ipynb): ``dataset_fn`` sharding by the
  input context and batching by ``get_per_replica_batch_size``, the model with ``Input`` and
  ``Reshape`` and L2 regularizers, ``distribute_datasets_from_function``, RMSprop,
  ``train_step(iterator)`` taking ``next(iterator)`` inside the ``tf.function``,
  ``compute_average_loss`` without a batch size + ``scale_regularization_loss``, the epoch and
  ``step_in_epoch`` variables. Not shuffled, 12x12 images, no checkpoint manager (tested
  elsewhere), ``tf.keras.losses.Reduction.NONE`` written as Keras 3's ``reduction=None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

Prepare = Callable[[Any, Any], Any] | None


def _seeded(seed: int) -> None:
    keras.utils.set_random_seed(seed)


def images(n: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Random 12x12x1 images in [0, 1) and labels 0-9."""
    rng = np.random.default_rng(seed)
    return rng.random((n, 12, 12, 1), dtype=np.float32), rng.integers(0, 10, n).astype("int32")


def tutorial_loop(
    strategy: tf.distribute.Strategy,
    prepare: Prepare,
    x: np.ndarray,
    y: np.ndarray,
    *,
    global_batch: int = 16,
    epochs: int = 2,
    checkpoint_to: str | None = None,
) -> list[np.ndarray]:
    """The tutorial's loop (see the module docstring); returns the trained weights."""
    _seeded(11)
    batch_size_per_replica = global_batch // strategy.num_replicas_in_sync
    global_batch_size = batch_size_per_replica * strategy.num_replicas_in_sync
    train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)

    def create_model() -> keras.Model:
        regularizer = keras.regularizers.L2(1e-5)
        return keras.Sequential(
            [
                keras.layers.Conv2D(4, 3, activation="relu", kernel_regularizer=regularizer),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(8, 3, activation="relu", kernel_regularizer=regularizer),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu", kernel_regularizer=regularizer),
                keras.layers.Dense(10, kernel_regularizer=regularizer),
            ]
        )

    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        def compute_loss(labels: Any, predictions: Any, model_losses: Any) -> Any:
            per_example_loss = loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example_loss)
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            return loss

        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        model = create_model()
        optimizer = keras.optimizers.Adam(learning_rate=0.001)
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)
    if prepare is not None:
        prepare(model, optimizer)  # the one added line

    def train_step(inputs: Any) -> Any:
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        train_accuracy.update_state(labels, predictions)
        return loss

    @tf.function
    def distributed_train_step(dataset_inputs: Any) -> Any:
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    for _ in range(epochs):
        total_loss = 0.0
        for batch in train_dist_dataset:
            total_loss += distributed_train_step(batch)
        train_accuracy.reset_state()
    if checkpoint_to is not None:
        checkpoint.save(checkpoint_to)
    return [np.asarray(w) for w in model.get_weights()]


def guide_loop(
    strategy: tf.distribute.Strategy,
    prepare: Prepare,
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch_size: int = 32,
    epochs: int = 2,
    optimizer_name: str = "adam",
    eager: bool = False,
) -> list[np.ndarray]:
    """The Keras guide's loop, its step run by ``strategy.run``; returns the weights.

    ``eager``: the guide's first loop, which runs its step eagerly (no ``tf.function``).
    """
    _seeded(12)

    def get_model() -> keras.Model:
        inputs = keras.Input(shape=(x.shape[1],), name="digits")
        x1 = keras.layers.Dense(64, activation="relu")(inputs)
        x2 = keras.layers.Dense(64, activation="relu")(x1)
        outputs = keras.layers.Dense(10, name="predictions")(x2)
        return keras.Model(inputs=inputs, outputs=outputs)

    with strategy.scope():
        model = get_model()
        if optimizer_name == "adam":
            optimizer = keras.optimizers.Adam(learning_rate=1e-3)
        else:
            optimizer = keras.optimizers.SGD(learning_rate=0.1)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
    if prepare is not None:
        prepare(model, optimizer)  # the one added line
    train_dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    dist_dataset = strategy.experimental_distribute_dataset(train_dataset)

    def train_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits)
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        train_acc_metric.update_state(y, logits)
        return loss_value

    def distributed_step(batch: Any) -> Any:
        return strategy.run(train_step, args=batch)

    step = distributed_step if eager else tf.function(distributed_step)
    for _ in range(epochs):
        for batch in dist_dataset:
            step(batch)
        train_acc_metric.reset_state()
    return [np.asarray(w) for w in model.get_weights()]


def user_loop(
    strategy: tf.distribute.Strategy,
    prepare: Prepare,
    x: np.ndarray,
    y: np.ndarray,
    *,
    optimizer_name: str = "adam",
    batch: int = 16,
    epochs: int = 2,
) -> list[np.ndarray]:
    """Model and optimizer made in the scope, unbuilt; a per-example loss vector."""
    _seeded(13)
    with strategy.scope():
        model = keras.Sequential(
            [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(int(y.max()) + 1)]
        )
        optimizer = {
            "adam": lambda: keras.optimizers.Adam(0.01),
            "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
            "sgd": lambda: keras.optimizers.SGD(0.01),
            "lso": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
        }[optimizer_name]()
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    if prepare is not None:
        prepare(model, optimizer)  # the one added line
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            losses = per_example(yb, model(xb, training=True))
            target = optimizer.scale_loss(losses) if scaled else losses
        grads = tape.gradient(target, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return losses

    @tf.function
    def train(batch: Any) -> Any:
        return strategy.run(step, args=batch)

    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    )
    for _ in range(epochs):
        for each in data:
            train(each)
    return [np.asarray(w) for w in model.get_weights()]


CONVENTIONS = (
    "keras_object",
    "reduce_mean",
    "per_example_vector",
    "compute_average_loss",
    "compute_average_loss_global",
    "divided_by_global_batch",
    "reduce_mean_plus_model_losses",
)


def convention_loop(
    strategy: tf.distribute.Strategy,
    prepare: Prepare,
    x: np.ndarray,
    y: np.ndarray,
    convention: str,
    *,
    batch: int = 16,
    epochs: int = 2,
    lr: float = 0.2,
    clip: float | None = None,
) -> tuple[list[np.ndarray], Any]:
    """A small SGD loop whose loss is written in ``convention``; returns the weights and
    the optimizer. ``clip``: the step clips its gradients to this global norm (the
    one-device reference of ``prepare_loop(clipnorm=...)``)."""
    _seeded(14)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((x.shape[1],)),
                keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2"),
                keras.layers.Dense(int(y.max()) + 1),
            ]
        )
        optimizer = keras.optimizers.SGD(lr)
        mean = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    if convention == "model_compute_loss":
        model.compile(optimizer=optimizer, loss=mean)  # what model.compute_loss computes
    if prepare is not None:
        prepare(model, optimizer)

    def step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            if convention == "model_compute_loss":  # the compiled loss and model.losses
                loss = model.compute_loss(x=xb, y=yb, y_pred=logits)
            elif convention == "keras_object":
                loss = mean(yb, logits)
            elif convention == "reduce_mean":
                loss = tf.reduce_mean(per_example(yb, logits))
            elif convention == "per_example_vector":
                loss = per_example(yb, logits)
            elif convention == "compute_average_loss":
                loss = tf.nn.compute_average_loss(per_example(yb, logits))
            elif convention == "compute_average_loss_global":
                loss = tf.nn.compute_average_loss(per_example(yb, logits), global_batch_size=batch)
            elif convention == "divided_by_global_batch":
                loss = tf.reduce_sum(per_example(yb, logits)) / batch
            elif convention == "reduce_mean_plus_model_losses":
                loss = tf.reduce_mean(per_example(yb, logits)) + tf.add_n(model.losses)
            else:
                raise ValueError(convention)
        grads = tape.gradient(loss, model.trainable_variables)
        if clip is not None:
            grads, _ = tf.clip_by_global_norm(grads, clip)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train(each: Any) -> Any:
        return strategy.run(step, args=each)

    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    )
    for _ in range(epochs):
        for each in data:
            train(each)
    return [np.asarray(w) for w in model.get_weights()], optimizer


def dcgan_loop(
    strategy: tf.distribute.Strategy,
    prepare: Prepare,
    images: np.ndarray,
    noise: np.ndarray,
    *,
    global_batch: int = 16,
    epochs: int = 2,
) -> list[np.ndarray]:
    """The DCGAN tutorial's loop (see the module docstring); returns the generator's and
    the discriminator's trained weights, then both optimizers' iterations."""
    _seeded(13)
    generator = keras.Sequential(
        [
            keras.Input((noise.shape[1],)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(images.shape[1]),
        ]
    )
    discriminator = keras.Sequential(
        [
            keras.Input((images.shape[1],)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    cross_entropy = keras.losses.BinaryCrossentropy(from_logits=True)

    def discriminator_loss(real_output: Any, fake_output: Any) -> Any:
        real_loss = cross_entropy(tf.ones_like(real_output), real_output)
        fake_loss = cross_entropy(tf.zeros_like(fake_output), fake_output)
        return real_loss + fake_loss

    def generator_loss(fake_output: Any) -> Any:
        return cross_entropy(tf.ones_like(fake_output), fake_output)

    generator_optimizer = keras.optimizers.Adam(1e-2)
    discriminator_optimizer = keras.optimizers.Adam(1e-2)
    if prepare is not None:
        prepare(generator, generator_optimizer)  # the added lines
        prepare(discriminator, discriminator_optimizer)

    def train_step(real_images: Any, latent: Any) -> Any:
        with tf.GradientTape() as gen_tape, tf.GradientTape() as disc_tape:
            generated_images = generator(latent, training=True)
            real_output = discriminator(real_images, training=True)
            fake_output = discriminator(generated_images, training=True)
            gen_loss = generator_loss(fake_output)
            disc_loss = discriminator_loss(real_output, fake_output)
        gradients_of_generator = gen_tape.gradient(gen_loss, generator.trainable_variables)
        gradients_of_discriminator = disc_tape.gradient(
            disc_loss, discriminator.trainable_variables
        )
        generator_optimizer.apply_gradients(
            zip(gradients_of_generator, generator.trainable_variables, strict=True)
        )
        discriminator_optimizer.apply_gradients(
            zip(gradients_of_discriminator, discriminator.trainable_variables, strict=True)
        )
        return gen_loss

    @tf.function
    def distributed_train_step(real_images: Any, latent: Any) -> Any:
        return strategy.run(train_step, args=(real_images, latent))

    dataset = tf.data.Dataset.from_tensor_slices((images, noise)).batch(global_batch)
    for _ in range(epochs):
        for real_images, latent in strategy.experimental_distribute_dataset(dataset):
            distributed_train_step(real_images, latent)
    return [
        *generator.get_weights(),
        *discriminator.get_weights(),
        generator_optimizer.iterations.numpy(),
        discriminator_optimizer.iterations.numpy(),
    ]


def multi_worker_loop(
    strategy: tf.distribute.Strategy,
    prepare: Prepare,
    x: np.ndarray,
    y: np.ndarray,
    *,
    global_batch: int = 16,
    epochs: int = 2,
) -> list[np.ndarray]:
    """The multi-worker custom-loop tutorial's loop (see the module docstring); returns the
    trained weights and the optimizer's iterations."""
    _seeded(17)
    side = x.shape[1]

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch_size = input_context.get_per_replica_batch_size(global_batch)
        dataset = tf.data.Dataset.from_tensor_slices((x[..., 0], y.astype(np.int64)))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return dataset.batch(batch_size)

    def build_cnn_model() -> keras.Model:
        regularizer = keras.regularizers.L2(1e-5)
        return keras.Sequential(
            [
                keras.Input(shape=(side, side)),
                keras.layers.Reshape(target_shape=(side, side, 1)),
                keras.layers.Conv2D(4, 3, activation="relu", kernel_regularizer=regularizer),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu", kernel_regularizer=regularizer),
                keras.layers.Dense(10, kernel_regularizer=regularizer),
            ]
        )

    with strategy.scope():
        multi_worker_model = build_cnn_model()
        multi_worker_dataset = strategy.distribute_datasets_from_function(dataset_fn)
        optimizer = keras.optimizers.RMSprop(learning_rate=0.001)
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    if prepare is not None:
        prepare(multi_worker_model, optimizer)  # the one added line

    @tf.function
    def train_step(iterator: Any) -> Any:
        def step_fn(inputs: Any) -> Any:
            x, y = inputs
            with tf.GradientTape() as tape:
                predictions = multi_worker_model(x, training=True)
                per_example_loss = keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction=None
                )(y, predictions)
                loss = tf.nn.compute_average_loss(per_example_loss)
                model_losses = multi_worker_model.losses
                if model_losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            grads = tape.gradient(loss, multi_worker_model.trainable_variables)
            optimizer.apply_gradients(
                zip(grads, multi_worker_model.trainable_variables, strict=True)
            )
            train_accuracy.update_state(y, predictions)
            return loss

        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    epoch = tf.Variable(initial_value=tf.constant(0, dtype=tf.dtypes.int64), name="epoch")
    step_in_epoch = tf.Variable(
        initial_value=tf.constant(0, dtype=tf.dtypes.int64), name="step_in_epoch"
    )
    num_steps_per_epoch = len(x) // global_batch
    while epoch.numpy() < epochs:
        iterator = iter(multi_worker_dataset)
        total_loss = 0.0
        num_batches = 0
        while step_in_epoch.numpy() < num_steps_per_epoch:
            total_loss += train_step(iterator)
            num_batches += 1
            step_in_epoch.assign_add(1)
        train_accuracy.reset_state()
        epoch.assign_add(1)
        step_in_epoch.assign(0)
    return [*multi_worker_model.get_weights(), np.asarray(optimizer.iterations.numpy())]
