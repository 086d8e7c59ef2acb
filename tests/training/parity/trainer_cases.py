"""Cases drawn from Keras's ``keras/src/trainers/trainer_test.py``,
``keras/src/models/model_test.py`` and ``keras/src/optimizers/multi_optimizer_test.py``
(keras-team/keras, Keras 3.15)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf
from packaging.version import Version

from .common import (
    FEATURES,
    SEED,
    classification,
    classifier,
    compiled,
    dataset,
    generator,
    mlp,
    regression,
    regressor,
)
from .registry import Case, Run, Train, same_history, same_weights

TRAINER = "keras/src/trainers/trainer_test.py"
MODEL = "keras/src/models/model_test.py"
MULTI = "keras/src/optimizers/multi_optimizer_test.py"
X, Y = regression()


def _arrays(**extra: Any) -> Any:
    return lambda: {"x": X, "y": Y, "batch_size": 16, "epochs": 2, **extra}


# -- overridden steps -------------------------------------------------------------------------
class CustomTrainStepModel(keras.Model):
    """trainer_test ``test_fit_with_custom_train_step``: a train_step with its own tracker."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.my_metric = keras.metrics.Mean(name="my_metric")

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        self.my_metric.update_state(loss * 2)
        return {"loss": loss, "my_custom_metric": self.my_metric.result()}


class TrainingArgLayer(keras.layers.Layer):
    """trainer_test ``test_training_arg``: a layer that behaves differently in training."""

    def call(self, inputs: Any, training: bool = False) -> Any:
        return inputs * 2.0 + 1.0 if training else inputs


