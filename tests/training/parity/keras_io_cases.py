"""Cases drawn from keras-io examples and guides (keras-team/keras-io, ``examples/`` and
``guides/``), shrunk to a few steps on random data."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from . import common
from .common import (
    FEATURES,
    SEED,
    binary,
    classification,
    compiled,
    dataset,
    mlp,
    regression,
    tokens,
    with_dense_gradients,
)
from .registry import Case, Run, Train, same_history, same_iterations, same_weights

IO = "keras-io"
X, Y = regression()
XC, YC = classification()
XB, YB = binary()
TOKENS, TOKEN_LABELS = tokens()
PADDED, PADDED_LABELS = tokens(pad=True, seed=12)
IMAGES = np.random.default_rng(21).normal(size=(32, 8, 8, 1)).astype("float32")
IMAGE_LABELS = (IMAGES.mean(axis=(1, 2, 3)) > 0).astype("int32")


def _exact(*more: Any) -> list[Any]:
    return [same_weights(), same_history(), same_iterations, *more]


# -- vision -----------------------------------------------------------------------------------
def _mnist_mlp() -> Any:
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    return compiled(
        model,
        optimizer=keras.optimizers.RMSprop(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )


def _convnet() -> Any:
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(4, 2, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    return compiled(
        model,
        loss="categorical_crossentropy",
        metrics=["accuracy"],
    )


def _autoencoder() -> Any:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, activation="relu", padding="same", strides=2)(inputs)
    h = keras.layers.Conv2DTranspose(4, 3, activation="relu", padding="same", strides=2)(h)
    outputs = keras.layers.Conv2D(1, 3, padding="same")(h)
    return compiled(keras.Model(inputs, outputs))


def _batchnorm() -> Any:
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(1),
        ]
    )
    return compiled(model)


def _as_keras_under_mirrored(build: Any, fit: Any, differs_by: float = 1e-4) -> Any:
    """tfscale equals Keras's own model.fit under the same MirroredStrategy, and both differ
    from one device by more than ``differs_by``."""

    def check(expected: Run, got: Run) -> None:
        with got.model.distribute_strategy.scope():
            model = build()
        model.set_weights(got.initial_weights)
        history = model.fit(shuffle=False, verbose=0, **fit())
        mirrored = Run(model, history, {}, got.initial_weights)
        same_weights()(mirrored, got)
        same_history()(mirrored, got)
        assert common.relative_difference_of(expected.model, got.model) > differs_by

    return check


# -- text --------------------------------------------------------------------------------------
# The text cases' batches repeat token ids, so their reference is one device with dense
# gradients (``with_dense_gradients``): tfscale makes the dense gradient's update, where
# Keras's one-device sparse Adam or RMSprop squares each lookup's entry on its own
# (docs/training.md, "Sparse gradients"). The transformer block trains with SGD: the same
# either way.
def _lstm_classifier(bidirectional: bool = False, cell: type = keras.layers.LSTM) -> Any:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(30, 8)(inputs)
    recurrent = cell(8)
    h = keras.layers.Bidirectional(recurrent)(h) if bidirectional else recurrent(h)
    outputs = keras.layers.Dense(1, activation="sigmoid")(h)
    return compiled(
        keras.Model(inputs, outputs),
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )


def _masked_tagger() -> Any:
    """Token-level outputs on zero-padded sequences: the mask weights each token's loss."""
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(30, 8, mask_zero=True)(inputs)
    h = keras.layers.GRU(8, return_sequences=True)(h)
    outputs = keras.layers.Dense(2, activation="softmax")(h)
    return compiled(
        keras.Model(inputs, outputs),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


TAGS = (PADDED % 2).astype("int32")


def _masked_data() -> dict[str, Any]:
    return {"x": PADDED, "y": TAGS, "batch_size": 16, "epochs": 2}


def _transformer() -> Any:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(30, 8)(inputs)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = keras.layers.LayerNormalization()(h + attended)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(8)(keras.layers.Dense(16)(h)))
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
    return compiled(
        keras.Model(inputs, outputs),
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def _whole_model_weights(expected: Run, got: Run) -> None:
    # The attention's key bias has an exactly zero gradient (softmax ignores a shift): compare
    # over the whole model, where per-array it would compare rounding noise with noise.
    flat = [np.concatenate([w.ravel() for w in r.model.get_weights()]) for r in (got, expected)]
    assert common.relative_difference_of_arrays(flat[0], flat[1]) <= 1e-4


# -- generative and overridden steps -----------------------------------------------------------
class Sampling(keras.layers.Layer):
    """The VAE's reparameterization; its noise is an input here (seeded, same per replica
    split as one device)."""

    def call(self, inputs: Any) -> Any:
        mean, log_var, noise = inputs
        return mean + tf.exp(0.5 * log_var) * noise


class VAE(keras.Model):
    """keras-io ``examples/generative/vae.py``: a train_step computing its own losses (x only)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        keras.utils.set_random_seed(SEED)
        self.encoder_dense = keras.layers.Dense(8, activation="relu")
        self.mean = keras.layers.Dense(2)
        self.log_var = keras.layers.Dense(2)
        self.sampling = Sampling()
        self.decoder_dense = keras.layers.Dense(8, activation="relu")
        self.decoder_out = keras.layers.Dense(FEATURES)
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self) -> list[Any]:
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def call(self, inputs: Any) -> Any:
        x, noise = inputs[:, :FEATURES], inputs[:, FEATURES:]
        h = self.encoder_dense(x)
        mean, log_var = self.mean(h), self.log_var(h)
        z = self.sampling([mean, log_var, noise])
        return self.decoder_out(self.decoder_dense(z)), mean, log_var

    def train_step(self, data: Any) -> dict[str, Any]:
        # x only, as in the example; the sampling noise travels in its last 2 columns.
        x = data[:, :FEATURES]
        with tf.GradientTape() as tape:
            reconstruction, mean, log_var = self(data, training=True)
            reconstruction_loss = tf.reduce_mean(tf.reduce_sum(tf.square(x - reconstruction), 1))
            kl = -0.5 * (1 + log_var - tf.square(mean) - tf.exp(log_var))
            kl_loss = tf.reduce_mean(tf.reduce_sum(kl, axis=1))
            total_loss = reconstruction_loss + kl_loss
        gradients = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_weights, strict=True))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {m.name: m.result() for m in self.metrics}


NOISE = np.random.default_rng(31).normal(size=(len(X), 2)).astype("float32")
X_AND_NOISE = np.concatenate([X, NOISE], axis=1)


def _vae() -> Any:
    model = VAE()
    model(X_AND_NOISE[:2])
    model.compile(keras.optimizers.Adam(0.01))
    return model


class GAN(keras.Model):
    """keras-io ``examples/generative/dcgan_overriding_train_step.py``: no ``call``, two
    optimizers set by its own ``compile``, a ``train_step`` with two tapes and two updates.
    Its latent vectors come with the data here (seeded, the same per example on any number of
    replicas) instead of ``keras.random.normal``, and its labels carry no noise, so that one
    device's run is the exact reference."""

    def __init__(self, discriminator: Any, generator: Any) -> None:
        super().__init__()
        self.discriminator, self.generator = discriminator, generator

    def compile(self, d_optimizer: Any, g_optimizer: Any, loss_fn: Any) -> None:  # type: ignore[override]
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    def train_step(self, data: Any) -> Any:
        real, latent, more_latent = data
        batch = tf.shape(real)[0]
        combined = tf.concat([self.generator(latent), real], axis=0)
        labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights, strict=True)
        )
        with tf.GradientTape() as tape:
            fake = self.discriminator(self.generator(more_latent))
            g_loss = self.loss_fn(tf.zeros((batch, 1)), fake)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights, strict=True))
        return {"d_loss": d_loss, "g_loss": g_loss}


