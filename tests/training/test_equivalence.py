"""N replicas == one device; k accumulated micro-batches == one batch of k*B; one all-reduce
per update. Weights are compared after 5 updates against a hand-written single-device loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import relative_difference, run_python
from tfscale.training import Trainer
from tfscale.training.allreduce import buckets
from tfscale.training.prepare import prepared

from .helpers import DATA, batches, reference_weights, strategy_for, tiered, tiny_model

pytestmark = pytest.mark.tf

STEPS, BATCH = 5, 32
TESTS = Path(__file__).resolve().parents[1]
_REFERENCES: dict[tuple[str, int], list[object]] = {}


def _reference(optimizer: str, batch: int) -> list[object]:
    key = (optimizer, batch)
    if key not in _REFERENCES:
        x, y = DATA
        _REFERENCES[key] = reference_weights(x, y, batch=batch, steps=STEPS, optimizer=optimizer)
    return _REFERENCES[key]


_REPLICAS = [(replicas, optimizer) for replicas in (0, 1, 2, 4) for optimizer in ("sgd", "adam")]


# `make test` runs 2 replicas with SGD; the other counts and optimizers (the same fit and
# update; an optimizer's own step is Keras's) run in `make test-full`.
@pytest.mark.parametrize(
    ("replicas", "optimizer"),
    tiered(
        _REPLICAS,
        {
            "0-sgd": "2-sgd",
            "0-adam": "4-adam",
            "1-sgd": "2-sgd",
            "1-adam": "4-adam",
            "2-adam": "4-adam",
            "4-sgd": "2-sgd",
            "4-adam": "2-sgd",
        },
        "tests/training/test_equivalence.py::test_replicas_give_the_weights_of_one_device",
        ids=[f"{r}-{o}" for r, o in _REPLICAS],
    ),
)
def test_replicas_give_the_weights_of_one_device(replicas: int, optimizer: str) -> None:
    x, y = DATA
    strategy = strategy_for(replicas)
    model = tiny_model(strategy, optimizer)
    history = tfscale.fit(
        model, batches(x, y, BATCH), steps_per_epoch=STEPS, strategy=strategy, verbose=0
    )
    assert relative_difference(model.get_weights(), _reference(optimizer, BATCH)) <= 1e-5
    assert set(history.history) == {"loss", "accuracy"}


_ACCUMULATING = [(replicas, optimizer) for replicas in (0, 2) for optimizer in ("sgd", "adam")]


@pytest.mark.parametrize(
    ("replicas", "optimizer"),
    tiered(
        _ACCUMULATING,
        {"0-sgd": "2-adam", "0-adam": "2-adam", "2-sgd": "2-adam"},
        "tests/training/test_equivalence.py::"
        "test_accumulating_k_micro_batches_equals_one_batch_of_k_times_b",
        ids=[f"{r}-{o}" for r, o in _ACCUMULATING],
    ),
)
def test_accumulating_k_micro_batches_equals_one_batch_of_k_times_b(
    replicas: int, optimizer: str
) -> None:
    x, y = DATA
    k, micro = 4, 8
    strategy = strategy_for(replicas)
    model = tiny_model(strategy, optimizer)
    tfscale.fit(
        model,
        batches(x, y, micro),
        steps_per_epoch=STEPS * k,  # steps are batches, as in model.fit
        accumulation_steps=k,
        strategy=strategy,
        verbose=0,
    )
    assert model.optimizer.iterations.numpy() == STEPS
    assert relative_difference(model.get_weights(), _reference(optimizer, k * micro)) <= 1e-5


def test_exactly_one_gradient_all_reduce_per_update_with_k_4() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy)
    trainer = Trainer(model, strategy, accumulation_steps=4, sample_batch=(x[:8], y[:8]))
    iterator = iter(strategy.experimental_distribute_dataset(batches(x, y, 8)))
    done, exhausted, _ = trainer.train(iterator, 3)
    assert (done, exhausted) == (3, False)
    update = prepared(model).update  # type: ignore[union-attr]
    # Traced into the update only, not into each micro-batch: once per replica (a
    # MirroredStrategy traces the replica function once for each of its 2 replicas) ...
    assert update.all_reduce_traces == strategy.num_replicas_in_sync == 2
    # ... and ran once per update: 3 updates of 4 micro-batches = 3 all-reduces, not 12.
    assert int(update.all_reduce_runs.numpy()) == 3
    assert int(model.optimizer.iterations.numpy()) == 3


@pytest.mark.full(
    "tests/training/test_steps_per_call.py::"
    "test_several_steps_per_call_give_one_devices_weights_history_and_updates[arrays]",
    "tests/training/test_equivalence.py::"
    "test_remat_recomputes_the_forward_pass_in_the_backward_pass",
)
def test_steps_per_execution_remat_and_jit_change_nothing() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy, "adam")
    tfscale.fit(
        model,
        batches(x, y, BATCH),
        steps_per_epoch=STEPS,
        steps_per_execution=3,
        remat=True,
        jit_compile=True,
        strategy=strategy,
        verbose=0,
    )
    assert relative_difference(model.get_weights(), _reference("adam", BATCH)) <= 1e-5


@pytest.mark.full(
    "tests/training/test_equivalence.py::"
    "test_remat_recomputes_the_forward_pass_in_the_backward_pass",
)
def test_remat_under_a_mixed_policy_gives_the_weights_without_remat() -> None:
    """Remat recomputes each layer's call in the backward pass, outside the layer's autocast
    scope: under bf16 its float32 weights met bfloat16 inputs there (a bare TypeError from
    MatMul) until the recomputation re-entered the scope of the call it repeats."""
    x, y = DATA
    strategy = strategy_for(2)
    runs = []
    for remat in (False, True):
        model = tiny_model(strategy, "adam")
        tfscale.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                    strategy=strategy, mixed_precision="bf16", remat=remat)  # fmt: skip
        runs.append(model.get_weights())
    assert relative_difference(runs[1], runs[0]) <= 1e-6


@pytest.mark.full(
    "tests/training/test_equivalence.py::test_replicas_give_the_weights_of_one_device[2-sgd]",
    "tests/training/test_inputs.py::"
    "test_generator_inputs_leave_the_users_arrays_unchanged_and_train_as_one_device"
    "[generator-prepare]",
)
def test_arrays_dataset_fn_and_batched_dataset_are_the_same_input() -> None:
    x, y = DATA
    strategy = strategy_for(2)

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        per_replica = context.get_per_replica_batch_size(BATCH)
        return batches(x, y, BATCH).unbatch().batch(per_replica)  # replica r: its half

    weights = []
    for data in (batches(x, y, BATCH), dataset_fn):
        model = tiny_model(strategy)
        tfscale.fit(model, data, steps_per_epoch=2, strategy=strategy, verbose=0)
        weights.append(model.get_weights())
    model = tiny_model(strategy)
    tfscale.fit(model, x, y, batch_size=BATCH, epochs=2, strategy=strategy, verbose=0)
    assert relative_difference(weights[1], weights[0]) <= 1e-5
    assert model.optimizer.iterations.numpy() == 2 * len(x) // BATCH


@pytest.mark.full(
    "tests/training/test_equivalence.py::"
    "test_a_global_batch_the_replicas_do_not_divide_is_the_single_device_mean",
)
def test_a_short_last_batch_split_unevenly_is_still_the_single_device_mean() -> None:
    x, y = DATA
    x, y = x[:250], y[:250]  # 7 batches of 32, then 26 examples: 7, 7, 6, 6 on 4 replicas
    strategy = strategy_for(4)
    model = tiny_model(strategy, "adam")
    tfscale.fit(model, batches(x, y, 32), strategy=strategy, verbose=0)
    expected = reference_weights(x, y, batch=32, steps=8, optimizer="adam")
    assert relative_difference(model.get_weights(), expected) <= 1e-5


def _mean_of_batch(y: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Cross-entropy averaged by the loss itself: NaN (0 / 0) on a batch of no examples."""
    losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return tf.reduce_sum(losses) / tf.cast(tf.size(losses), losses.dtype)


