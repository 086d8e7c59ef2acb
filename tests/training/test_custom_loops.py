"""Custom GradientTape loops with one added ``tfscale.prepare_loop`` line give one device's
weights over 2 replicas: the tutorial's, the Keras guide's and the users' loop
(``loops.py``), every loss convention (SGD, where a wrong scale shows) or a refusal before
the first update, accumulation, lazily built Adam / AdamW / LossScaleOptimizer, sparse
gradients, and a checkpoint resumed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import relative_difference
from tfscale.training.loop import loop_state

from .helpers import DATA, strategy_for, tiered
from .loops import (
    convention_loop,
    dcgan_loop,
    guide_loop,
    images,
    multi_worker_loop,
    tutorial_loop,
    user_loop,
)

pytestmark = pytest.mark.tf

# One parameter of each test below in `make test`, the others (the same loop path with another
# optimizer or convention) in `make test-full` (#41).
_T = "tests/training/test_custom_loops.py::"

TOLERANCE = 1e-5


def _prepare(model: Any, optimizer: Any) -> Any:
    return tfscale.prepare_loop(model, optimizer)


def _per_variable(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """The largest relative difference of any one variable."""
    return max(relative_difference([g], [w]) for g, w in zip(got, want, strict=True))


def test_the_tutorial_loop_with_one_line_gives_one_device_weights() -> None:
    x, y = images(64)
    one = tutorial_loop(strategy_for(0), None, x, y)
    two = tutorial_loop(strategy_for(2), _prepare, x, y)
    assert _per_variable(two, one) <= TOLERANCE


def test_the_multi_worker_tutorial_loop_with_one_line_gives_one_device_weights() -> None:
    """Its input from distribute_datasets_from_function, read by next(iterator) inside the
    tf.function (under tfscale launch: test_custom_loops_launch.py)."""
    x, y = images(64)
    one = multi_worker_loop(strategy_for(0), None, x, y)
    two = multi_worker_loop(strategy_for(2), _prepare, x, y)
    assert _per_variable(two[:-1], one[:-1]) <= TOLERANCE
    assert int(two[-1]) == int(one[-1]) == 8


@pytest.mark.full(
    "tests/training/test_custom_loops.py::"
    "test_the_tutorial_loop_with_one_line_gives_one_device_weights",
)
def test_the_dcgan_tutorial_loop_gives_one_device_weights_for_both_models() -> None:
    """Two prepared models and optimizers made outside any scope (the optimizers were built
    for the default strategy: "Mixing different tf.distribute.Strategy objects"), and two
    losses computed before either gradient (the discriminator's was forgotten once the
    generator's gradient was taken, and refused as unrecognized)."""
    rng = np.random.default_rng(17)
    real, noise = rng.normal(size=(64, 6)), rng.normal(size=(64, 4))
    real, noise = real.astype("float32"), noise.astype("float32")
    # One device as in the tutorial: no strategy (its optimizers cannot be built under a
    # OneDeviceStrategy they were not created in, unprepared).
    one = dcgan_loop(tf.distribute.get_strategy(), None, real, noise)
    strategy = strategy_for(2)
    two = dcgan_loop(strategy, lambda m, o: tfscale.prepare_loop(m, o, strategy), real, noise)
    assert _per_variable(two[:-2], one[:-2]) <= TOLERANCE
    assert [int(n) for n in two[-2:]] == [int(n) for n in one[-2:]] == [8, 8]


@pytest.mark.full(
    "tests/training/test_custom_loops.py::"
    "test_the_keras_guides_eager_loop_with_one_line_gives_one_device_weights",
)
def test_the_keras_guide_loop_with_one_line_gives_one_device_weights() -> None:
    x, y = DATA
    one = guide_loop(strategy_for(0), None, x, y)
    two = guide_loop(strategy_for(2), _prepare, x, y)
    assert _per_variable(two, one) <= TOLERANCE


def test_the_keras_guides_eager_loop_with_one_line_gives_one_device_weights() -> None:
    # The guide's first loop runs its step eagerly: the Keras Loss object's mean is
    # recognized by the tensor itself (there is no graph to read).
    x, y = DATA[0][:64], DATA[1][:64]
    one = guide_loop(strategy_for(0), None, x, y, eager=True, optimizer_name="sgd", epochs=1)
    two = guide_loop(strategy_for(2), _prepare, x, y, eager=True, optimizer_name="sgd", epochs=1)
    assert _per_variable(two, one) <= TOLERANCE


@pytest.mark.parametrize(
    "optimizer",
    tiered(
        ["sgd", "adam"],
        {"sgd": "adam"},
        f"{_T}test_the_users_loop_with_one_line_gives_one_device_weights",
    ),
)
def test_the_users_loop_with_one_line_gives_one_device_weights(optimizer: str) -> None:
    x, y = DATA
    one = user_loop(strategy_for(0), None, x[:96], y[:96], optimizer_name=optimizer)
    two = user_loop(strategy_for(2), _prepare, x[:96], y[:96], optimizer_name=optimizer)
    assert _per_variable(two, one) <= TOLERANCE


# The learning rate of each convention: a sum's gradient is a batch of 16 times a mean's.
_ACCEPTED = {
    "keras_object": 0.2,
    "reduce_mean": 0.2,
    "per_example_vector": 0.01,
    "compute_average_loss": 0.2,
    "compute_average_loss_global": 0.2,
}


@pytest.mark.parametrize("convention", sorted(_ACCEPTED))
def test_each_loss_convention_gives_one_device_weights_with_sgd(convention: str) -> None:
    x, y = DATA[0][:64], DATA[1][:64]
    lr = _ACCEPTED[convention]
    one, _ = convention_loop(strategy_for(0), None, x, y, convention, lr=lr)
    two, optimizer = convention_loop(strategy_for(2), _prepare, x, y, convention, lr=lr)
    assert _per_variable(two, one) <= TOLERANCE
    assert int(optimizer.iterations.numpy()) == 8  # 4 batches, 2 epochs


def test_without_tfscale_reduce_mean_gives_twice_the_update() -> None:
    # The failure prepare_loop fixes: Keras sums the replicas' gradients of their means.
    x, y = DATA[0][:64], DATA[1][:64]
    one, _ = convention_loop(strategy_for(0), None, x, y, "reduce_mean")
    two, _ = convention_loop(strategy_for(2), None, x, y, "reduce_mean")
    assert _per_variable(two, one) > 1e-2


@pytest.mark.parametrize(
    ("convention", "named"),
    [
        ("divided_by_global_batch", "RealDiv"),
        ("reduce_mean_plus_model_losses", "Mul op"),
    ],
)
def test_a_loss_tfscale_cannot_tell_is_refused_before_the_first_update(
    convention: str, named: str
) -> None:
    x, y = DATA[0][:64], DATA[1][:64]
    strategy = strategy_for(2)
    prepared: list[Any] = []

    def prepare(model: Any, optimizer: Any) -> Any:
        prepared.append((model, optimizer, [w.copy() for w in model.get_weights()]))
        return _prepare(model, optimizer)

    with pytest.raises(tfscale.TrainingError) as error:
        convention_loop(strategy, prepare, x, y, convention)
    message = str(error.value)
    assert "cannot tell how this custom loop's loss is scaled" in message
    assert named in message and 'loss="global"' in message and 'loss="mean"' in message
    # Refused as the step is traced: no update ran, the weights are the initial ones.
    model, optimizer, initial = prepared[0]
    assert int(optimizer.iterations.numpy()) == 0
    assert initial and relative_difference(model.get_weights(), initial) == 0.0


@pytest.mark.parametrize(
    ("convention", "declared"),
    [("divided_by_global_batch", "global"), ("reduce_mean_plus_model_losses", "mean")],
)
def test_a_declared_convention_gives_one_device_weights(convention: str, declared: str) -> None:
    x, y = DATA[0][:64], DATA[1][:64]
    one, _ = convention_loop(strategy_for(0), None, x, y, convention)

    def declare(model: Any, optimizer: Any) -> Any:
        return tfscale.prepare_loop(model, optimizer, loss=declared)  # type: ignore[arg-type]

    two, _ = convention_loop(strategy_for(2), declare, x, y, convention)
    assert _per_variable(two, one) <= TOLERANCE


@pytest.mark.parametrize(
    "convention",
    tiered(
        ["reduce_mean", "keras_object", "compute_average_loss"],
        {"keras_object": "compute_average_loss"},
        f"{_T}test_an_uneven_split_is_weighted_by_examples",
    ),
)
def test_an_uneven_split_is_weighted_by_examples(convention: str) -> None:
    # Batches of 15: replica 0 gets 8 examples, replica 1 gets 7; a mean of each replica's
    # loss weighs them by their examples, as one device's mean over 15 does.
    x, y = DATA[0][:60], DATA[1][:60]
    one, _ = convention_loop(strategy_for(0), None, x, y, convention, batch=15)
    two, _ = convention_loop(strategy_for(2), _prepare, x, y, convention, batch=15)
    assert _per_variable(two, one) <= TOLERANCE
    if convention != "reduce_mean":  # Keras alone averages the replicas' means equally
        alone, _ = convention_loop(strategy_for(2), None, x, y, convention, batch=15)
        assert _per_variable(alone, one) > 10 * TOLERANCE


@pytest.mark.parametrize(
    "convention",
    tiered(
        ["reduce_mean", "keras_object"],
        {"reduce_mean": "keras_object"},
        f"{_T}test_accumulating_k_batches_equals_one_device_on_a_k_times_larger_batch",
    ),
)
def test_accumulating_k_batches_equals_one_device_on_a_k_times_larger_batch(
    convention: str,
) -> None:
    x, y = DATA[0][:64], DATA[1][:64]
    k = 2
    one, _ = convention_loop(strategy_for(0), None, x, y, convention, batch=16 * k)

    def accumulate(model: Any, optimizer: Any) -> Any:
        return tfscale.prepare_loop(model, optimizer, accumulation_steps=k)

    two, optimizer = convention_loop(strategy_for(2), accumulate, x, y, convention, batch=16)
    assert _per_variable(two, one) <= TOLERANCE
    state = loop_state(optimizer)
    assert state is not None
    # 4 batches x 2 epochs = 8 batches: 4 updates, each one all-reduce.
    assert int(optimizer.iterations.numpy()) == 4
    assert int(state.update.all_reduce_runs.numpy()) == 4


@pytest.mark.parametrize(
    "optimizer",
    tiered(
        ["adam", "adamw", "lso"],
        {"adamw": "adam", "lso": "adam"},
        f"{_T}test_optimizers_built_lazily_inside_strategy_run",
    ),
)
def test_optimizers_built_lazily_inside_strategy_run(optimizer: str) -> None:
    # user_loop's model has no Input: the model and the optimizer are built by the first
    # replica step, which tfscale moves out of it.
    x, y = DATA[0][:64], DATA[1][:64]
    one = user_loop(strategy_for(0), None, x, y, optimizer_name=optimizer)
    two = user_loop(strategy_for(2), _prepare, x, y, optimizer_name=optimizer)
    assert _per_variable(two, one) <= TOLERANCE


def test_sparse_embedding_gradients_stay_sparse() -> None:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 50, (64, 6)).astype("int32")
    labels = rng.integers(0, 2, 64).astype("int32")
    seen: list[type] = []

    def run(strategy: tf.distribute.Strategy, prepare: bool) -> list[np.ndarray]:
        keras.utils.set_random_seed(4)
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((6,), dtype="int32"),
                    keras.layers.Embedding(50, 4),
                    keras.layers.GlobalAveragePooling1D(),
                    keras.layers.Dense(2),
                ]
            )
            optimizer = keras.optimizers.SGD(0.5)
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if prepare:
            tfscale.prepare_loop(model, optimizer)
            update = loop_state(optimizer).update  # type: ignore[union-attr]
            original = update._original_apply

            def spy(grads: Any, variables: Any) -> Any:
                seen.extend(type(g) for g in grads)
                return original(grads, variables)

            update._original_apply = spy

        def step(xb: Any, yb: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        @tf.function
        def train(each: Any) -> Any:
            return strategy.run(step, args=each)

        data = tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(16)
        for each in strategy.experimental_distribute_dataset(data):
            train(each)
        return [np.asarray(w) for w in model.get_weights()]

    one = run(strategy_for(0), False)
    two = run(strategy_for(2), True)
    assert _per_variable(two, one) <= TOLERANCE
    # The embedding's gradient reached the optimizer as IndexedSlices, all-reduced as such.
    assert seen and seen[0] is tf.IndexedSlices


@pytest.mark.full(
    "tests/training/test_checkpoint.py::"
    "test_crash_mid_epoch_resumes_from_the_last_step_checkpoint[mid-run]",
)
def test_a_checkpoint_of_a_prepared_loop_resumes_to_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    x, y = images(64)
    strategy = strategy_for(2)
    uninterrupted = tutorial_loop(strategy, _prepare, x, y, epochs=2)
    prefix = str(tmp_path / "ckpt")
    tutorial_loop(strategy, _prepare, x, y, epochs=1, checkpoint_to=prefix)
    resumed = _resume_tutorial(strategy, x, y, tf.train.latest_checkpoint(str(tmp_path)))
    assert _per_variable(resumed, uninterrupted) <= TOLERANCE


def _resume_tutorial(
    strategy: tf.distribute.Strategy, x: np.ndarray, y: np.ndarray, path: str | None
) -> list[np.ndarray]:
    """The tutorial's loop for one more epoch after restoring its checkpoint."""
    restored: dict[str, Any] = {}

    def prepare_and_restore(model: Any, optimizer: Any) -> None:
        tfscale.prepare_loop(model, optimizer)
        # The model has no Input: build it (and so the optimizer) before restoring, so the
        # checkpoint's values land at once rather than deferred into the first step.
        with strategy.scope():
            model.build((None, 12, 12, 1))
            optimizer.build(model.trainable_variables)
        status = tf.train.Checkpoint(optimizer=optimizer, model=model).restore(path)
        status.assert_existing_objects_matched()
        restored["iterations"] = int(optimizer.iterations.numpy())

    weights = tutorial_loop(strategy, prepare_and_restore, x, y, epochs=1)
    assert restored["iterations"] == 4
    return weights


@pytest.mark.parametrize("convention", ["reduce_mean", "model_compute_loss"])
def test_a_model_prepared_for_fit_gives_one_device_weights_in_a_custom_loop(
    convention: str,
) -> None:
    """tfscale.prepare's optimizer is the same distributed update: a custom loop over the
    prepared model weighs its loss (``tf.reduce_mean``, or the model's own ``compute_loss``,
    which tfscale wraps) as prepare_loop's does. The wrapped ``compute_loss`` was refused
    ("the output of a SelectV2 op": the wrapper's own zero for a replica without examples)."""
    x, y = DATA[0][:64], DATA[1][:64]

    def compile_and_prepare(model: Any, optimizer: Any) -> Any:
        if not model.compiled:
            model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        return tfscale.prepare(model)

    one, _ = convention_loop(strategy_for(0), None, x, y, convention)
    two, _ = convention_loop(strategy_for(2), compile_and_prepare, x, y, convention)
    assert _per_variable(two, one) <= TOLERANCE


def test_global_clipnorm_clips_the_all_reduced_gradient_as_one_device_clips_its_own() -> None:
    x, y = DATA[0][:64], DATA[1][:64]
    one, _ = convention_loop(strategy_for(0), None, x, y, "reduce_mean", clip=0.05)

    def clipped(model: Any, optimizer: Any) -> Any:
        return tfscale.prepare_loop(model, optimizer, global_clipnorm=0.05)

    two, _ = convention_loop(strategy_for(2), clipped, x, y, "reduce_mean")
    unclipped, _ = convention_loop(strategy_for(0), None, x, y, "reduce_mean")
    assert _per_variable(two, one) <= TOLERANCE
    assert _per_variable(unclipped, one) > 1e-3  # the clip changed the update


def test_a_non_finite_gradient_on_one_replica_skips_the_update_on_every_replica() -> None:
    x, y = DATA[0][:32].copy(), DATA[1][:32]
    x[20] = np.nan  # batch 2 of 16, replica 0's half only; batch 1 is finite
    before, _ = convention_loop(strategy_for(0), None, x[:16], y[:16], "reduce_mean", epochs=1)
    two, optimizer = convention_loop(strategy_for(2), _prepare, x, y, "reduce_mean", epochs=1)
    state = loop_state(optimizer)
    assert state is not None
    assert int(state.update.skipped.numpy()) == 1
    # The weights are those after the finite first batch, on both replicas.
    assert _per_variable(two, before) <= TOLERANCE
    assert all(np.isfinite(w).all() for w in two)


def test_the_weighting_of_each_kind_and_the_refusal_of_mixed_kinds() -> None:
    from tfscale.training.conventions import Kind, Term, weighting

    def numbers(terms: list[Term], replicas: int = 2, steps: int = 1) -> tuple[float, float]:
        found = weighting(terms, replicas, steps)
        return float(found.weight), float(found.count)

    count = tf.constant(8.0)
    assert numbers([Term(Kind.MEAN, count, "mean")]) == (8.0, 8.0)
    assert numbers([Term(Kind.SCALED_MEAN, count, "cal")]) == (16.0, 8.0)
    assert numbers([Term(Kind.SCALED_MEAN, None, "keras")]) == (2.0, 1.0)
    assert numbers([Term(Kind.SUM, None, "vector")], steps=2) == (1.0, 0.25)
    # The tutorial: compute_average_loss + scale_regularization_loss, both summed as they are.
    tutorial = [Term(Kind.SCALED_MEAN, count, "cal"), Term(Kind.GLOBAL, None, "reg")]
    assert numbers(tutorial) == (1.0, 0.5)
    with pytest.raises(tfscale.TrainingError, match="scaled differently"):
        weighting([Term(Kind.MEAN, count, "mean"), Term(Kind.SCALED_MEAN, None, "keras")], 2, 1)
    with pytest.raises(tfscale.TrainingError, match="cannot tell"):
        weighting([Term(Kind.MEAN, count, "mean"), Term(None, None, "a Mul op")], 2, 1)


def test_gradients_tfscale_did_not_see_computed_are_refused_unless_declared() -> None:
    strategy = strategy_for(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
    tfscale.prepare_loop(model, optimizer)

    def step() -> None:
        grads = [tf.ones_like(v) for v in model.trainable_variables]  # no tape.gradient
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    with pytest.raises(tfscale.TrainingError, match="did not see computed"):
        tf.function(lambda: strategy.run(step))()
    assert int(optimizer.iterations.numpy()) == 0
    before = model.trainable_variables[0].numpy()
    tfscale.prepare_loop(model, optimizer, loss="mean")  # the gradient is a mean: stated
    tf.function(lambda: strategy.run(step))()
    assert int(optimizer.iterations.numpy()) == 1
    # The mean of both replicas' gradient of ones is ones: one SGD step of 0.1, not 0.2.
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), before - 0.1, rtol=1e-6)