REAL = np.random.default_rng(61).normal(size=(64, 6)).astype("float32")
LATENTS = [np.random.default_rng(seed).normal(size=(64, 4)).astype("float32") for seed in (62, 63)]


def _gan() -> Any:
    keras.utils.set_random_seed(SEED)
    discriminator = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    generator = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(6)]
    )
    gan = GAN(discriminator, generator)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(3e-3),
        g_optimizer=keras.optimizers.Adam(3e-3),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return gan


def _both_optimizers_stepped(expected: Run, got: Run) -> None:
    for name in ("d_optimizer", "g_optimizer"):
        counts = [int(getattr(run.model, name).iterations.numpy()) for run in (expected, got)]
        assert counts == [8, 8], (name, counts)


class LogisticEndpoint(keras.layers.Layer):
    """keras-io functional API guide's endpoint layer: add_loss and a metric inside a layer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, targets: Any, logits: Any) -> Any:
        self.add_loss(self.loss_fn(targets, logits))
        return tf.nn.sigmoid(logits)


def _endpoint() -> Any:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((FEATURES,), name="inputs")
    targets = keras.Input((1,), name="targets")
    logits = keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs))
    predictions = LogisticEndpoint()(targets, logits)
    model = keras.Model({"inputs": inputs, "targets": targets}, predictions)
    model.compile(keras.optimizers.Adam(0.01))
    return model


class GradientModel(keras.Model):
    """keras-io "customizing what happens in fit": compute_loss, apply_gradients and
    compiled metrics by hand, with sample weights."""

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class CustomLossModel(keras.Model):
    """keras-io "customizing what happens in fit": a compute_loss override (Huber + L2)."""

    def compute_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool) -> Any:
        del x, training
        loss = keras.losses.Huber()(y, y_pred, sample_weight=sample_weight)
        return loss + 1e-3 * tf.add_n([tf.reduce_sum(w**2) for w in self.trainable_weights])


_MLM_LOSS = keras.losses.SparseCategoricalCrossentropy(reduction=None)
MASK_ID = 29


class MaskedLanguageModel(keras.Model):
    """keras-io ``examples/nlp/masked_language_modeling.py``: ``compute_loss`` returns the
    sum over the batch of a ``reduction=None`` loss weighted to the masked tokens, with a
    loss tracker of its own as the model's only metric."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def compute_loss(
        self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None
    ) -> Any:
        loss = _MLM_LOSS(y, y_pred, sample_weight)
        self.loss_tracker.update_state(loss, sample_weight=sample_weight)
        return keras.ops.sum(loss)

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
        return {"loss": self.loss_tracker.result()}

    @property
    def metrics(self) -> list[Any]:
        return [self.loss_tracker]