class MetricInComputeLossModel(keras.Model):
    """trainer_test ``test_metric_update_in_compute_loss``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.custom_metric = keras.metrics.Mean(name="custom")

    def compute_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool) -> Any:
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        self.custom_metric.update_state(loss * 4)
        return loss


class ComputeLossWithXModel(keras.Model):
    """trainer_test ``test_evaluate_with_custom_compute_loss``: a loss reading the inputs."""

    def compute_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool) -> Any:
        del sample_weight, training
        return tf.reduce_mean(tf.square(y - y_pred)) + 0.01 * tf.reduce_mean(tf.abs(x))


class InternalLossLayer(keras.layers.Layer):
    """trainer_test ``test_internal_only_loss``: the only loss comes from ``add_loss``."""

    def call(self, inputs: Any) -> Any:
        self.add_loss(0.1 * tf.reduce_mean(tf.square(inputs - 1.0)))
        return inputs


class LazyModel(keras.Model):
    """trainer_test ``test_symbolic_build``: a subclassed model built by its first fit."""

    def __init__(self) -> None:
        super().__init__()
        keras.utils.set_random_seed(SEED)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, inputs: Any) -> Any:
        return self.out(self.hidden(inputs))


def _lazy() -> Any:
    return compiled(LazyModel())


def _training_arg() -> Any:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((FEATURES,))
    hidden = TrainingArgLayer()(keras.layers.Dense(4)(inputs))
    return compiled(keras.Model(inputs, keras.layers.Dense(1)(hidden)))


def _internal_loss() -> Any:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((FEATURES,))
    outputs = InternalLossLayer()(keras.layers.Dense(2)(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01))
    return model


# -- several outputs and inputs ---------------------------------------------------------------
def _two_outputs(output_names: tuple[str, str] = ("a", "b")) -> Any:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    first = keras.layers.Dense(1, name=output_names[0])(hidden)
    second = keras.layers.Dense(3, activation="softmax", name=output_names[1])(hidden)
    return keras.Model(inputs, [first, second])


_, LABELS = classification()


def _loss_weights_list() -> Any:
    return compiled(
        _two_outputs(),
        loss=["mse", "sparse_categorical_crossentropy"],
        loss_weights=[0.3, 2.0],
        metrics=[["mae"], ["accuracy"]],
    )


def _loss_weights_dict() -> Any:
    model = _two_outputs()
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = {
        "a": keras.layers.Dense(1, name="a")(hidden),
        "b": keras.layers.Dense(3, activation="softmax", name="b")(hidden),
    }
    del model
    return compiled(
        keras.Model(inputs, outputs),
        loss={"a": "mse", "b": "sparse_categorical_crossentropy"},
        loss_weights={"a": 0.5, "b": 1.5},
        metrics={"a": ["mae"], "b": ["accuracy"]},
    )


def _partial_loss() -> Any:
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = {
        "a": keras.layers.Dense(1, name="a")(hidden),
        "b": keras.layers.Dense(3, activation="softmax", name="b")(hidden),
    }
    return compiled(keras.Model(inputs, outputs), loss={"a": "mse"})


def _nested_inputs() -> Any:
    keras.utils.set_random_seed(SEED)
    left = keras.Input((3,), name="left")
    right = keras.Input((FEATURES - 3,), name="right")
    merged = keras.layers.Concatenate()([keras.layers.Dense(4)(left), keras.layers.Dense(4)(right)])
    model = keras.Model({"left": left, "right": right}, keras.layers.Dense(1)(merged))
    return compiled(model)


# -- multi-fit procedures -----------------------------------------------------------------------
def _recompile(model: Any, train: Train, arguments: dict[str, Any]) -> Any:
    """trainer_test ``test_recompile``: fit, compile with another loss and optimizer, fit."""
    train(model, **arguments)
    model.compile(keras.optimizers.SGD(0.05), "mae", metrics=["mse"])
    return train(model, **arguments)


def _fit_twice(model: Any, train: Train, arguments: dict[str, Any]) -> Any:
    """model_test: a second fit continues the optimizer (Adam's moments and iterations)."""
    train(model, **arguments)
    return train(model, **arguments)


# -- callbacks that act at batch boundaries -----------------------------------------------------
class StopAtBatch(keras.callbacks.Callback):
    """trainer_test ``test_stop_loop``: ``model.stop_training`` set in a batch hook."""

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch == 2:
            self.model.stop_training = True


class LearningRateAtBatch(keras.callbacks.Callback):
    """trainer_test ``test_callbacks_can_update_state_at_batch_boundary``."""

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.model.optimizer.learning_rate.assign(0.01 * (batch + 1))


class EventKeys(keras.callbacks.Callback):
    """trainer_test ``test_callback_methods_keys``: every hook with its logs' keys."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int | None, tuple[str, ...]]] = []

    def _record(self, name: str, index: int | None, logs: Any) -> None:
        self.events.append((name, index, tuple(sorted(logs or {}))))

    def on_train_begin(self, logs: Any = None) -> None:
        self._record("train_begin", None, logs)

    def on_train_end(self, logs: Any = None) -> None:
        self._record("train_end", None, logs)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._record("epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._record("epoch_end", epoch, logs)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._record("train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._record("train_batch_end", batch, logs)

    def on_test_begin(self, logs: Any = None) -> None:
        self._record("test_begin", None, logs)

    def on_test_end(self, logs: Any = None) -> None:
        self._record("test_end", None, logs)

    def on_test_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._record("test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self._record("test_batch_end", batch, logs)


def _callback(kind: type) -> Any:
    def find(run: Run) -> Any:
        return next(c for c in run.fit["callbacks"] if isinstance(c, kind))

    return find


def _same_events(expected: Run, got: Run) -> None:
    find = _callback(EventKeys)
    assert find(got).events == find(expected).events


def _same_params(expected: Run, got: Run) -> None:
    assert got.history.params == expected.history.params


def _iterations_are(n: int) -> Any:
    def check(expected: Run, got: Run) -> None:
        assert (expected.iterations, got.iterations) == (n, n)

    return check


def _six_batches_against_five(expected: Run, got: Run) -> None:
    # Keras runs whole executions of 3 steps: steps_per_epoch=5 trains 6 batches per epoch.
    assert (expected.iterations, got.iterations) == (12, 10)


def _tfscale_equals_five_steps(expected: Run, got: Run) -> None:
    """tfscale's 5 steps per epoch equal one-device model.fit with steps_per_execution=1."""
    del expected
    with tf.device("/device:CPU:0"):
        model = regressor()
        model.set_weights(got.initial_weights)
        history = model.fit(
            dataset(X, Y, 8).repeat(), steps_per_epoch=5, epochs=2, verbose=0, shuffle=False
        )
    reference = Run(model, history, {}, got.initial_weights)
    same_weights()(reference, got)
    same_history()(reference, got)


def _one_extra_count_on_one_device(expected: Run, got: Run) -> None:
    # Keras 3.16's pre-releases count the 4 updates on one device too (make test-next: the
    # extra count is gone from keras-nightly 3.16.0.dev2026102704).
    extra = 0 if Version(keras.__version__).release[:2] >= (3, 16) else 1
    assert (expected.iterations, got.iterations) == (len(X) // 16 + extra, len(X) // 16)


def _uneven(n: int) -> tuple[Any, Any]:
    return regression(n, seed=11)


X70, Y70 = _uneven(70)
X_CLS, Y_CLS = classification()


# -- MultiOptimizer (Keras 3.15) ---------------------------------------------------------------
def _multi_optimizer(how: str) -> Any:
    """Adam for the hidden layer, SGD for the rest: through an ``OptimizerMap`` of patterns,
    a function (its optimizers appear when it is built), or an ``OptimizerMap`` wrapped in a
    ``LossScaleOptimizer``. Each sub-optimizer applies the gradient itself, so each has its
    own built-in all-reduce to switch off."""

    def build() -> Any:
        keras.utils.set_random_seed(SEED)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))
        adam, sgd = keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05)
        if how == "callable":
            chosen = keras.optimizers.MultiOptimizer(
                lambda variable: adam if "hidden" in variable.path else sgd
            )
        else:
            chosen = keras.optimizers.MultiOptimizer(
                keras.optimizers.OptimizerMap(
                    default_optimizer=sgd, optimizer_map={".*hidden/.*": adam}
                )
            )
        if how == "loss_scale":
            chosen = keras.optimizers.LossScaleOptimizer(chosen, initial_scale=64.0)
        return compiled(model, optimizer=chosen)

    return build


