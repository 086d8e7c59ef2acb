"""Inputs tfscale.fit refuses before any training work, each with a TrainingError that names
what was received and how to fix it (the model is left untouched)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import relative_difference

from .helpers import NoCallModel, strategy_for

pytestmark = pytest.mark.tf

X = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
Y = np.random.default_rng(1).normal(size=(64, 1)).astype("float32")


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def _refused(match: str, **kwargs: Any) -> str:
    model = _model()
    before = model.get_weights()
    with pytest.raises(tfscale.TrainingError, match=match) as info:
        tfscale.fit(model, strategy=strategy_for(2), verbose=0, **kwargs)
    assert int(model.optimizer.iterations.numpy()) == 0
    assert relative_difference(model.get_weights(), before) == 0.0
    message = str(info.value)
    assert "Received:" in message
    return message


def test_empty_arrays_and_empty_datasets() -> None:
    assert "0 examples" in _refused("hold no examples", x=X[:0], y=Y[:0])
    empty = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).take(0)
    assert "cardinality 0" in _refused("dataset is empty", x=empty)


@pytest.mark.parametrize("value", [0, -32, 2.5, True])
def test_batch_sizes_that_are_not_positive_integers(value: object) -> None:
    message = _refused("batch_size must be a positive integer", x=X, y=Y, batch_size=value)
    assert f"batch_size={value!r}" in message and "Fix:" in message


def test_text_for_a_model_without_a_string_input() -> None:
    text = np.array([["a"] * 6] * 64)
    assert "TextVectorization" in _refused("holds text", x=text, y=Y)


def test_validation_data_of_another_shape_is_refused_before_the_first_epoch() -> None:
    message = _refused("validation_data", x=X, y=Y, validation_data=(X[:, :3], Y))
    assert "(batch, 6)" in message and "(batch, 3)" in message
    dataset = tf.data.Dataset.from_tensor_slices((X[:, :3], Y)).batch(8)
    _refused("validation_data", x=X, y=Y, validation_data=dataset)


def test_a_validation_split_out_of_range() -> None:
    _refused("validation_split", x=X, y=Y, validation_split=1.5)


def test_checkpoint_folder_that_is_or_lies_under_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "weights.h5"
    afile.write_text("not a folder")
    message = _refused("checkpoint_dir .* cannot be created", x=X, y=Y, checkpoint_dir=str(afile))
    assert "is a file" in message and str(afile) in message
    under = afile / "ck"
    message = _refused("checkpoint_dir .* cannot be created", x=X, y=Y, checkpoint_dir=str(under))
    assert str(under) in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any folder")
def test_checkpoint_folder_that_cannot_be_written(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    _refused("cannot be written", x=X, y=Y, checkpoint_dir=str(locked / "ck"))


def test_checkpoint_folder_no_folder_can_be_made_in_is_refused_before_the_first_step() -> None:
    # /proc passes os.access for root, yet no folder can be made in it: the first save
    # failed after the first epoch with a raw NotFoundError (#21.5).
    folder = f"/proc/tfscale-{os.getpid()}/ckpt"
    message = _refused(f"checkpoint_dir {folder} cannot be", x=X, y=Y, checkpoint_dir=folder)
    assert "Fix:" in message and not os.path.exists(folder)


def test_a_writable_checkpoint_folder_is_created_and_left_without_the_test_file(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "new" / "ckpt"
    tfscale.fit(_model(), X, Y, epochs=1, strategy=strategy_for(2), verbose=0,
                checkpoint_dir=str(folder))  # fmt: skip
    assert folder.is_dir()
    assert not [name for name in os.listdir(folder) if name.startswith(".tfscale-write-test")]


def test_checkpoint_of_another_model_is_refused_before_training(tmp_path: Path) -> None:
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    other.compile("sgd", "mse")
    folder = str(tmp_path / "ck")
    tfscale.fit(
        other, np.zeros((8, 3), "float32"), np.zeros((8, 2), "float32"),
        checkpoint_dir=folder, strategy=strategy_for(2), verbose=0,
    )  # fmt: skip
    message = _refused("does not fit model", x=X, y=Y, checkpoint_dir=folder)
    assert "ckpt-" in message and "own checkpoint_dir" in message


def test_a_batched_dataset_with_batch_size_is_batched_once_as_keras_does() -> None:
    # model.fit ignores batch_size for a dataset (it is already batched); so does tfscale.fit.
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    ours, theirs = _model(), _model()
    tfscale.fit(ours, dataset, batch_size=16, strategy=strategy_for(2), verbose=0)
    theirs.fit(dataset, batch_size=16, verbose=0)
    assert int(ours.optimizer.iterations.numpy()) == 4 == int(theirs.optimizer.iterations.numpy())
    assert relative_difference(ours.get_weights(), theirs.get_weights()) <= 1e-5


def test_a_model_without_call_is_refused_while_a_sub_model_is_unbuilt() -> None:
    unbuilt = keras.Sequential([keras.layers.Dense(1, name="head")], name="no_input")
    model = NoCallModel(unbuilt)
    model.compile(keras.optimizers.Adam(0.01))
    with pytest.raises(tfscale.TrainingError, match="has no call") as info:
        tfscale.fit(model, X, Y, batch_size=16, strategy=strategy_for(2), verbose=0)
    assert "no_input" in str(info.value) and "keras.Input(shape)" in str(info.value)
    # Built, the same model trains: the first step builds its optimizer.
    unbuilt.build((None, 6))
    history = tfscale.fit(model, X, Y, batch_size=16, strategy=strategy_for(2), verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert int(model.optimizer.iterations.numpy()) == 4


def test_an_ema_overwritten_every_few_steps_is_refused_under_mirrored_and_runs_on_one_device() -> (
    None
):
    def model() -> keras.Model:
        built = _model()
        built.compile(keras.optimizers.AdamW(0.01, use_ema=True, ema_overwrite_frequency=3), "mse")
        return built

    refused = model()
    before = refused.get_weights()
    with pytest.raises(tfscale.TrainingError, match="ema_overwrite_frequency=3") as info:
        tfscale.fit(refused, X, Y, batch_size=16, strategy=strategy_for(2), verbose=0)
    assert "# no ema_overwrite_frequency" in str(info.value)
    assert relative_difference(refused.get_weights(), before) == 0.0
    # One device runs Keras's overwrite (the refusal is where Keras fails, not wider).
    alone = model()
    tfscale.fit(alone, X, Y, batch_size=16, strategy=strategy_for(0), verbose=0)
    assert int(alone.optimizer.iterations.numpy()) == 4


def test_an_unbatched_dataset_is_refused_before_any_work() -> None:
    classes = np.random.default_rng(2).integers(0, 3, size=64)
    examples = [
        # Scalar labels: TensorFlow's split over replicas failed with a bare IndexError.
        ("x", tf.data.Dataset.from_tensor_slices((X, classes))),
        # One-hot labels: every component has a dimension, the features one short of the input.
        ("x", tf.data.Dataset.from_tensor_slices((X, np.eye(3, dtype="float32")[classes]))),
    ]
    for name, unbatched in examples:
        model = _model()
        before = model.get_weights()
        with pytest.raises(tfscale.TrainingError, match=f"The {name} dataset yields single"):
            tfscale.fit(model, unbatched, strategy=strategy_for(2), verbose=0)
        assert relative_difference(model.get_weights(), before) == 0.0
    # A prepared model's own model.fit checks the same.
    prepared = _model()
    tfscale.prepare(prepared, strategy=strategy_for(2))
    with pytest.raises(tfscale.TrainingError, match="The x dataset yields single"):
        prepared.fit(examples[0][1], verbose=0)
    batched = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    with pytest.raises(tfscale.TrainingError, match="validation_data dataset yields single"):
        tfscale.fit(
            _model(),
            batched,
            validation_data=tf.data.Dataset.from_tensor_slices((X, Y)),
            strategy=strategy_for(2),
            verbose=0,
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # Keras reads 0 as None: a whole epoch where none was asked for.
        ({"steps_per_epoch": 0}, "steps_per_epoch must be a positive integer"),
        ({"validation_steps": 0, "validation_split": 0.25}, "validation_steps must be a"),
        # Keras: a bare ZeroDivisionError after the first epoch's training.
        ({"validation_freq": 0, "validation_split": 0.25}, "validation_freq says"),
        ({"validation_freq": [1, 0], "validation_split": 0.25}, "validation_freq says"),
    ],
)
def test_step_counts_and_validation_epochs_keras_would_misread(
    kwargs: dict[str, Any], match: str
) -> None:
    model = _model()
    before = model.get_weights()
    with pytest.raises(tfscale.TrainingError, match=match):
        tfscale.fit(model, X, Y, batch_size=16, strategy=strategy_for(2), verbose=0, **kwargs)
    assert relative_difference(model.get_weights(), before) == 0.0
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # bool() read these as yes, silently.
        ({"remat": "all"}, "remat is a yes/no option"),
        ({"jit_compile": "yes"}, "jit_compile is a yes/no option"),
        ({"sync_batchnorm": 1}, "sync_batchnorm is a yes/no option"),
        # A name, or choose_strategy()'s answer itself: a bare AttributeError before.
        ({"strategy": "mirrored"}, "strategy= takes a tf.distribute.Strategy"),
    ],
)
def test_options_of_the_wrong_kind_are_refused_before_any_work(
    kwargs: dict[str, Any], match: str
) -> None:
    for train in (
        lambda model: tfscale.fit(model, X, Y, batch_size=16, verbose=0, **kwargs),
        lambda model: tfscale.prepare(model, **kwargs),
    ):
        model = _model()
        with pytest.raises(tfscale.TrainingError, match=match):
            train(model)
        assert int(model.optimizer.iterations.numpy()) == 0


def test_a_strategy_choice_given_as_the_strategy_is_refused_naming_its_strategy() -> None:
    choice = tfscale.choose_strategy()
    with pytest.raises(tfscale.TrainingError, match=r"strategy=choice\.strategy"):
        tfscale.fit(_model(), X, Y, batch_size=16, verbose=0, strategy=choice)
    model = _model()  # "auto" is compile()'s own setting: accepted
    tfscale.fit(model, X, Y, batch_size=16, verbose=0, jit_compile="auto", strategy=choice.strategy)
    assert int(model.optimizer.iterations.numpy()) == 4


def test_sparse_labels_outside_the_classes_are_refused_before_any_work() -> None:
    """On a CPU TensorFlow's kernel fails at the first step, buried in a graph traceback; on a
    GPU it does not check, and the loss is NaN or wrong (tf.nn.sparse_softmax_cross_entropy's
    documentation)."""

    def classifier(**loss: Any) -> keras.Model:
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True, **loss)
        model.compile("adam", cross_entropy)
        return model

    counted_from_one = np.random.default_rng(3).integers(1, 4, size=64)  # 1..3, not 0..2
    for kwargs, name in (
        ({"x": X, "y": counted_from_one}, "y"),
        ({"x": X, "y": counted_from_one - 1, "validation_data": (X, counted_from_one)}, "v"),
    ):
        model = classifier()
        with pytest.raises(tfscale.TrainingError, match=r"outside the model's 3 classes") as info:
            tfscale.fit(model, batch_size=16, strategy=strategy_for(2), verbose=0, **kwargs)
        assert str(info.value).startswith("y holds" if name == "y" else "validation_data holds")
        assert "y - 1" in str(info.value)
        assert int(model.optimizer.iterations.numpy()) == 0
    # Labels equal to the loss's ignore_class are not classes: accepted, and trained.
    padded = np.where(np.arange(64) % 4 == 0, -1, counted_from_one - 1)
    model = classifier(ignore_class=-1)
    tfscale.fit(model, X, padded, batch_size=16, strategy=strategy_for(2), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4


class ClippingStep(keras.Model):  # type: ignore[misc]
    """keras-io's "customizing fit" train_step, with the gradient clipped in the step."""

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        grads, _ = tf.clip_by_global_norm(grads, 1.0)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_a_train_step_clipping_each_replicas_gradient_is_refused_on_two_replicas() -> None:
    def model() -> keras.Model:
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        built = ClippingStep(inputs, keras.layers.Dense(1)(inputs))
        built.compile(keras.optimizers.SGD(0.1), "mse")
        return built

    refused = model()
    with pytest.raises(tfscale.TrainingError, match=r"tf\.clip_by_global_norm"):
        tfscale.fit(refused, X, Y, batch_size=16, strategy=strategy_for(2), verbose=0)
    assert int(refused.optimizer.iterations.numpy()) == 0
    alone = model()  # one replica clips the whole batch's gradient, as one device does
    tfscale.fit(alone, X, Y, batch_size=16, strategy=strategy_for(1), verbose=0)
    assert int(alone.optimizer.iterations.numpy()) == 4
