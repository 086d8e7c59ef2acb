"""``tfscale.gather_batch``: a loss over the whole batch (a contrastive loss over in-batch
negatives) is one device's on 2 replicas, also where the batches split unevenly, and
refused where its gradient cannot carry tfscale's weighting. CLIP's local loss (each
replica's examples against the gathered batch, ``return_offset=True``) too.

The model is keras-io's dual encoder ("Natural language image search with a Dual Encoder",
examples/vision/nl_image_search_with_dual_encoder.py): its ``compute_loss`` and ``train_step``
as the example writes them (a per-example loss vector, differentiated as it is), on small
dense encoders of random features, with the two lines that gather the embeddings first."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import graphs_left_alive, relative_difference

from .helpers import strategy_for, tiered

pytestmark = pytest.mark.tf

EXAMPLES, BATCH = 30, 7  # batches of 7 split 4 + 3 over 2 replicas, the last one 1 + 1


class DualEncoder(keras.Model):  # type: ignore[misc]
    """keras-io's ``DualEncoder``; ``gather`` adds the two lines that make its loss the
    whole batch's under a strategy."""

    def __init__(self, gather: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        keras.utils.set_random_seed(4)
        dense = keras.layers.Dense
        self.text_encoder = keras.Sequential(
            [keras.Input((10,)), dense(8, activation="tanh"), dense(4)]
        )
        self.image_encoder = keras.Sequential(
            [keras.Input((12,)), dense(8, activation="tanh"), dense(4)]
        )
        self.temperature = 0.5
        self.gather = gather
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self) -> list[Any]:
        return [self.loss_tracker]

    def call(self, features: Any, training: bool = False) -> Any:
        caption_embeddings = self.text_encoder(features["caption"], training=training)
        image_embeddings = self.image_encoder(features["image"], training=training)
        return caption_embeddings, image_embeddings

    def compute_loss(self, caption_embeddings: Any, image_embeddings: Any) -> Any:
        if self.gather:
            caption_embeddings = tfscale.gather_batch(caption_embeddings)
            image_embeddings = tfscale.gather_batch(image_embeddings)
        # keras-io's loss, as written there.
        logits = (
            tf.matmul(caption_embeddings, image_embeddings, transpose_b=True) / self.temperature
        )
        images_similarity = tf.matmul(image_embeddings, image_embeddings, transpose_b=True)
        captions_similarity = tf.matmul(caption_embeddings, caption_embeddings, transpose_b=True)
        targets = keras.activations.softmax(
            (captions_similarity + images_similarity) / (2 * self.temperature)
        )
        captions_loss = keras.losses.categorical_crossentropy(
            y_true=targets, y_pred=logits, from_logits=True
        )
        images_loss = keras.losses.categorical_crossentropy(
            y_true=tf.transpose(targets), y_pred=tf.transpose(logits), from_logits=True
        )
        return (captions_loss + images_loss) / 2

    def train_step(self, features: Any) -> Any:
        with tf.GradientTape() as tape:
            caption_embeddings, image_embeddings = self(features, training=True)
            loss = self.compute_loss(caption_embeddings, image_embeddings)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def test_step(self, features: Any) -> Any:
        caption_embeddings, image_embeddings = self(features, training=False)
        loss = self.compute_loss(caption_embeddings, image_embeddings)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


class LocalLossDualEncoder(DualEncoder):
    """CLIP's loss written as open_clip's ``local_loss=True`` writes it: each replica
    compares its own captions and images with the whole batch's gathered other side, example
    i's positive at row ``offset + i`` (one device: the whole batch, offset 0)."""

    def compute_loss(self, caption_embeddings: Any, image_embeddings: Any) -> Any:
        all_images, offset = tfscale.gather_batch(image_embeddings, return_offset=True)
        all_captions = tfscale.gather_batch(caption_embeddings)
        labels = offset + tf.range(tf.shape(caption_embeddings)[0])
        to_images = tf.matmul(caption_embeddings, all_images, transpose_b=True)
        to_captions = tf.matmul(image_embeddings, all_captions, transpose_b=True)
        cross_entropy = keras.losses.sparse_categorical_crossentropy
        return (
            cross_entropy(labels, to_images / self.temperature, from_logits=True)
            + cross_entropy(labels, to_captions / self.temperature, from_logits=True)
        ) / 2