def test_a_gradient_the_loop_does_not_apply_is_no_error() -> None:
    # A gradient of the prepared model's variables taken for another purpose (a norm to
    # log) is not refused, whatever its loss: only an update with it would be wrong.
    strategy = strategy_for(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
    tfscale.prepare_loop(model, optimizer)

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x)) / 7.0  # a loss tfscale cannot tell
        return tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables))

    norms = tf.function(lambda x: strategy.run(step, args=(x,)))(tf.ones((4, 3)))
    assert float(strategy.experimental_local_results(norms)[0]) > 0.0
    assert int(optimizer.iterations.numpy()) == 0


def test_prepare_loop_refuses_what_it_cannot_use() -> None:
    strategy = strategy_for(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD()
    with pytest.raises(tfscale.TrainingError, match="Unknown loss convention"):
        tfscale.prepare_loop(model, optimizer, loss="mean_of_means")  # type: ignore[arg-type]
    with pytest.raises(tfscale.TrainingError, match="accumulation_steps"):
        tfscale.prepare_loop(model, optimizer, accumulation_steps=0)
    with pytest.raises(tfscale.TrainingError, match="needs the Keras optimizer"):
        tfscale.prepare_loop(model)  # not compiled: no optimizer of its own


def test_an_optimizer_prepared_for_another_strategy_is_refused_at_its_first_apply() -> None:
    """A loop prepared for one strategy and run by another (``prepare_loop`` without the
    strategy, for a model made outside any scope, gets ``choose_strategy()``'s own): a
    TrainingError naming both and the fix, not TensorFlow's bare AssertionError."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    tfscale.prepare_loop(model, optimizer, strategy_for(1))
    before = model.get_weights()
    strategy = strategy_for(2)

    def step(x: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x)), axis=-1)  # a per-example vector
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    @tf.function
    def run(x: Any) -> None:
        strategy.run(step, args=(x,))

    data = tf.data.Dataset.from_tensor_slices(np.ones((8, 4), "float32")).batch(8)
    with pytest.raises(tfscale.TrainingError, match="prepared for another strategy") as info:
        for x in strategy.experimental_distribute_dataset(data):
            run(x)
    assert "tfscale.prepare_loop(model, optimizer, strategy)" in str(info.value)
    assert relative_difference(model.get_weights(), before) == 0.0


def _clipping_loop(strategy: Any, clip: str | None, prepare: bool, **options: Any) -> Any:
    """A loop that clips the gradient in the replica's step (``clip``: the tf function), or
    leaves clipping to the optimizer's ``global_clipnorm`` (``clip`` None)."""
    x, y = DATA
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(0.5, global_clipnorm=None if clip else 0.5)
    if prepare:
        tfscale.prepare_loop(model, optimizer, strategy, **options)
    loss_of = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def step(xb: Any, yb: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_of(yb, model(xb)), global_batch_size=32)
        grads = tape.gradient(loss, model.trainable_variables)
        if clip == "clip_by_global_norm":
            grads, _ = tf.clip_by_global_norm(grads, 0.5)
        elif clip == "clip_by_value":
            grads = [tf.clip_by_value(g, -0.05, 0.05) for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:128], y[:128])).batch(32)
    )
    run = tf.function(lambda xb, yb: strategy.run(step, args=(xb, yb)))
    for xb, yb in data:
        run(xb, yb)
    return model.get_weights(), optimizer


