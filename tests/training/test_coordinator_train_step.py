"""The ParameterServerStrategy loop runs the model's own ``train_step`` (#25.2).

On an in-process cluster of one ps and ONE worker, so that the scheduled steps run one after
the other on the batches in order: the update is then sequential, as on one device, and must
give one device's weights and History (with two workers the updates interleave
asynchronously and no step-by-step equality is owed). Models: a ``train_step`` override
(Keras's guide's, with its own trackers), a ``compute_loss`` override,
``add_loss``, two outputs with loss weights, compiled metrics and sample weights (from
arrays, a tf.data.Dataset and a dataset_fn), a model built or trained outside the scope; and
the refusals of a step that cannot run.
On two workers: the metrics, on the ps and updated by both, count every example of every
step (an update lost between one worker's read and write would show).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from launch.selected import selected_param, selected_tests
from tfscale.testing import run_python

pytestmark = [pytest.mark.tf, pytest.mark.xdist_group("ps-train-step")]

_CHILD = """
import json, sys
import keras, numpy as np, tensorflow as tf
import tfscale
from tfscale.testing import in_process_parameter_servers

strategy = in_process_parameter_servers(workers=1)

rng = np.random.default_rng(0)
x = rng.normal(size=(32, 4)).astype("float32")
y = x @ rng.normal(size=(4, 1)).astype("float32")
labels = (x[:, :1] > 0).astype("float32")
weights = rng.uniform(0.5, 2.0, size=32).astype("float32")


class OwnLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return tf.reduce_mean(tf.abs(y - y_pred)) * 3.0 + tf.reduce_sum(self.losses)


def dense(units=1):
    return keras.layers.Dense(units, kernel_initializer=keras.initializers.GlorotUniform(7))


def own_loss():
    i = keras.Input((4,))
    m = OwnLoss(i, dense()(i))
    m.compile(keras.optimizers.SGD(0.05), metrics=["mae"])
    return m


class Penalty(keras.layers.Layer):
    def call(self, h):
        self.add_loss(0.1 * tf.reduce_mean(tf.square(h)))
        return h


def with_add_loss():
    i = keras.Input((4,))
    m = keras.Model(i, dense()(Penalty()(dense(3)(i))))
    m.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    return m


def two_outputs():
    i = keras.Input((4,))
    h = dense(3)(i)
    a = keras.layers.Dense(1, "sigmoid", kernel_initializer=keras.initializers.GlorotUniform(8),
                           name="a")(h)
    b = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(9), name="b")(h)
    m = keras.Model(i, {"a": a, "b": b})
    m.compile(keras.optimizers.Adam(0.01), {"a": "binary_crossentropy", "b": "mse"},
              loss_weights={"a": 1.0, "b": 0.5}, metrics={"a": ["accuracy"], "b": ["mae"]})
    return m