class ReducedDualEncoder(DualEncoder):
    """The same loss (keras-io's, or CLIP's local one with ``local``) as Keras's
    ``compute_loss`` override returning its sum or its mean, trained by Keras's own
    ``train_step``."""

    def __init__(self, gather: bool, reduce: str, local: bool = False, **kwargs: Any) -> None:
        super().__init__(gather, **kwargs)
        self.reduce, self.local = reduce, local

    @property
    def metrics(self) -> list[Any]:
        return keras.Model.metrics.fget(self)  # type: ignore[no-any-return]

    def compute_loss(  # type: ignore[override]
        self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None,
        training: bool = True,
    ) -> Any:  # fmt: skip
        own = LocalLossDualEncoder.compute_loss if self.local else DualEncoder.compute_loss
        loss = own(self, *y_pred)
        return keras.ops.sum(loss) if self.reduce == "sum" else keras.ops.mean(loss)

    def train_step(self, features: Any) -> Any:
        return keras.Model.train_step(self, features)

    def test_step(self, features: Any) -> Any:
        return keras.Model.test_step(self, features)


def _features() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "caption": rng.normal(size=(EXAMPLES, 10)).astype("float32"),
        "image": rng.normal(size=(EXAMPLES, 12)).astype("float32"),
    }


def _model(
    gather: bool, reduce: str | None = None, local: bool = False, **compile_args: Any
) -> DualEncoder:
    if reduce is not None:
        model: DualEncoder = ReducedDualEncoder(gather, reduce, local)
    else:
        model = LocalLossDualEncoder(gather) if local else DualEncoder(gather)
    model.compile(optimizer=keras.optimizers.SGD(0.05), **compile_args)
    return model


def _fits(gather: bool, reduce: str | None = None, local: bool = False) -> tuple[Any, ...]:
    """One device's fit and tfscale.fit's on 2 replicas, with validation."""
    features = _features()
    fit = {"batch_size": BATCH, "epochs": 2, "shuffle": False, "verbose": 0,
           "validation_data": (features,), "validation_batch_size": BATCH}  # fmt: skip
    reference = _model(gather, reduce, local)
    with tf.device("/device:CPU:0"):
        expected = reference.fit(features, **fit)
    model = _model(gather, reduce, local)
    history = tfscale.fit(model, features, strategy=strategy_for(2), **fit)
    return reference, expected, model, history


_LOSSES = [(reduce, local) for local in (False, True) for reduce in (None, "sum", "mean")]
_LOSS_IDS = [
    f"{name}-{'local' if local else 'whole_batch'}"
    for local in (False, True)
    for name in ("vector", "sum", "mean")
]


# `make test` runs the mean over the local rows (one of the two corrections of
# Prepared.compute_loss); the summed loss over the whole batch (the other) and the other four
# in `make test-full`.
@pytest.mark.parametrize(
    ("reduce", "local"),
    tiered(
        _LOSSES,
        {
            "vector-whole_batch": "sum-whole_batch",
            "mean-whole_batch": "sum-whole_batch",
            "vector-local": "mean-local",
            "sum-local": "mean-local",
            "sum-whole_batch": "mean-local",
        },
        "tests/training/test_batchwide.py::"
        "test_a_contrastive_loss_over_gathered_embeddings_is_one_devices",
        ids=_LOSS_IDS,
    ),
)
def test_a_contrastive_loss_over_gathered_embeddings_is_one_devices(
    reduce: str | None, local: bool
) -> None:
    """The weights, loss and val_loss are one device's where the batch of 7 splits 4 + 3
    (the gather's gradient weighs each replica by its examples, as tfscale's update does):
    keras-io's loss, which each replica computes over the whole gathered batch, and CLIP's
    local loss of each replica's own examples against the gathered ones; the per-example
    vector differentiated as it is, and its sum or mean returned by ``compute_loss`` through
    Keras's train_step (a sum over the gathered batch is every replica's alike and left as
    it is; a sum over the replica's own examples is a share's, weighed as one)."""
    reference, expected, model, history = _fits(gather=True, reduce=reduce, local=local)
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    assert set(history.history) == set(expected.history)
    for key, values in expected.history.items():
        assert relative_difference(history.history[key], values) <= 1e-5, key