@pytest.mark.parametrize(
    "clip",
    tiered(
        ["clip_by_global_norm", "clip_by_value"],
        {"clip_by_value": "clip_by_global_norm"},
        f"{_T}test_a_gradient_clipped_in_each_replica_is_refused_and_the_optimizers_clip_is_exact",
    ),
)
def test_a_gradient_clipped_in_each_replica_is_refused_and_the_optimizers_clip_is_exact(
    clip: str,
) -> None:
    """Clipping each replica's share and then summing is not clipping the sum: unprepared,
    the loop's weights are silently not one device's. Prepared, the clip is refused by name
    before any update, and the optimizer's own global_clipnorm gives one device's weights."""
    one, _ = _clipping_loop(strategy_for(0), clip, prepare=False)
    unprepared, _ = _clipping_loop(strategy_for(2), clip, prepare=False)
    assert _per_variable(unprepared, one) > 1e-3  # the silent difference
    with pytest.raises(tfscale.TrainingError, match=f"tf.{clip}") as info:
        _clipping_loop(strategy_for(2), clip, prepare=True)
    assert "global_clipnorm=1.0" in str(info.value)
    expected, _ = _clipping_loop(strategy_for(0), None, prepare=False)
    got, optimizer = _clipping_loop(strategy_for(2), None, prepare=True)
    assert _per_variable(got, expected) <= TOLERANCE
    assert int(optimizer.iterations.numpy()) == 4


