"""The class of a prepared model (``training.modelclass``): tfscale's methods on both sides of
the model's own, so a model that overrides ``fit`` (KerasHub's task models preprocess there)
gets the call as the user made it under ``tfscale.fit``, and everything else reads as the
model's class (name, saving, clones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import relative_difference
from tfscale.training.modelclass import model_class

from .helpers import strategy_for

pytestmark = pytest.mark.tf


@keras.saving.register_keras_serializable(package="tfscale_tests")
class PreprocessingModel(keras.Model):  # type: ignore[misc]
    """KerasHub's ``PipelineModel.fit`` in miniature: its ``fit`` takes raw arrays and a batch
    size, builds a batched ``tf.data.Dataset`` through its preprocessing (here a scale and a
    feature cut), and hands Keras that dataset with ``batch_size=None``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)
        self.seen: list[dict[str, Any]] = []

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))

    def fit(self, x: Any = None, y: Any = None, batch_size: Any = None, **kwargs: Any) -> Any:
        self.seen.append({"x": type(x).__name__, "batch_size": batch_size})
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
        dataset = dataset.map(lambda a, b: (2.0 * a[:, :4], b))
        return super().fit(x=dataset, y=None, batch_size=None, **kwargs)


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(21)
    x = rng.normal(size=(96, 6)).astype("float32")
    return x, (x[:, :4] @ rng.normal(size=(4, 1))).astype("float32")


def _model(optimizer: str = "sgd") -> keras.Model:
    keras.utils.set_random_seed(3)
    model = PreprocessingModel(name="preprocessing_model")
    model.compile(optimizer=optimizer, loss="mse")
    return model


@pytest.mark.parametrize("entry", ["tfscale.fit", "prepare"])
def test_a_model_that_overrides_fit_gets_the_users_call_and_trains_as_one_device(
    entry: str,
) -> None:
    """Before, ``tfscale.fit`` handed the model's ``fit`` a dataset it had already distributed,
    and KerasHub's ``fit`` failed on it (``_to_batched_tensor_list``)."""
    x, y = _data()
    reference = _model()
    with tf.device("/device:CPU:0"):
        expected = reference.fit(x, y, batch_size=16, epochs=2, verbose=0)
    model = _model()
    if entry == "tfscale.fit":
        history = tfscale.fit(model, x, y, batch_size=16, epochs=2, verbose=0,
                              strategy=strategy_for(2))  # fmt: skip
    else:
        tfscale.prepare(model, strategy_for(2))
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert model.seen == [{"x": "ndarray", "batch_size": 16}]
    assert int(model.optimizer.iterations.numpy()) == 2 * 6
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    assert relative_difference(history.history["loss"], expected.history["loss"]) <= 1e-5


def test_the_prepared_class_reads_as_the_models_class_and_saves_as_it(tmp_path: Path) -> None:
    x, y = _data()
    model = _model()
    tfscale.fit(model, x, y, batch_size=16, epochs=1, verbose=0, strategy=strategy_for(2))
    cls = type(model)
    assert cls is not PreprocessingModel and isinstance(model, PreprocessingModel)
    assert model_class(model) is PreprocessingModel
    assert (cls.__name__, cls.__qualname__, cls.__module__) == (
        "PreprocessingModel", "PreprocessingModel", PreprocessingModel.__module__,
    )  # fmt: skip
    assert keras.saving.get_registered_name(cls) == "tfscale_tests>PreprocessingModel"
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is PreprocessingModel
    assert relative_difference(loaded.get_weights(), model.get_weights()) == 0.0


def test_one_class_per_model_class_and_an_unprepared_object_of_it_is_plain_keras() -> None:
    """A second prepared model of the same class shares its prepared class; an object of the
    prepared class without tfscale state (``keras.models.clone_model`` makes one) trains as
    Keras's own fit would."""
    first, second = _model(), _model()
    tfscale.prepare(first, strategy_for(2))
    tfscale.prepare(second, strategy_for(2))
    assert type(first) is type(second)
    keras.utils.set_random_seed(3)
    plain = type(first)(name="plain")
    plain.compile(optimizer="sgd", loss="mse")
    x, y = _data()
    keras.utils.set_random_seed(3)
    reference = PreprocessingModel(name="reference")
    reference.compile(optimizer="sgd", loss="mse")
    with tf.device("/device:CPU:0"):
        plain.fit(x, y, batch_size=16, epochs=1, verbose=0)
        reference.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not isinstance(plain.train_function, tfscale.training.function.StepFunction)
    assert relative_difference(plain.get_weights(), reference.get_weights()) == 0.0