@pytest.mark.full(
    "tests/training/test_equivalence.py::"
    "test_a_global_batch_the_replicas_do_not_divide_is_the_single_device_mean",
)
def test_replicas_left_without_examples_neither_stop_training_nor_poison_the_loss() -> None:
    x, y = DATA
    x, y = x[:226], y[:226]  # 7 batches of 32, then 2 examples: 1, 1, 0, 0 on 4 replicas
    strategy = strategy_for(4)
    model = tiny_model(strategy, "adam")
    with strategy.scope():
        model.compile(optimizer=model.optimizer, loss=_mean_of_batch)
    history = tfscale.fit(model, batches(x, y, 32), strategy=strategy, verbose=0)
    expected = reference_weights(x, y, batch=32, steps=8, optimizer="adam")
    assert relative_difference(model.get_weights(), expected) <= 1e-5
    # The epoch's loss is the mean over the 226 examples, as on one device; Keras's own
    # fit under the same strategy reports NaN (its tracker weighs NaN by 0 examples).
    reference = tiny_model(None, "adam")
    reference.compile(optimizer=reference.optimizer, loss=_mean_of_batch)
    one = reference.fit(batches(x, y, 32), verbose=0, shuffle=False)
    loss = history.history["loss"][0]
    assert np.isfinite(loss) and abs(loss - one.history["loss"][0]) <= 1e-5 * abs(loss)
    keras_model = tiny_model(strategy, "adam")
    with strategy.scope():
        keras_model.compile(optimizer=keras_model.optimizer, loss=_mean_of_batch)
    keras_history = keras_model.fit(batches(x, y, 32), verbose=0, shuffle=False)
    assert np.isnan(keras_history.history["loss"][0])