CASES = [
    Case("fit_flow_arrays", f"{TRAINER}::test_fit_flow", regressor, _arrays()),
    Case(
        "fit_flow_steps_per_epoch",
        f"{TRAINER}::test_fit_flow (use_steps_per_epoch=True)",
        regressor,
        lambda: {"x": dataset(X, Y, 16).repeat(), "steps_per_epoch": 3, "epochs": 2},
    ),
    Case(
        "fit_with_val_split",
        f"{TRAINER}::test_fit_with_val_split",
        lambda: regressor(metrics=["mae"]),
        _arrays(validation_split=0.25),
    ),
    Case(
        "fit_with_data_adapter_dataset",
        f"{TRAINER}::test_fit_with_data_adapter (tf.data)",
        regressor,
        lambda: {"x": dataset(X, Y, 16), "epochs": 2},
    ),
    Case(
        "fit_with_custom_train_step",
        f"{TRAINER}::test_fit_with_custom_train_step",
        lambda: compiled(mlp(cls=CustomTrainStepModel)),
        _arrays(),
    ),
    Case(
        "steps_per_execution_steps_count",
        f"{TRAINER}::test_steps_per_execution_steps_count",
        lambda: regressor(steps_per_execution=3),
        lambda: {"x": X[:48], "y": Y[:48], "batch_size": 8, "epochs": 2},
    ),
    Case(
        "steps_per_execution_steps_per_epoch",
        f"{TRAINER}::test_steps_per_execution_steps_per_epoch",
        lambda: regressor(steps_per_execution=3),
        lambda: {"x": dataset(X, Y, 8).repeat(), "steps_per_epoch": 5, "epochs": 2},
        checks=[_six_batches_against_five, _tfscale_equals_five_steps],
        known_difference=(
            "Keras runs whole executions of steps_per_execution steps, so steps_per_epoch=5 "
            "with steps_per_execution=3 trains 6 batches per epoch (one device too); tfscale "
            "trains exactly 5, equal to one device with steps_per_execution=1"
        ),
    ),
    Case(
        "steps_per_epoch_infinite_dataset",
        f"{TRAINER}::test_steps_per_epoch",
        regressor,
        lambda: {"x": dataset(X, Y, 16).repeat(), "steps_per_epoch": 2, "epochs": 3},
    ),
    Case(
        "uneven_last_batch",
        f"{TRAINER}::test_fit_with_different_batch_size_same_loss",
        regressor,
        lambda: {"x": X70, "y": Y70, "batch_size": 16, "epochs": 2},
    ),
    Case(
        "odd_global_batch",
        f"{TRAINER}::test_fit_with_different_batch_size_same_loss (odd batch)",
        regressor,
        lambda: {"x": X[:45], "y": Y[:45], "batch_size": 15, "epochs": 2},
    ),
    Case(
        "training_arg",
        f"{TRAINER}::test_training_arg",
        _training_arg,
        _arrays(validation_data=(X[:16], Y[:16])),
    ),
    Case(
        "callback_methods_keys",
        f"{TRAINER}::test_callback_methods_keys",
        lambda: regressor(metrics=["mae"]),
        _arrays(validation_data=(X[:32], Y[:32]), callbacks=[EventKeys()]),
        checks=[same_weights(), same_history(), _same_events, _same_params],
    ),
    Case(
        "internal_only_loss",
        f"{TRAINER}::test_internal_only_loss",
        _internal_loss,
        lambda: {"x": X, "batch_size": 16, "epochs": 2},
    ),
    Case(
        "recompile",
        f"{TRAINER}::test_recompile",
        regressor,
        _arrays(),
        procedure=_recompile,
    ),
    Case(
        "nested_inputs_dict",
        f"{TRAINER}::test_nested_inputs",
        _nested_inputs,
        lambda: {"x": {"left": X[:, :3], "right": X[:, 3:]}, "y": Y, "batch_size": 16},
    ),
    Case(
        "validation_infinite_generator",
        f"{TRAINER}::test_validation_data_infinite_generator",
        regressor,
        lambda: {
            "x": X,
            "y": Y,
            "batch_size": 16,
            "epochs": 2,
            "validation_data": dataset(X, Y, 8).repeat(),
            "validation_steps": 2,
        },
    ),
    Case(
        "stop_loop_in_batch_hook",
        f"{TRAINER}::test_stop_loop",
        regressor,
        _arrays(epochs=3, callbacks=[StopAtBatch()]),
        checks=[same_weights(), same_history(), _iterations_are(3)],
    ),
    Case(
        "constraints_are_applied",
        f"{TRAINER}::test_constraints_are_applied",
        lambda: compiled(mlp(kernel_constraint=keras.constraints.NonNeg())),
        _arrays(),
    ),
    Case(
        "callbacks_update_state_at_batch_boundary",
        f"{TRAINER}::test_callbacks_can_update_state_at_batch_boundary",
        lambda: regressor(optimizer=keras.optimizers.SGD(0.01)),
        _arrays(callbacks=[LearningRateAtBatch()]),
    ),
    Case(
        "metric_update_in_compute_loss",
        f"{TRAINER}::test_metric_update_in_compute_loss",
        lambda: compiled(mlp(cls=MetricInComputeLossModel)),
        _arrays(),
    ),
    Case(
        "custom_compute_loss_with_x",
        f"{TRAINER}::test_evaluate_with_custom_compute_loss",
        lambda: compiled(mlp(cls=ComputeLossWithXModel), metrics=["mae"]),
        _arrays(validation_data=(X[:32], Y[:32])),
    ),
    Case(
        "loss_weights_list_outputs",
        f"{TRAINER}::test_loss_weights (list outputs)",
        _loss_weights_list,
        lambda: {"x": X, "y": [Y, LABELS], "batch_size": 16, "epochs": 2},
    ),
    Case(
        "loss_weights_dict_outputs",
        f"{TRAINER}::test_loss_weights (dict outputs)",
        _loss_weights_dict,
        lambda: {"x": X, "y": {"a": Y, "b": LABELS}, "batch_size": 16, "epochs": 2},
    ),
    Case(
        "partial_loss_partial_label",
        f"{TRAINER}::test_partial_loss_partial_label",
        _partial_loss,
        lambda: {"x": X, "y": {"a": Y}, "batch_size": 16, "epochs": 2},
    ),
    Case(
        "symbolic_build_subclassed",
        f"{TRAINER}::test_symbolic_build",
        _lazy,
        _arrays(),
    ),
    Case(
        "jit_compile",
        f"{TRAINER}::test_fit_flow (jit_compile=True)",
        lambda: regressor(jit_compile=True),
        _arrays(),
    ),
    Case(
        "metric_tracking_weighted",
        f"{TRAINER}::test_metric_tracking",
        lambda: regressor(
            metrics=["mae", keras.metrics.RootMeanSquaredError()], weighted_metrics=["mse"]
        ),
        _arrays(sample_weight=np.linspace(0.5, 2.0, len(X)).astype("float32")),
    ),
    Case(
        "second_fit_continues",
        f"{MODEL}::fit twice (optimizer state kept)",
        regressor,
        _arrays(),
        procedure=_fit_twice,
    ),
    Case(
        "python_generator",
        f"{TRAINER}::test_fit_with_data_adapter (generator)",
        regressor,
        lambda: {"x": generator(X, Y, 16)()},
        checks=[same_weights(), same_history(), _one_extra_count_on_one_device],
        known_difference=(
            "with a finite Python generator, one-device model.fit's optimizer.iterations "
            "ends one above the batches trained (it rises after the last batch, on the call "
            "that finds the generator exhausted, with no change to the weights; Keras 3.16's "
            "pre-releases no longer do); tfscale counts the 4 updates it made"
        ),
    ),
    Case(
        "multi_optimizer_map",
        f"{MULTI}::test_multi_optimizer_with_model_fit (OptimizerMap)",
        _multi_optimizer("map"),
        _arrays(),
    ),
    Case(
        "multi_optimizer_callable",
        f"{MULTI}::test_custom_callable_function (sub-optimizers found at build)",
        _multi_optimizer("callable"),
        _arrays(),
    ),
    Case(
        "multi_optimizer_in_loss_scale_optimizer",
        f"{MULTI}::test_multi_optimizer_wrapped_in_loss_scale_optimizer",
        _multi_optimizer("loss_scale"),
        _arrays(),
    ),
    Case(
        "history_params",
        f"{MODEL}::fit History (params, epoch)",
        lambda: classifier(),
        lambda: {"x": X_CLS, "y": Y_CLS, "batch_size": 16, "epochs": 2, "validation_split": 0.25},
    ),
]
