"""Pipeline and placement equal the unsplit model: outputs, gradients, training."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.parallel.pipeline import PipelineModel
from tfscale.testing import graphs_left_alive, mirrored_on_cpus, relative_difference

pytestmark = pytest.mark.tf

TOL = 1e-5
BATCH = 16


def build(seed: int = 7) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(12, activation="tanh"),
            keras.layers.Dense(12),
            keras.layers.LayerNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def data(seed: int, n: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((n, 6)).astype("float32"),
        rng.standard_normal((n, 3)).astype("float32"),
    )


def outputs_and_grads(model: keras.Model, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    @tf.function
    def run(x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.reduce_mean(tf.square(out - y))
        grads = tape.gradient(loss, model.trainable_variables)
        return [out, *(tf.convert_to_tensor(g) for g in grads)]  # Embedding: IndexedSlices

    return [t.numpy() for t in run(tf.constant(x), tf.constant(y))]


@pytest.mark.parametrize(
    ("stages", "micro", "remat"),
    [(2, 1, False), (2, 4, False), (2, 8, True), (4, 1, True), (4, 4, False), (4, 8, False)],
)
def test_outputs_and_gradients_equal_the_unsplit_model(
    cpu_devices: list[str], stages: int, micro: int, remat: bool
) -> None:
    model = build()
    x, y = data(seed=10 * stages + micro)
    reference = outputs_and_grads(model, x, y)
    piped = tfscale.pipeline(model, cpu_devices[:stages], microbatches=micro, remat=remat)
    assert isinstance(piped, PipelineModel) and piped.plan is not None
    assert piped.plan.n_stages == stages and piped.schedule.n_micro == micro
    got = outputs_and_grads(piped, x, y)
    assert relative_difference(got, reference) <= TOL
    # Eager calls (no tf.function) give the same.
    eager = piped(tf.constant(x)).numpy()
    assert relative_difference(eager, model(tf.constant(x)).numpy()) <= TOL


def test_pipeline_shares_the_original_weights(cpu_devices: list[str]) -> None:
    model = build()
    piped = tfscale.pipeline(model, cpu_devices[:2], microbatches=2)
    assert [id(v) for v in piped.trainable_variables] == [id(v) for v in model.trainable_variables]


@pytest.mark.full(
    "tests/parallel/test_pipeline.py::test_keras_fit_gives_the_same_weights",
)
def test_gradient_tape_training_gives_the_same_weights(cpu_devices: list[str]) -> None:
    def train(model: keras.Model) -> list[np.ndarray]:
        optimizer = keras.optimizers.Adam(0.01)

        @tf.function
        def step(x: tf.Tensor, y: tf.Tensor) -> None:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)

        for seed in range(3):
            x, y = data(seed=100 + seed)
            step(tf.constant(x), tf.constant(y))
        return [w.numpy() for w in model.trainable_variables]

    reference = train(build())
    piped = tfscale.pipeline(build(), cpu_devices[:4], microbatches=8, remat=True)
    assert relative_difference(train(piped), reference) <= TOL


def test_keras_fit_gives_the_same_weights(cpu_devices: list[str]) -> None:
    x, y = data(seed=5, n=4 * BATCH)
    reference = build()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    model = build()
    piped = tfscale.pipeline(model, cpu_devices[:2], microbatches=4)
    piped.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    piped.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert relative_difference(model.get_weights(), reference.get_weights()) <= TOL


def test_place_equals_unsplit_and_runs_each_stage_forward_and_backward_on_its_device(
    cpu_devices: list[str],
) -> None:
    model = build()
    plan = tfscale.plan_partition(model, 3, [1, 3, 2])  # a Dense layer in each
    placed = tfscale.place(model, plan, cpu_devices[1:4])
    x, y = data(seed=3)
    assert (
        relative_difference(outputs_and_grads(placed, x, y), outputs_and_grads(model, x, y)) <= TOL
    )

    @tf.function
    def step(x: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(placed(x, training=True))
        return tape.gradient(loss, placed.trainable_variables)  # type: ignore[no-any-return]

    graph = step.get_concrete_function(tf.TensorSpec([BATCH, 6])).graph
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    # 4 Dense layers: 4 forward matmuls and, for each, dW and dx in the backward pass
    # (dx of the first layer is pruned later); every one is pinned to a stage device.
    assert len(matmuls) >= 4 * 2
    assert {op.device for op in matmuls} == set(cpu_devices[1:4])
    copies = [op for op in graph.get_operations() if op.type == "Identity" and op.device]
    assert {op.device for op in copies} >= set(cpu_devices[1:4])


def test_microbatches_that_do_not_divide_the_batch_are_a_clear_error(
    cpu_devices: list[str],
) -> None:
    piped = tfscale.pipeline(build(), cpu_devices[:2], microbatches=4)
    with pytest.raises(tfscale.PartitionError) as info:
        piped(tf.constant(data(seed=1, n=10)[0]))
    message = str(info.value)
    assert "microbatches=4 does not divide the batch of 10" in message
    assert "[1, 2, 5, 10]" in message
    with pytest.raises(tfscale.PartitionError, match="positive integer"):
        tfscale.pipeline(build(), cpu_devices[:2], microbatches=0)


def test_devices_default_to_logical_cpus_and_unknown_devices_are_refused(
    cpu_devices: list[str],
) -> None:
    piped = tfscale.pipeline(build(), microbatches=2)
    assert isinstance(piped, PipelineModel)
    assert [d.rsplit("/", 1)[-1] for d in piped.stage_devices] == [
        d.rsplit("/", 1)[-1] for d in cpu_devices
    ]
    with pytest.raises(tfscale.PartitionError, match="devices not present: /device:GPU:7"):
        tfscale.pipeline(build(), ["/device:CPU:0", "/device:GPU:7"], microbatches=2)
    with pytest.raises(tfscale.PartitionError, match="listed twice: /device:CPU:1"):
        tfscale.pipeline(build(), ["CPU:1", "/device:CPU:1"], microbatches=2)


def test_place_refuses_a_plan_for_another_model(cpu_devices: list[str]) -> None:
    plan = tfscale.plan_partition(build(), 2)
    with pytest.raises(tfscale.PartitionError, match="made for another model"):
        tfscale.place(build(), plan, cpu_devices[:2])


def test_weights_move_to_their_stage_device_and_stay_shared(cpu_devices: list[str]) -> None:
    model = build()
    x, y = data(seed=8)
    before = model.get_weights()
    piped = tfscale.pipeline(model, cpu_devices[2:4], microbatches=2, balance=[3, 3])
    assert isinstance(piped, PipelineModel)
    for index, device in enumerate(piped.stage_devices):
        for layer in piped.stage_layers(index):
            for weight in layer.weights:
                assert weight.value.device.endswith(device.rsplit("/", 1)[-1])
    assert relative_difference(model.get_weights(), before) == 0.0
    piped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    piped.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert relative_difference(model.get_weights(), piped.get_weights()) == 0.0
    assert relative_difference(model.get_weights(), before) > 1e-3


@pytest.mark.full(
    "tests/parallel/test_pipeline.py::test_keras_fit_gives_the_same_weights",
    "tests/parallel/test_pipeline.py::"
    "test_a_tfscale_fit_of_a_pipeline_leaves_nothing_it_traced_alive",
)
def test_tfscale_fit_trains_the_pipeline_to_the_unsplit_weights(cpu_devices: list[str]) -> None:
    x, y = data(seed=21, n=4 * BATCH)
    reference = build()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    tfscale.fit(
        reference,
        x,
        y,
        epochs=2,
        batch_size=BATCH,
        strategy=tf.distribute.get_strategy(),
        verbose=0,
    )
    model = build()
    piped = tfscale.pipeline(model, cpu_devices[:4], microbatches=8, remat=True)
    piped.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    # No strategy given: the pipelined model's own (the default) is used, not a Mirrored one.
    history = tfscale.fit(piped, x, y, epochs=2, batch_size=BATCH, verbose=0)
    assert len(history.history["loss"]) == 2
    assert relative_difference(model.get_weights(), reference.get_weights()) <= TOL


def test_a_tfscale_fit_of_a_pipeline_leaves_nothing_it_traced_alive(
    cpu_devices: list[str],
) -> None:
    """Each stage is a ``tf.custom_gradient``, whose gradient function TensorFlow keeps in its
    process-wide registry, holding the traced step for the life of the process
    (tensorflow/tensorflow#97697): tfscale.fit releases them once its step is traced
    (``internals.gradient_functions_released``); Keras's symbolic build of the pipelined
    model (its ``scratch_graph``s) runs the stages without one."""
    x, y = data(seed=3, n=2 * BATCH)

    def fit() -> None:
        piped = tfscale.pipeline(build(), cpu_devices[:2], microbatches=2)
        piped.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        tfscale.fit(piped, x, y, epochs=1, batch_size=BATCH, verbose=0)

    traced, alive = graphs_left_alive(fit)
    assert any("multi_step" in name for name in traced), traced
    assert not alive, f"graphs of a finished fit still alive: {alive}"


def test_a_replicating_strategy_is_refused(cpu_devices: list[str]) -> None:
    piped = tfscale.pipeline(build(), cpu_devices[:2], microbatches=2)
    strategy = mirrored_on_cpus(2)
    with pytest.raises(tfscale.PartitionError, match="cannot also be replicated"):
        strategy.run(piped, args=(tf.constant(data(seed=2)[0]),))


def test_tfscale_fit_refuses_what_the_pipeline_cannot_run_before_training(
    cpu_devices: list[str],
) -> None:
    x, y = data(seed=3, n=90)
    piped = tfscale.pipeline(build(), cpu_devices[:2], microbatches=4)
    piped.compile(optimizer="sgd", loss="mse")
    before = piped.get_weights()
    with pytest.raises(tfscale.PartitionError, match="batch of 30 examples"):
        tfscale.fit(piped, x, y, batch_size=30, verbose=0)
    with pytest.raises(tfscale.PartitionError, match="last batch of an epoch holds 26"):
        tfscale.fit(piped, x, y, batch_size=32, verbose=0)  # 32, 32, then 26
    with pytest.raises(tfscale.PartitionError, match="last batch of an epoch holds 2 "):
        tfscale.fit(piped, x[:64], y[:64], batch_size=32, validation_data=(x[:34], y[:34]))
    with pytest.raises(tfscale.PartitionError, match="cannot also be replicated"):
        tfscale.fit(piped, x[:64], y[:64], batch_size=32, strategy=mirrored_on_cpus(2))
    assert int(piped.optimizer.iterations.numpy()) == 0
    assert relative_difference(piped.get_weights(), before) == 0.0


def test_remat_with_a_random_layer_warns(cpu_devices: list[str]) -> None:
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dropout(0.5, name="drop")]
    )
    with pytest.warns(tfscale.TfscaleWarning, match="'drop'"):
        tfscale.pipeline(model, cpu_devices[:2], microbatches=2, remat=True)


def test_a_batch_known_only_at_run_time_is_checked_before_the_split(
    cpu_devices: list[str],
) -> None:
    piped = tfscale.pipeline(build(), cpu_devices[:2], microbatches=4)
    forward = tf.function(piped, input_signature=[tf.TensorSpec([None, 6])])
    assert forward(tf.constant(data(seed=1, n=8)[0])).shape == (8, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not divide") as info:
        forward(tf.constant(data(seed=1, n=10)[0]))
    assert "Batch size of this step:" in str(info.value) and "[10]" in str(info.value)


def test_stage_s_on_micro_m_does_not_wait_for_stage_s_minus_1_on_later_micro_batches(
    cpu_devices: list[str],
) -> None:
    """The graph lets the executor overlap stages: no data or control path forbids it."""
    piped = tfscale.pipeline(build(), cpu_devices[:2], microbatches=4)
    forward = tf.function(lambda x: piped(x, training=True))
    graph = forward.get_concrete_function(tf.TensorSpec([BATCH, 6])).graph

    def ancestors(op: tf.Operation) -> set[str]:
        seen: set[str] = set()
        todo = [op]
        while todo:
            current = todo.pop()
            for parent in [t.op for t in current.inputs] + list(current.control_inputs):
                if parent.name not in seen:
                    seen.add(parent.name)
                    todo.append(parent)
        return seen

    for micro in range(3):
        ops = [op for op in graph.get_operations() if f"stage1_micro{micro}/" in op.name]
        assert ops
        upstream = set().union(*(ancestors(op) for op in ops))
        assert any(f"stage0_micro{micro}/" in name for name in upstream)
        for later in range(micro + 1, 4):
            assert not any(f"stage0_micro{later}/" in name for name in upstream)


def test_functional_chain_with_integer_ids_equals_the_unsplit_model(
    cpu_devices: list[str],
) -> None:
    keras.utils.set_random_seed(4)
    ids = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 4)(ids)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(6, activation="tanh")(h)
    model = keras.Model(ids, keras.layers.Dense(3)(h))
    rng = np.random.default_rng(6)
    x = rng.integers(0, 20, size=(BATCH, 5)).astype("int32")
    y = rng.standard_normal((BATCH, 3)).astype("float32")
    reference = outputs_and_grads(model, x, y)
    piped = tfscale.pipeline(model, cpu_devices[:2], microbatches=4, balance=[2, 2])
    assert relative_difference(outputs_and_grads(piped, x, y), reference) <= TOL