def _masked_language_model() -> Any:
    """The example's model with one feed-forward layer for its encoder blocks, and SGD, where
    the update's scale shows (Adam's normalized step hides a gradient N times too small)."""
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((TOKENS.shape[1],), dtype="int32")
    h = keras.layers.Embedding(30, 8)(inputs)
    h = keras.layers.Dense(8, activation="relu")(h)
    outputs = keras.layers.Dense(30, activation="softmax")(h)
    model = MaskedLanguageModel(inputs, outputs, name="masked_bert_model")
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    return model


def _masked_tokens() -> dict[str, Any]:
    """The example's ``get_masked_input_and_labels``: 15% of the tokens replaced by the mask
    token, the labels the original tokens, weight 1 on the masked ones only."""
    masked = np.random.default_rng(46).random(TOKENS.shape) < 0.15
    x = np.where(masked, MASK_ID, TOKENS).astype("int32")
    return {
        "x": x, "y": TOKENS, "sample_weight": masked.astype("float32"), "batch_size": 16,
        "epochs": 2,
    }  # fmt: skip


CAPTCHAS = np.random.default_rng(47).random((32, 16, 8, 1)).astype("float32")
CAPTCHA_LABELS = np.random.default_rng(48).integers(1, 6, size=(32, 3)).astype("int32")


class CTCLayer(keras.layers.Layer):
    """keras-io ``examples/vision/captcha_ocr.py``'s endpoint: the per-example CTC losses,
    shape (batch, 1), handed to ``add_loss`` (Keras sums each ``add_loss`` value: the batch's
    sum on one device). ``keras.ops.ctc_loss`` of the log-probabilities stands for the
    example's ``tf.compat.v1.nn.ctc_loss`` (blank 0 here, the last class there)."""

    def call(self, y_true: Any, y_pred: Any) -> Any:
        batch = keras.ops.shape(y_true)[0]
        label_length = keras.ops.full((batch,), keras.ops.shape(y_true)[1], dtype="int32")
        input_length = keras.ops.full((batch,), keras.ops.shape(y_pred)[1], dtype="int32")
        log_probabilities = keras.ops.log(y_pred + keras.backend.epsilon())
        loss = keras.ops.ctc_loss(
            keras.ops.cast(y_true, "int32"), log_probabilities, label_length, input_length
        )
        self.add_loss(keras.ops.expand_dims(loss, 1))
        return y_pred