@pytest.mark.full(
    "tests/training/test_batchwide.py::"
    "test_a_contrastive_loss_over_gathered_embeddings_is_one_devices[mean-local]",
)
def test_without_the_gather_each_replica_compares_only_its_share() -> None:
    """keras-io's dual encoder unchanged: each replica's negatives are its own share of the
    batch, and the weights end far from one device's."""
    reference, _, model, _ = _fits(gather=False)
    assert relative_difference(model.get_weights(), reference.get_weights()) > 0.1


def test_gather_batch_is_refused_outside_tfscales_step_and_under_xla() -> None:
    features = _features()
    with strategy_for(2).scope():
        own = _model(gather=True)
    with pytest.raises(tfscale.TrainingError, match="in a replica's step that tfscale did not"):
        # Keras's own fit (a batch of 8: one of 7 splits unevenly, which it cannot start
        # with, keras#19246).
        own.fit(features, batch_size=8, epochs=1, verbose=0)
    model = _model(gather=True, reduce="mean", jit_compile=True)
    with pytest.raises(tfscale.TrainingError, match="inside the step tfscale compiles"):
        tfscale.fit(model, features, batch_size=BATCH, epochs=1, verbose=0,
                    strategy=strategy_for(2))  # fmt: skip
    assert int(model.optimizer.iterations.numpy()) == 0
    one = tf.constant([[1.0, 2.0]])
    assert tfscale.gather_batch(one) is one  # no strategy: the value itself


@pytest.mark.full(
    "tests/training/test_allreduce.py::test_nothing_a_fit_traced_outlives_it[replicated]",
)
def test_nothing_a_fit_that_gathers_traced_outlives_it() -> None:
    """The gather's ``tf.custom_gradient`` registers its gradient function in TensorFlow's
    process-wide registry, which would keep the step alive (tensorflow/tensorflow#97697);
    it is released with the step's others (``internals.gradient_functions_released``)."""
    features = _features()

    def fit() -> None:
        model = _model(gather=True, reduce="mean", local=True)
        tfscale.fit(model, features, batch_size=BATCH, epochs=1, verbose=0,
                    strategy=strategy_for(2))  # fmt: skip

    traced, alive = graphs_left_alive(fit)
    assert len(traced) > 5 and any("multi_step" in name for name in traced), traced
    assert not alive, f"graphs of a finished fit still alive: {alive}"


class Float8DualEncoder(DualEncoder):
    def __init__(self, gather: bool, **kwargs: Any) -> None:
        super().__init__(gather, **kwargs)
        self.text_encoder.quantize("float8")
        self.image_encoder.quantize("float8")


def test_a_float8_model_whose_loss_gathers_is_refused_before_its_first_update() -> None:
    """Gathered rows send back gradients of other magnitudes than a replica's own loss, which
    the float8 layers quantize (the dual encoder quantized: weights 1.8 from one device's on
    batches of 7, the scales and histories 2x): refused as the step is traced."""
    model = Float8DualEncoder(gather=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    with pytest.raises(tfscale.TrainingError, match="quantizes to float8 and its loss gathers"):
        tfscale.fit(model, _features(), batch_size=BATCH, strategy=strategy_for(2), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