def test_a_global_batch_the_replicas_do_not_divide_is_the_single_device_mean() -> None:
    x, y = DATA
    strategy = strategy_for(4)  # 30 examples a batch: 8, 8, 7, 7
    model = tiny_model(strategy, "adam")
    tfscale.fit(model, x, y, batch_size=30, shuffle=False, strategy=strategy, verbose=0)
    expected = reference_weights(x, y, batch=30, steps=9, optimizer="adam")
    assert relative_difference(model.get_weights(), expected) <= 1e-5


def _matmuls(model: object, strategy: tf.distribute.Strategy, remat: bool) -> int:
    trainer = Trainer(model, strategy, remat=remat)
    dataset = strategy.experimental_distribute_dataset(batches(*DATA, 32))
    function = trainer._function._multi.get_concrete_function(iter(dataset), tf.constant(1))
    graph = function.graph.as_graph_def()
    nodes = list(graph.node)
    for library_function in graph.library.function:
        nodes.extend(library_function.node_def)
    return sum(node.op == "MatMul" for node in nodes)


def test_remat_recomputes_the_forward_pass_in_the_backward_pass() -> None:
    strategy = strategy_for(0)
    model = tiny_model(strategy)
    plain = _matmuls(model, strategy, remat=False)
    recomputed = _matmuls(model, strategy, remat=True)
    assert recomputed >= plain + 3  # each of the 3 Dense layers' forward matmul again


def test_the_default_strategy_trains_like_one_device() -> None:
    """What a model placed by hand (e.g. a pipeline over devices) trains under."""
    x, y = DATA
    strategy = tf.distribute.get_strategy()
    model = tiny_model(None, "adam")
    tfscale.fit(model, batches(x, y, BATCH), steps_per_epoch=STEPS, strategy=strategy, verbose=0)
    assert relative_difference(model.get_weights(), _reference("adam", BATCH)) <= 1e-5


@pytest.mark.full(
    "tests/training/test_equivalence.py::test_exactly_one_gradient_all_reduce_per_update_with_k_4",
)
def test_bucketed_all_reduce_gives_the_packed_weights_with_one_collective_per_bucket() -> None:
    x, y = DATA
    strategy = strategy_for(2)
    weights = []
    for bucket_bytes in (None, 64):  # the tiny MLP's 6 gradients: 1 bucket, or several
        model = tiny_model(strategy, "adam")
        tfscale.fit(
            model, batches(x, y, BATCH), steps_per_epoch=STEPS, bucket_bytes=bucket_bytes,
            strategy=strategy, verbose=0,
        )  # fmt: skip
        weights.append(model.get_weights())
    gradients = [tf.zeros(v.shape) for v in model.trainable_variables]
    assert len(buckets(gradients, None)) == 1 and len(buckets(gradients, 64)) >= 3
    assert relative_difference(weights[1], weights[0]) <= 1e-6
    assert relative_difference(weights[0], _reference("adam", BATCH)) <= 1e-5