class OwnStep(keras.Model):
    # Keras's "customizing fit" guide: its own loss, trackers and logs.
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = keras.losses.mean_squared_error(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def own_step():
    i = keras.Input((4,))
    m = OwnStep(i, dense()(i))
    m.compile(keras.optimizers.SGD(0.05))
    return m


CASES = {
    "train_step": (own_step, {"y": y}),
    "compute_loss": (own_loss, {"y": y}),
    "add_loss": (with_add_loss, {"y": y}),
    "two_outputs": (two_outputs, {"y": {"a": labels, "b": y}, "sample_weight": weights}),
}


def batches(input_context=None):
    return tf.data.Dataset.from_tensor_slices((x, {"a": labels, "b": y}, weights)).batch(8)


# The same two-output model fed a tf.data.Dataset and a dataset_fn (repeated by the caller).
INPUTS = {
    "dataset": lambda: {"x": batches()},
    "dataset_fn": lambda: {"x": lambda context: batches(context).repeat(), "steps_per_epoch": 4},
}
# The cases the session's tests read (sys.argv[1], comma-separated).
selected = set(sys.argv[1].split(","))
results = {}
for name in [n for n in [*CASES, *INPUTS] if n in selected]:
    build, data = CASES.get(name, (two_outputs, None))
    reference = build()
    if data is None:
        expected = reference.fit(batches(), epochs=2, verbose=0)
    else:
        expected = reference.fit(x, batch_size=8, epochs=2, shuffle=False, verbose=0, **data)
    with strategy.scope():
        model = build()
    if data is None:
        got = tfscale.fit(model, strategy=strategy, epochs=2, verbose=0, **INPUTS[name]())
    else:
        got = tfscale.fit(model, x, strategy=strategy, batch_size=8, epochs=2, shuffle=False,
                          verbose=0, **data)
    results[name] = {
        "expected": expected.history,
        "got": got.history,
        "weights": max(float(np.max(np.abs(a - b)))
                       for a, b in zip(reference.get_weights(), model.get_weights())),
        "iterations": int(model.optimizer.iterations.numpy()),
    }

# Built outside the scope: moved onto the ps. Trained one epoch on one device first, its Adam
# built: continued there. Compared with one device's epochs after the first.
for name, first in {"outside_scope": 0, "trained_outside": 1}.items():
    if name not in selected:
        continue
    reference = with_add_loss()
    expected = reference.fit(x, y, batch_size=8, epochs=first + 2, shuffle=False, verbose=0)
    model = with_add_loss()
    if first:
        model.fit(x, y, batch_size=8, epochs=first, shuffle=False, verbose=0)
    try:
        got = tfscale.fit(model, x, y, strategy=strategy, batch_size=8, epochs=2,
                          shuffle=False, verbose=0)
    except Exception as error:  # its own test fails with it, not the whole module
        results[name] = {"error": f"{type(error).__name__}: {error}"}
        continue
    results[name] = {
        "expected": {k: v[first:] for k, v in expected.history.items()},
        "got": got.history,
        "weights": max(float(np.max(np.abs(a - b)))
                       for a, b in zip(reference.get_weights(), model.get_weights())),
        "iterations": int(model.optimizer.iterations.numpy()),
        "on_ps": all("/job:ps/" in v.value.device for v in model.weights),
    }


class MakesVariable(keras.Model):
    def train_step(self, data):
        extra = tf.Variable(1.0)
        return {"loss": extra}


class TwoOptimizers(keras.Model):
    def train_step(self, data):
        return super().train_step(data)


refusals = {}
with strategy.scope():
    i = keras.Input((4,))
    bad = MakesVariable(i, dense()(i))
    bad.compile("sgd", "mse")
    i = keras.Input((4,))
    second = TwoOptimizers(i, dense()(i))
    second.compile("sgd", "mse")
    second.other_optimizer = keras.optimizers.SGD(0.1)
before = {"creates_variable": bad.get_weights(), "unbuilt_optimizer": second.get_weights()}
for name, model in {"creates_variable": bad, "unbuilt_optimizer": second}.items():
    try:
        tfscale.fit(model, x, y, strategy=strategy, batch_size=8, epochs=1, verbose=0)
        refusals[name] = "trained"
    except tfscale.TrainingError as error:
        untouched = model.optimizer.iterations.numpy() == 0 and all(
            np.array_equal(a, b) for a, b in zip(before[name], model.get_weights()))
        refusals[name] = str(error) + ("" if untouched else " TRAINED")
results["refusals"] = refusals
print("RESULTS " + json.dumps(results))
"""


# `make test` trains a model with its own train_step, two outputs with loss weights, metrics
# and sample weights, and a model built outside the scope; the other models and inputs (a
# compute_loss override, add_loss, a dataset, a dataset_fn, a model trained outside the scope
# first: the same coordinator step and its update on the ps) in `make test-full` (#41).
_IN_MAKE_TEST = ("train_step", "two_outputs", "outside_scope")
_ONE_WORKER = (
    "tests/training/test_coordinator_train_step.py::"
    "test_one_worker_gives_one_device_weights_and_history"
)
_MOVED_IN = (
    "tests/training/test_coordinator_train_step.py::"
    "test_a_model_built_or_trained_outside_the_scope_moves_to_the_ps_and_continues[outside_scope-8]"
)

# The cases a test without a ``case`` parameter reads (as test_jobs' jobs by test).
_NEEDS = {"test_history_carries_the_compiled_metrics": ("two_outputs",)}


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One device's fit and tfscale.fit on 1 ps + 1 worker, for each model the session's
    tests read (their ``case``, or :data:`_NEEDS`)."""
    cases = selected_param(request, "case")
    cases |= {
        case for item in selected_tests(request) for case in _NEEDS.get(item.originalname, ())
    }
    done = run_python(_CHILD, args=[",".join(sorted(cases))], timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    results: dict[str, Any] = json.loads(lines[-1][len("RESULTS ") :])
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        case
        if case in _IN_MAKE_TEST
        else pytest.param(case, marks=pytest.mark.full(f"{_ONE_WORKER}[two_outputs]"))
        for case in [
            "train_step",
            "compute_loss",
            "add_loss",
            "two_outputs",
            "dataset",
            "dataset_fn",
        ]
    ],
)
def test_one_worker_gives_one_device_weights_and_history(
    case: str, trained: dict[str, Any]
) -> None:
    result = trained[case]
    assert result["weights"] <= 1e-5, result
    assert result["iterations"] == 8  # 2 epochs of 32 / 8 batches
    expected, got = result["expected"], result["got"]
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for key, values in expected.items():
        assert got[key] == pytest.approx(values, rel=1e-5, abs=1e-6), key


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "steps"),
    [("outside_scope", 8), pytest.param("trained_outside", 12, marks=pytest.mark.full(_MOVED_IN))],
)
def test_a_model_built_or_trained_outside_the_scope_moves_to_the_ps_and_continues(
    case: str, steps: int, trained: dict[str, Any]
) -> None:
    result = trained[case]
    assert "error" not in result, result
    assert result["on_ps"] and result["weights"] <= 1e-5, result
    assert result["iterations"] == steps
    for key, values in result["expected"].items():
        assert result["got"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key


@pytest.mark.multiprocess
@pytest.mark.slow
def test_history_carries_the_compiled_metrics(trained: dict[str, Any]) -> None:
    # (add_loss's model's, "loss" and "mae": its own case compares its History's keys)
    assert {"loss", "a_accuracy", "b_mae", "a_loss", "b_loss"} <= set(trained["two_outputs"]["got"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_step_that_cannot_run_on_the_workers_is_refused(trained: dict[str, Any]) -> None:
    refusals = trained["refusals"]
    assert (
        "MakesVariable.train_step cannot run under ParameterServerStrategy"
        in refusals["creates_variable"]
    ), refusals
    assert "overridden: train_step" in refusals["creates_variable"]
    assert not any(message.endswith(" TRAINED") for message in refusals.values())
    assert "self.other_optimizer (not built)" in refusals["unbuilt_optimizer"], refusals
    assert "Fix:" in refusals["unbuilt_optimizer"]


_TWO_WORKERS = """
import json
import keras, numpy as np, tensorflow as tf
import tfscale
from tfscale.testing import in_process_parameter_servers

strategy = in_process_parameter_servers(workers=2)


class Examples(keras.metrics.Metric):
    def __init__(self, name="examples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.seen = self.add_variable((), initializer="zeros", name="seen")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.seen.assign_add(tf.cast(tf.shape(y_true)[0], self.seen.dtype))

    def result(self):
        return self.seen


rng = np.random.default_rng(0)
x = rng.normal(size=(256, 4)).astype("float32")
y = x[:, :1] * 2
with strategy.scope():
    i = keras.Input((4,))
    model = keras.Model(i, keras.layers.Dense(1)(i))
    model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae", Examples()])
history = tfscale.fit(model, x, y, strategy=strategy, batch_size=8, epochs=2, verbose=0)
print("RESULTS " + json.dumps({"history": history.history,
                               "iterations": int(model.optimizer.iterations.numpy())}))
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_workers_metrics_count_every_step() -> None:
    done = run_python(_TWO_WORKERS, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULTS ") :])
    history = result["history"]
    assert set(history) == {"loss", "mae", "examples"}
    assert history["examples"] == [256.0, 256.0]  # 32 steps of 8, on either worker
    assert result["iterations"] == 64
    assert history["loss"][1] < history["loss"][0]