def _captcha_ocr() -> Any:
    """The example's model (convolution, pooling, reshape to time steps, a bidirectional
    LSTM, softmax, the CTC layer) at a tenth of its size, without dropout, and SGD, where
    the update's scale shows."""
    keras.utils.set_random_seed(SEED)
    image = keras.Input((16, 8, 1), name="image")
    labels = keras.Input((None,), name="label", dtype="float32")
    x = keras.layers.Conv2D(4, 3, activation="relu", padding="same")(image)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Reshape((8, 4 * 4))(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    x = keras.layers.Bidirectional(keras.layers.LSTM(4, return_sequences=True))(x)
    x = keras.layers.Dense(6, activation="softmax")(x)
    model = keras.Model([image, labels], CTCLayer(name="ctc_loss")(labels, x))
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    return model


def _captcha_data() -> dict[str, Any]:
    return {
        "x": {"image": CAPTCHAS, "label": CAPTCHA_LABELS.astype("float32")}, "batch_size": 16,
        "epochs": 2, "validation_split": 0.25,
    }  # fmt: skip


# -- several inputs and outputs ----------------------------------------------------------------
TITLES = tokens(64, 5, 30, seed=41)[0]
BODIES = tokens(64, 8, 30, seed=42)[0]
TAG_FEATURES = (np.random.default_rng(43).random((64, 4)) > 0.5).astype("float32")
PRIORITY = np.random.default_rng(44).random((64, 1)).astype("float32")
DEPARTMENT = np.random.default_rng(45).integers(0, 3, 64).astype("int32")


def _tickets() -> Any:
    """keras-io functional API guide: the ticket ranking model (3 inputs, 2 outputs)."""
    keras.utils.set_random_seed(SEED)
    title = keras.Input((None,), name="title", dtype="int32")
    body = keras.Input((None,), name="body", dtype="int32")
    tags = keras.Input((4,), name="tags")
    title_features = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(30, 4)(title))
    body_features = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(30, 4)(body))
    merged = keras.layers.concatenate([title_features, body_features, tags])
    priority = keras.layers.Dense(1, name="priority")(merged)
    department = keras.layers.Dense(3, name="department")(merged)
    model = keras.Model(
        {"title": title, "body": body, "tags": tags},
        {"priority": priority, "department": department},
    )
    return compiled(
        model,
        optimizer=keras.optimizers.RMSprop(0.01),
        loss={
            "priority": keras.losses.BinaryCrossentropy(from_logits=True),
            "department": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        },
        loss_weights={"priority": 1.0, "department": 0.2},
    )


def _ticket_data() -> dict[str, Any]:
    return {
        "x": {"title": TITLES, "body": BODIES, "tags": TAG_FEATURES},
        "y": {"priority": PRIORITY, "department": DEPARTMENT},
        "batch_size": 16,
        "epochs": 2,
    }


# -- structured data -------------------------------------------------------------------------------
# examples/structured_data/structured_data_classification_from_scratch.py: numeric columns
# through Normalization layers adapted on the training data, integer and string categories
# through IntegerLookup / StringLookup (lookup tables) adapted on it, a dict of inputs with a
# string one, and a Layer that concatenates them. The model is built outside any scope, as
# there; its Dropout(0.5) is left out (each replica draws its own mask: README).
_RNG = np.random.default_rng(51)
NUMERIC = {name: _RNG.normal(50, 10, (64, 1)).astype("float32") for name in ("age", "chol")}
CATEGORIES = {
    "cp": _RNG.integers(0, 5, (64, 1)).astype("int64"),
    "thal": _RNG.choice(np.array(["fixed", "normal", "reversible"]), (64, 1)),
}
HEART = (NUMERIC["age"][:, 0] + 3 * CATEGORIES["cp"][:, 0] > 55).astype("float32")


class _Classifier(keras.layers.Layer):  # type: ignore[misc]
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dense_1 = keras.layers.Dense(8, activation="relu")
        self.dense_2 = keras.layers.Dense(1, activation="sigmoid")

    def call(self, inputs: dict[str, Any]) -> Any:
        return self.dense_2(self.dense_1(keras.layers.concatenate(list(inputs.values()))))

    def build(self, input_shape: Any) -> None:
        self.built = True


def _structured() -> Any:
    keras.utils.set_random_seed(SEED)
    inputs, encoded = {}, {}
    for name, column in NUMERIC.items():
        inputs[name] = keras.Input((1,), name=name, dtype="float32")
        normalize = keras.layers.Normalization()
        normalize.adapt(column)
        encoded[name] = normalize(inputs[name])
    for name, column in CATEGORIES.items():
        string = column.dtype.kind == "U"
        inputs[name] = keras.Input((1,), name=name, dtype="string" if string else "int64")
        lookup = (keras.layers.StringLookup if string else keras.layers.IntegerLookup)(
            output_mode="one_hot"
        )
        lookup.adapt(column)
        encoded[name] = lookup(inputs[name])
    model = keras.Model(inputs, _Classifier()(encoded))
    return compiled(
        model,
        optimizer=keras.optimizers.Adam(0.01),
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )


def _heart_data() -> dict[str, Any]:
    rows = {**NUMERIC, **CATEGORIES}
    return {
        "x": dataset(rows, HEART, 16),
        "epochs": 2,
        "validation_data": dataset(rows, HEART, 16),
    }


# -- inputs --------------------------------------------------------------------------------------
class Batches(keras.utils.PyDataset):  # type: ignore[misc]
    """keras-io: a ``keras.utils.PyDataset`` of in-order batches."""

    def __init__(self, x: Any, y: Any, batch: int) -> None:
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self) -> int:
        return int(np.ceil(len(self.x) / self.batch))

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        part = slice(index * self.batch, (index + 1) * self.batch)
        return self.x[part], self.y[part]


def _seeded_shuffle(reshuffle: bool = True) -> Any:
    def make() -> dict[str, Any]:
        data = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(
            64, seed=3, reshuffle_each_iteration=reshuffle
        )
        return {"x": data.batch(16), "epochs": 3}

    return make


def _same_as_one_iterator(expected: Run, got: Run) -> None:
    """tfscale equals one device reading the same dataset repeated through one iterator, and
    differs from Keras's iterator per epoch (other epoch orders)."""
    with tf.device("/device:CPU:0"):
        model = common.regressor()
        model.set_weights(got.initial_weights)
        data = _seeded_shuffle()()["x"]
        history = model.fit(data.repeat(3), steps_per_epoch=4, epochs=3, verbose=0)
    one_iterator = Run(model, history, {}, got.initial_weights)
    same_weights()(one_iterator, got)
    same_history()(one_iterator, got)
    same_iterations(expected, got)
    assert common.relative_difference_of(expected.model, got.model) > 1e-4


# -- precision ---------------------------------------------------------------------------------
def _mixed(policy: str, optimizer: Any) -> Any:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh", dtype=policy)(inputs)
    outputs = keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(4, dtype=policy)(hidden))
    return compiled(keras.Model(inputs, outputs), optimizer=optimizer)


def _bf16_model() -> Any:
    return _mixed("mixed_bfloat16", keras.optimizers.SGD(0.05))


def _fp16_scaled_256() -> Any:
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=256)
    return _mixed("mixed_float16", scaled)


def _fp16_dynamic() -> Any:
    return _mixed("mixed_float16", keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)))


def _same_dynamic_scale(expected: Run, got: Run) -> None:
    scales = [float(run.model.optimizer.dynamic_scale.numpy()) for run in (expected, got)]
    assert scales[0] == scales[1], scales


_HALF_PRECISION = (
    "half-precision layers compute each replica's share of the batch in bfloat16/float16, "
    "whose rounding differs from one device's over the whole batch (the float32 variables "
    "then drift apart by that rounding, compounded over the steps); tfscale equals Keras's "
    "own model.fit under the same MirroredStrategy exactly, and float32 layers match one "
    "device to 1e-6"
)


# -- transfer learning ----------------------------------------------------------------------------
def _pretrained() -> Any:
    keras.utils.set_random_seed(SEED)
    base = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu", name="base")],
        name="base_model",
    )
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(1, name="head")(base(inputs, training=False))
    model = keras.Model(inputs, outputs)
    base.trainable = False
    return compiled(model)


def _freeze_then_fine_tune(model: Any, train: Train, arguments: dict[str, Any]) -> Any:
    """keras-io transfer learning guide: train the head, unfreeze the base, recompile with a
    low learning rate, fine-tune."""
    train(model, **arguments)
    model.layers[1].trainable = True
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return train(model, **arguments)