@pytest.mark.parametrize(
    ("compression", "tolerance"),
    tiered(
        [("bf16", 2e-2), ("fp16", 3e-3)],
        {"fp16-0.003": "bf16-0.02"},
        "tests/training/test_equivalence.py::test_compressed_all_reduce_stays_close_to_float32",
        ids=["bf16-0.02", "fp16-0.003"],
    ),
)
def test_compressed_all_reduce_stays_close_to_float32(compression: str, tolerance: float) -> None:
    """bfloat16 keeps 8 bits of mantissa, float16 11: after 5 Adam updates the weights stay
    within these relative differences of the float32 all-reduce (measured: bf16 6.2e-3,
    fp16 9.1e-4 on this model), and move as much as training moves them."""
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy, "adam")
    tfscale.fit(
        model, batches(x, y, BATCH), steps_per_epoch=STEPS, gradient_compression=compression,
        strategy=strategy, verbose=0,
    )  # fmt: skip
    expected = _reference("adam", BATCH)
    difference = relative_difference(model.get_weights(), expected)
    assert 0.0 < difference <= tolerance
    untrained = tiny_model(strategy, "adam").get_weights()
    assert relative_difference(untrained, expected) > 10 * tolerance


@pytest.mark.full(
    "tests/training/test_equivalence.py::"
    "test_compressed_all_reduce_stays_close_to_float32[bf16-0.02]",
)
def test_each_step_function_keeps_its_own_communication_options() -> None:
    """Two trainers of one model (profiling's with and without the all-reduce) share the
    optimizer's distributed update: the one built first still all-reduces in bf16 buckets
    and clips, as it was asked, after the second was built with none of it."""
    x, y = DATA
    strategy = strategy_for(2)
    options = {"gradient_compression": "bf16", "bucket_bytes": 64, "global_clipnorm": 0.05}
    weights = []
    for second in (False, True):
        model = tiny_model(strategy, "adam")
        trainer = Trainer(model, strategy, sample_batch=(x[:8], y[:8]), **options)
        if second:
            Trainer(model, strategy, all_reduce=False, sample_batch=(x[:8], y[:8]))
        trainer.train(iter(strategy.experimental_distribute_dataset(batches(x, y, BATCH))), STEPS)
        weights.append(model.get_weights())
    assert relative_difference(weights[1], weights[0]) == 0.0
    # The options matter here: float32 without clipping is elsewhere.
    plain = tiny_model(strategy, "adam")
    Trainer(plain, strategy, sample_batch=(x[:8], y[:8])).train(
        iter(strategy.experimental_distribute_dataset(batches(x, y, BATCH))), STEPS
    )
    assert relative_difference(plain.get_weights(), weights[0]) > 1e-3


def test_unknown_gradient_compression_is_refused() -> None:
    strategy = strategy_for(2)
    with pytest.raises(tfscale.TrainingError, match="Unknown gradient_compression"):
        tfscale.fit(
            tiny_model(strategy), *DATA, gradient_compression="int8", strategy=strategy, verbose=0
        )


@pytest.mark.multiprocess
@pytest.mark.full(
    "tests/training/test_steps_per_call.py::"
    "test_several_steps_per_call_give_one_devices_weights_history_and_updates[arrays]",
    "tests/training/test_parity_examples.py::"
    "test_cases_across_two_worker_processes_match_one_device[paths_across_workers]",
)
def test_several_steps_per_call_under_mirroreds_default_collective_all_reduce() -> None:
    """Keras's own fit fails there with steps_per_execution > 1 ("You must feed a value for
    placeholder tensor"); in a fresh process, because a second collective MirroredStrategy
    in one process fails (tensorflow/tensorflow#62790)."""
    result = run_python(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        import tensorflow as tf, tfscale
        from tfscale.testing import relative_difference
        from training.helpers import DATA, batches, reference_weights, tiny_model
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])  # collective ops
        x, y = DATA
        model = tiny_model(strategy, "adam")
        tfscale.fit(model, batches(x, y, 32), steps_per_epoch=5, steps_per_execution=3,
                    strategy=strategy, verbose=0)
        expected = reference_weights(x, y, batch=32, steps=5, optimizer="adam")
        print("difference", relative_difference(model.get_weights(), expected))
        """,
        virtual_devices=2,
        args=[str(TESTS)],
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.split("difference")[-1]) <= 1e-5


def _summing_regressor(
    strategy: tf.distribute.Strategy | None, reduction: str | None = "sum"
) -> object:
    """A seeded 2-layer regressor whose loss's gradient is the sum over the batch
    (``reduction="sum"``, or None: unreduced, which Keras's fit differentiates as its sum)."""
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
        )
        model.compile(
            keras.optimizers.SGD(0.002), loss=keras.losses.MeanSquaredError(reduction=reduction)
        )
    return model