class _Penalty(keras.layers.Layer):  # type: ignore[misc]
    def call(self, inputs: Any) -> Any:
        self.add_loss(0.5 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def _penalized_batchnorm(synchronized: bool) -> keras.Model:
    keras.utils.set_random_seed(2)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, use_bias=False),
            _Penalty(),
            keras.layers.BatchNormalization(synchronized=synchronized),
            _Penalty(),
            keras.layers.Dense(1),
        ]
    )


def _penalized_loop() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """TensorFlow's tutorial loop (``compute_average_loss`` and
    ``scale_regularization_loss`` of the model's added losses) over a model with a penalty
    before and after a synchronized BatchNormalization, prepared; and one device's loop."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    batch = 16
    reference, optimizer = _penalized_batchnorm(False), keras.optimizers.SGD(0.1)
    for start in range(0, len(x), batch):
        with tf.GradientTape() as tape:
            predicted = reference(x[start : start + batch], training=True)
            loss = tf.reduce_mean(tf.square(y[start : start + batch] - predicted))
            loss += tf.add_n(reference.losses)
        variables = reference.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))

    strategy = strategy_for(2)
    with strategy.scope():
        model, optimizer = _penalized_batchnorm(True), keras.optimizers.SGD(0.1)
    tfscale.prepare_loop(model, optimizer, strategy=strategy)

    def replica_step(x: Any, y: Any) -> None:
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(y - model(x, training=True)), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))

    @tf.function
    def step(x: Any, y: Any) -> None:
        strategy.run(replica_step, args=(x, y))

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    for x_batch, y_batch in strategy.experimental_distribute_dataset(dataset):
        step(x_batch, y_batch)
    return model.get_weights(), reference.get_weights()


def test_added_losses_stay_each_replicas_own_in_a_prepared_loop() -> None:
    """The replica threads of the user's ``strategy.run`` share each layer's added losses:
    the synchronized BatchNormalization's all-reduce lets one replica clear the penalty the
    other added before it, whose gradient is then lost (2e-2 from one device's weights,
    under TensorFlow alone too: not asserted here, where other tests' prepared loops may
    still be alive). While a prepared loop lives each thread keeps its own."""
    got, want = _penalized_loop()
    assert _per_variable(got, want) <= TOLERANCE