# -- metrics ------------------------------------------------------------------------------
class TruePositives(keras.metrics.Metric):
    """keras-io "training with built-in methods": a stateful custom metric."""

    def __init__(self, name: str = "true_positives", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        predicted = tf.cast(y_pred > 0.5, "float32")
        values = tf.cast(tf.equal(tf.cast(y_true, "float32"), 1.0), "float32") * predicted
        if sample_weight is not None:
            values *= tf.cast(sample_weight, "float32")
        self.count.assign_add(tf.reduce_sum(values))

    def result(self) -> Any:
        return self.count

    def reset_state(self) -> None:
        self.count.assign(0.0)


def _binary(**compile_args: Any) -> Any:
    return compiled(mlp(1, "sigmoid"), loss="binary_crossentropy", **compile_args)


def _binary_arrays(**extra: Any) -> Any:
    return lambda: {"x": XB, "y": YB, "batch_size": 16, "epochs": 2, **extra}


def _accumulating(optimizer: str) -> Any:
    def build() -> Any:
        opt = {"sgd": keras.optimizers.SGD(0.05), "adam": keras.optimizers.Adam(0.01)}[optimizer]
        return compiled(mlp(), optimizer=opt)

    return build


def _keras_accumulating(optimizer: str) -> Any:
    def build() -> Any:
        opt = {
            "sgd": keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
            "adam": keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
        }[optimizer]
        return compiled(mlp(), optimizer=opt)

    return build


def _arrays(**extra: Any) -> Any:
    return lambda: {"x": X, "y": Y, "batch_size": 16, "epochs": 2, **extra}


def _dropout() -> Any:
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.5, seed=7),
            keras.layers.Dense(1),
        ]
    )
    return compiled(model)


def _dropout_checks(expected: Run, got: Run) -> None:
    same_iterations(expected, got)
    assert all(np.isfinite(w).all() for w in got.model.get_weights())
    assert sorted(got.history.history) == sorted(expected.history.history)
    # Each replica draws its own mask for its half of the batch: not one device's mask.
    assert common.relative_difference_of(expected.model, got.model) > 1e-4