# `make test` runs the sum plain; under XLA, several steps per call or accumulation, and
# Keras's None (differentiated as the same sum), in `make test-full`.
@pytest.mark.parametrize(
    ("reduction", "options"),
    tiered(
        [
            ("sum", {}),
            ("sum", {"steps_per_execution": 3}),
            ("sum", {"jit_compile": True}),
            ("sum", {"accumulation_steps": 2}),
            (None, {}),
            (None, {"jit_compile": True}),
        ],
        {
            "steps_per_execution": "plain",
            "accumulation_steps": "plain",
            "none": "plain",
            "none-jit": "jit_compile",
            "jit_compile": "plain",
        },
        "tests/training/test_equivalence.py::test_a_loss_summed_over_the_batch_is_one_devices_sum",
        ids=[
            "plain",
            "steps_per_execution",
            "jit_compile",
            "accumulation_steps",
            "none",
            "none-jit",
        ],
    ),
)
def test_a_loss_summed_over_the_batch_is_one_devices_sum(
    reduction: str | None, options: dict[str, object]
) -> None:
    """``reduction="sum"`` (and None, whose vector Keras's fit differentiates as its sum):
    Keras leaves the sum unscaled under a strategy (the replicas' gradients summed are one
    device's); tfscale weighs each replica's loss by its examples as a mean, so it
    multiplies such a sum by the batch's examples over the replica's. Taken
    for a mean, it gave one device's update divided by the replicas (0.41 apart). 57 examples
    in batches of 16 end with 9 (5 and 4 on 2 replicas), and the validation loss is a sum too.
    With accumulation, one device's reference is Keras's own ``gradient_accumulation_steps``
    (the mean of the micro-batches' updates)."""
    accumulation = options.get("accumulation_steps")
    rng = np.random.default_rng(17)
    # Keras's accumulation weighs a short last micro-batch as a full one: 64 examples there.
    x = rng.normal(size=(57 if accumulation is None else 64, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    fit = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    fit["validation_data"] = (x[:20], y[:20])
    reference = _summing_regressor(None, reduction)
    if accumulation is not None:
        optimizer = keras.optimizers.SGD(0.002, gradient_accumulation_steps=accumulation)
        reference.compile(optimizer, loss=reference.loss)
    initial = reference.get_weights()
    with tf.device("/device:CPU:0"):
        one = reference.fit(x, y, **fit)
    strategy = strategy_for(2)
    model = _summing_regressor(strategy, reduction)
    model.set_weights(initial)
    history = tfscale.fit(model, x, y, strategy=strategy, **fit, **options)
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    for key in ("loss", "val_loss"):
        assert relative_difference(history.history[key], one.history[key]) <= 1e-5, key


class _SumsInItsStep(keras.Sequential):  # type: ignore[misc]
    """A train_step that computes its loss with a Loss summing over the batch that
    model.compile was not given (keras-io's custom-train-step guide's shape)."""

    summed = keras.losses.MeanSquaredError(reduction="sum")

    def train_step(self, data: object) -> dict[str, object]:
        x, y = data  # type: ignore[misc]
        with tf.GradientTape() as tape:
            loss = self.summed(y, self(x, training=True))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        return {"loss": loss}


def _summing_in_its_step(strategy: tf.distribute.Strategy | None) -> object:
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(3)
        model = _SumsInItsStep([keras.Input((5,)), keras.layers.Dense(1)], name="sums")
        model.compile(keras.optimizers.SGD(0.002))
    return model


def test_a_loss_a_train_step_sums_itself_is_one_devices_sum_and_refused_under_jit() -> None:
    rng = np.random.default_rng(18)
    x = rng.normal(size=(57, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    reference = _summing_in_its_step(None)
    initial = reference.get_weights()
    with tf.device("/device:CPU:0"):
        reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    strategy = strategy_for(2)
    model = _summing_in_its_step(strategy)
    model.set_weights(initial)
    tfscale.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, strategy=strategy)
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    # Under XLA the example counts' all-reduce cannot run inside the compiled step.
    compiled = _summing_in_its_step(strategy)
    with pytest.raises(tfscale.TrainingError, match='reduction="sum"'):
        tfscale.fit(compiled, x, y, batch_size=16, strategy=strategy, jit_compile=True, verbose=0)
    assert relative_difference(compiled.get_weights(), initial) == 0.0  # nothing trained


def _weighted_mean_regressor(strategy: tf.distribute.Strategy | None) -> object:
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(
            keras.optimizers.SGD(0.01),
            loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
        )
    return model


def test_a_mean_over_the_sample_weights_divides_by_the_batchs_weights() -> None:
    """``reduction="mean_with_sample_weight"`` divides by the sum of the sample weights: one
    device the batch's, each replica its own share's (as Keras's own fit under a strategy
    does: 0.05 apart here); tfscale makes each replica's mean its share of the batch's (one
    scalar all-reduce of the weights). Weights that differ between the halves of each batch
    make the shares' sums differ."""
    rng = np.random.default_rng(19)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    weights = np.where(np.arange(64) % 16 < 8, 0.2, 2.0).astype("float32")
    fit = {"sample_weight": weights, "batch_size": 16, "epochs": 2, "shuffle": False}
    reference = _weighted_mean_regressor(None)
    initial = reference.get_weights()
    with tf.device("/device:CPU:0"):
        one = reference.fit(x, y, verbose=0, **fit)
    strategy = strategy_for(2)
    model = _weighted_mean_regressor(strategy)
    model.set_weights(initial)
    history = tfscale.fit(model, x, y, strategy=strategy, verbose=0, **fit)
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    assert relative_difference(history.history["loss"], one.history["loss"]) <= 1e-5


_PER_EXAMPLE = keras.losses.MeanSquaredError(reduction=None)


class _SumsInComputeLoss(keras.Sequential):  # type: ignore[misc]
    """A ``compute_loss`` override whose loss sums over the batch, written three ways:
    ``keras_io``, keras-io's masked language model's (``keras.ops.sum`` of a ``Loss`` with
    ``reduction=None``, the sample weights passed to it); ``global_batch``, TensorFlow's
    custom-loop convention (a sum divided by the global batch) plus the model's
    regularization and a hand-made L2 of a kernel (per-replica constants, which stay as they
    are); ``listed``, a sum of a list of terms (``keras.ops.sum([...])``) mixing a sum over
    the examples with a ``tf.reduce_mean``."""

    way = "keras_io"

    def compute_loss(
        self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None,
        training: bool = True,
    ) -> Any:  # fmt: skip
        per_example = _PER_EXAMPLE(y, y_pred, sample_weight)
        if self.way == "keras_io":
            return keras.ops.sum(per_example)
        if self.way == "global_batch":
            kernel = self.layers[0].kernel
            hand_l2 = 0.01 * keras.ops.sum(keras.ops.square(kernel))
            return tf.reduce_sum(per_example) / 16.0 + tf.add_n(self.losses) + hand_l2
        return keras.ops.sum([keras.ops.sum(per_example), 3.0 * tf.reduce_mean(per_example)])


def _sums_in_compute_loss(strategy: tf.distribute.Strategy | None, way: str) -> object:
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(3)
        model = _SumsInComputeLoss(
            [
                keras.Input((5,)),
                keras.layers.Dense(4, activation="tanh", kernel_regularizer="l2"),
                keras.layers.Dense(1),
            ],
            name="sums",
        )
        model.way = way
        model.compile(keras.optimizers.SGD(0.002))
    return model


# `make test` runs keras-io's override; the other ways of writing the sum, and it under XLA
# (the summed loss under XLA: test_a_loss_summed_over_the_batch_is_one_devices_sum), in
# `make test-full`.
@pytest.mark.parametrize(
    ("way", "options"),
    tiered(
        [
            ("keras_io", {}),
            ("global_batch", {}),
            ("listed", {}),
            ("keras_io", {"jit_compile": True}),
        ],
        {"global_batch": "keras_io", "listed": "keras_io", "keras_io-jit": "keras_io"},
        "tests/training/test_equivalence.py::"
        "test_a_compute_loss_override_that_sums_over_the_batch_is_one_devices_sum",
        ids=["keras_io", "global_batch", "listed", "keras_io-jit"],
    ),
)
def test_a_compute_loss_override_that_sums_over_the_batch_is_one_devices_sum(
    way: str, options: dict[str, object]
) -> None:
    """keras-io's masked language model returns ``keras.ops.sum`` of per-token losses from
    its ``compute_loss``: Keras's own fit under a strategy sums the replicas' gradients (one
    device's); weighed as a mean it gave half one device's update on 2 replicas (0.49 apart).
    tfscale finds the loss's terms that sum over the replica's examples and makes each the
    batch's sum; the others (regularization, means) stay per-replica means. 57 examples in
    batches of 16 end with 9 (5 and 4 on 2 replicas), with random sample weights."""
    rng = np.random.default_rng(23)
    x = rng.normal(size=(57, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    weights = rng.uniform(0.2, 2.0, size=(57,)).astype("float32")
    fit = {"sample_weight": weights, "batch_size": 16, "epochs": 2, "shuffle": False}
    reference = _sums_in_compute_loss(None, way)
    initial = reference.get_weights()
    with tf.device("/device:CPU:0"):
        one = reference.fit(x, y, verbose=0, validation_data=(x[:20], y[:20]), **fit)
    strategy = strategy_for(2)
    model = _sums_in_compute_loss(strategy, way)
    model.set_weights(initial)
    history = tfscale.fit(
        model, x, y, strategy=strategy, verbose=0, validation_data=(x[:20], y[:20]), **fit,
        **options,
    )  # fmt: skip
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    for key in ("loss", "val_loss"):
        assert relative_difference(history.history[key], one.history[key]) <= 1e-5, key


class _PerExampleLoss(keras.layers.Layer):  # type: ignore[misc]
    """An endpoint layer handing ``add_loss`` each example's loss (shape (batch, 1)), as
    keras-io's captcha OCR ``CTCLayer`` does: Keras's ``compute_loss`` sums each ``add_loss``
    value, so one device's loss is the batch's sum."""

    def call(self, y_true: Any, y_pred: Any) -> Any:
        self.add_loss(keras.ops.mean(keras.ops.square(y_true - y_pred), axis=1, keepdims=True))
        return y_pred


def _adding_per_example_losses(strategy: tf.distribute.Strategy | None) -> object:
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(3)
        x, y = keras.Input((5,), name="x"), keras.Input((1,), name="y")
        hidden = keras.layers.Dense(4, activation="tanh")(x)
        model = keras.Model({"x": x, "y": y}, _PerExampleLoss()(y, keras.layers.Dense(1)(hidden)))
        model.compile(keras.optimizers.SGD(0.002))
    return model


def test_an_add_loss_of_per_example_losses_is_one_devices_sum_and_refused_under_jit() -> None:
    """Keras's own fit under a strategy scales each replica's sum by 1/N (0.42 apart from one
    device here), as tfscale did; tfscale now makes it the batch's sum. Under XLA the
    examples' ratio cannot be made inside the compiled step for it: refused before the first
    update, with the fixes."""
    rng = np.random.default_rng(29)
    x = rng.normal(size=(57, 5)).astype("float32")
    data = {"x": x, "y": (x @ rng.normal(size=(5, 1))).astype("float32")}
    fit = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    reference = _adding_per_example_losses(None)
    initial = reference.get_weights()
    with tf.device("/device:CPU:0"):
        one = reference.fit(data, **fit)
    strategy = strategy_for(2)
    model = _adding_per_example_losses(strategy)
    model.set_weights(initial)
    history = tfscale.fit(model, data, strategy=strategy, **fit)
    assert relative_difference(model.get_weights(), reference.get_weights()) <= 1e-5
    assert relative_difference(history.history["loss"], one.history["loss"]) <= 1e-5
    compiled = _adding_per_example_losses(strategy)
    with pytest.raises(tfscale.TrainingError, match="add_loss of per-example values"):
        tfscale.fit(compiled, data, strategy=strategy, jit_compile=True, **fit)
    assert relative_difference(compiled.get_weights(), initial) == 0.0  # nothing trained