CASES = [
    Case(
        "mnist_mlp_validation_split",
        f"{IO} examples/vision/mnist_convnet.py (MLP variant, validation_split)",
        _mnist_mlp,
        lambda: {"x": IMAGES, "y": IMAGE_LABELS, "batch_size": 8, "validation_split": 0.25},
    ),
    Case(
        "mnist_convnet",
        f"{IO} examples/vision/mnist_convnet.py",
        _convnet,
        lambda: {
            "x": IMAGES,
            "y": keras.utils.to_categorical(IMAGE_LABELS, 2),
            "batch_size": 8,
            "epochs": 2,
            "validation_split": 0.25,
        },
    ),
    Case(
        "conv_autoencoder",
        f"{IO} examples/vision/autoencoder.py",
        _autoencoder,
        lambda: {"x": IMAGES, "y": IMAGES, "batch_size": 8, "epochs": 2},
    ),
    Case(
        "batchnorm_per_replica_statistics",
        f"{IO} guides/training_with_built_in_methods.py (BatchNormalization)",
        _batchnorm,
        _arrays(),
        checks=[_as_keras_under_mirrored(_batchnorm, _arrays())],
        known_difference=(
            "under a strategy each replica's BatchNormalization normalizes with its own share "
            "of the batch (Keras's model.fit does the same): tfscale equals Keras's model.fit "
            "under the same MirroredStrategy, and sync_batchnorm=True gives one device's"
        ),
    ),
    Case(
        "batchnorm_synchronized",
        f"{IO} guides/distributed_training_with_tensorflow.py (SyncBatchNorm)",
        _batchnorm,
        _arrays(),
        options={"sync_batchnorm": True},
    ),
    Case(
        "lstm_text_classification",
        f"{IO} examples/nlp/bidirectional_lstm_imdb.py (LSTM)",
        _lstm_classifier,
        lambda: {"x": TOKENS, "y": TOKEN_LABELS, "batch_size": 16, "epochs": 2},
        reference_build=with_dense_gradients(_lstm_classifier),
    ),
    Case(
        "bidirectional_gru_text_classification",
        f"{IO} examples/nlp/bidirectional_lstm_imdb.py (Bidirectional GRU)",
        lambda: _lstm_classifier(True, keras.layers.GRU),
        lambda: {"x": TOKENS, "y": TOKEN_LABELS, "batch_size": 16, "epochs": 2},
        reference_build=with_dense_gradients(lambda: _lstm_classifier(True, keras.layers.GRU)),
    ),
    Case(
        "masked_token_loss",
        f"{IO} examples/nlp/ner_transformers.py (masked per-token loss)",
        _masked_tagger,
        _masked_data,
        # Each replica's masked mean is made its share of the batch's (its unmasked tokens
        # over the batch's): one device's weights (Keras's own fit under MirroredStrategy
        # divides by each replica's own tokens). Keras 3.16's pre-releases drop the mask at
        # the GRU: a mean over every token there.
        reference_build=with_dense_gradients(_masked_tagger),
    ),
    Case(
        "masked_language_model_summed_loss",
        f"{IO} examples/nlp/masked_language_modeling.py (compute_loss returns a sum)",
        _masked_language_model,
        _masked_tokens,
    ),
    Case(
        "captcha_ocr_add_loss_per_example",
        f"{IO} examples/vision/captcha_ocr.py (an add_loss of per-example CTC losses)",
        _captcha_ocr,
        _captcha_data,
    ),
    Case(
        "transformer_block",
        f"{IO} examples/nlp/text_classification_with_transformer.py",
        _transformer,
        lambda: {"x": TOKENS, "y": TOKEN_LABELS, "batch_size": 8, "epochs": 1},
        checks=[_whole_model_weights, same_history(), same_iterations],
    ),
    Case(
        "vae_train_step_x_only",
        f"{IO} examples/generative/vae.py",
        _vae,
        lambda: {"x": X_AND_NOISE, "batch_size": 16, "epochs": 2},
    ),
    Case(
        "endpoint_layer_add_loss",
        f"{IO} guides/functional_api.py (endpoint layer pattern)",
        _endpoint,
        lambda: {"x": {"inputs": XB, "targets": YB}, "batch_size": 16, "epochs": 2},
    ),
    Case(
        "custom_train_step_sample_weight",
        f"{IO} guides/custom_train_step_in_tensorflow.py (sample_weight)",
        lambda: compiled(mlp(cls=GradientModel), metrics=["mae"]),
        _arrays(sample_weight=np.linspace(0.2, 2.0, len(X)).astype("float32")),
    ),
    Case(
        "custom_compute_loss",
        f"{IO} guides/custom_train_step_in_tensorflow.py (compute_loss override)",
        lambda: compiled(mlp(cls=CustomLossModel)),
        _arrays(),
    ),
    Case(
        "multi_input_multi_output_loss_weights",
        f"{IO} guides/functional_api.py (ticket ranking, dict inputs, loss_weights)",
        _tickets,
        _ticket_data,
        reference_build=with_dense_gradients(_tickets),  # token ids repeat: see "text" above
    ),
    Case(
        "gan_two_optimizers_no_call",
        f"{IO} examples/generative/dcgan_overriding_train_step.py (no call, two optimizers)",
        _gan,
        lambda: {"x": dataset(REAL, LATENTS[0], 16, LATENTS[1]), "epochs": 2},
        checks=_exact(_both_optimizers_stepped),
    ),
    Case(
        "structured_data_preprocessing_layers",
        f"{IO} examples/structured_data/structured_data_classification_from_scratch.py "
        "(Normalization, IntegerLookup and StringLookup adapted, dict inputs)",
        _structured,
        _heart_data,
    ),
    Case(
        "sample_weight",
        f"{IO} guides/training_with_built_in_methods.py (sample weights)",
        lambda: common.classifier(),
        lambda: {
            "x": XC,
            "y": YC,
            "batch_size": 16,
            "epochs": 2,
            "sample_weight": np.where(YC == 1, 2.0, 0.5).astype("float32"),
        },
    ),
    Case(
        "class_weight",
        f"{IO} guides/training_with_built_in_methods.py (class weights)",
        lambda: common.classifier(),
        lambda: {
            "x": XC,
            "y": YC,
            "batch_size": 16,
            "epochs": 2,
            "class_weight": {0: 1.0, 1: 3.0, 2: 0.5},
        },
    ),
    Case(
        "py_dataset",
        f"{IO} guides/training_with_built_in_methods.py (PyDataset)",
        common.regressor,
        lambda: {"x": Batches(X, Y, 16), "epochs": 2},
    ),
    Case(
        "tf_data_seeded_shuffle",
        f"{IO} guides/training_with_built_in_methods.py (tf.data, shuffle(seed=))",
        common.regressor,
        _seeded_shuffle(),
        checks=[_same_as_one_iterator],
        known_difference=(
            "tfscale repeats a finite dataset for the fit's epochs (one iterator per fit); "
            "with shuffle(seed=..., reshuffle_each_iteration=True) each repetition draws "
            "another seeded order than Keras's new iterator per epoch does: tfscale equals "
            "one device reading dataset.repeat(epochs)"
        ),
    ),
    Case(
        "tf_data_seeded_shuffle_fixed_order",
        f"{IO} guides/training_with_built_in_methods.py (tf.data, shuffle once)",
        common.regressor,
        _seeded_shuffle(reshuffle=False),
    ),
    Case(
        "tf_data_with_validation_dataset",
        f"{IO} guides/training_with_built_in_methods.py (validation_data=dataset)",
        lambda: common.regressor(metrics=["mae"]),
        lambda: {
            "x": dataset(X, Y, 16),
            "validation_data": dataset(X[:32], Y[:32], 8),
            "epochs": 2,
        },
    ),
    Case(
        "steps_per_epoch_iterator_continues",
        f"{IO} guides/training_with_built_in_methods.py (steps_per_epoch on a dataset)",
        common.regressor,
        lambda: {"x": dataset(X, Y, 8), "steps_per_epoch": 3, "epochs": 2},
    ),
    Case(
        "initial_epoch",
        f"{IO} guides/training_with_built_in_methods.py (initial_epoch)",
        common.regressor,
        _arrays(epochs=4, initial_epoch=2),
    ),
    Case(
        "validation_freq",
        f"{IO} guides/training_with_built_in_methods.py (validation_freq)",
        common.regressor,
        _arrays(epochs=4, validation_data=(X[:32], Y[:32]), validation_freq=2),
    ),
    Case(
        "validation_batch_size",
        f"{IO} guides/training_with_built_in_methods.py (validation_batch_size)",
        common.regressor,
        _arrays(validation_data=(X[:30], Y[:30]), validation_batch_size=7),
    ),
    Case(
        "mixed_bfloat16_policy",
        f"{IO} guides/mixed_precision (mixed_bfloat16 layers)",
        _bf16_model,
        _arrays(),
        checks=[_as_keras_under_mirrored(_bf16_model, _arrays(), differs_by=0.0)],
        known_difference=_HALF_PRECISION,
    ),
    Case(
        "loss_scale_optimizer_no_overflow",
        f"{IO} guides/mixed_precision (mixed_float16 + LossScaleOptimizer, initial_scale=256)",
        _fp16_scaled_256,
        _arrays(),
        checks=[_as_keras_under_mirrored(_fp16_scaled_256, _arrays(), differs_by=0.0)],
        known_difference=_HALF_PRECISION,
    ),
    Case(
        "loss_scale_optimizer_mixed_float16",
        f"{IO} guides/mixed_precision (mixed_float16 + LossScaleOptimizer)",
        _fp16_dynamic,
        _arrays(),
        # One device's updates and skips: the float16 backward pass carries one device's
        # magnitudes (it carried N times before, and the dynamic scale overflowed sooner).
        checks=[
            _as_keras_under_mirrored(_fp16_dynamic, _arrays(), differs_by=0.0),
            same_iterations,
            _same_dynamic_scale,
        ],
        known_difference=_HALF_PRECISION,
    ),
    Case(
        "transfer_learning_freeze_then_fine_tune",
        f"{IO} guides/transfer_learning.py (freeze, train head, unfreeze, fine-tune)",
        _pretrained,
        _arrays(),
        procedure=_freeze_then_fine_tune,
    ),
    Case(
        "auc_precision_recall_metrics",
        f"{IO} examples/structured_data/imbalanced_classification.py (AUC, precision, recall)",
        lambda: _binary(
            metrics=[
                keras.metrics.AUC(name="auc"),
                keras.metrics.Precision(name="precision"),
                keras.metrics.Recall(name="recall"),
            ]
        ),
        _binary_arrays(validation_data=(XB[:32], YB[:32])),
    ),
    Case(
        "custom_metric_true_positives",
        f"{IO} guides/training_with_built_in_methods.py (custom Metric)",
        lambda: _binary(metrics=[TruePositives()]),
        _binary_arrays(),
    ),
    Case(
        "gradient_accumulation_sgd",
        f"{IO} (optimizer gradient_accumulation_steps=2) against tfscale accumulation_steps=2",
        _accumulating("sgd"),
        _arrays(),
        reference_build=_keras_accumulating("sgd"),
        options={"accumulation_steps": 2},
    ),
    Case(
        "gradient_accumulation_adam",
        f"{IO} (optimizer gradient_accumulation_steps=2) against tfscale accumulation_steps=2",
        _accumulating("adam"),
        _arrays(),
        reference_build=_keras_accumulating("adam"),
        options={"accumulation_steps": 2},
    ),
    Case(
        "dropout",
        f"{IO} examples/vision/mnist_convnet.py (Dropout)",
        _dropout,
        _arrays(),
        checks=[_dropout_checks],
        known_difference=(
            "each replica draws its own dropout mask for its share of the batch, so the "
            "masks are not one device's"
        ),
    ),
]
