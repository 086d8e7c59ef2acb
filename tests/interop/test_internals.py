"""One test per private Keras/TensorFlow name tfscale uses (``tfscale.interop.internals``).

Each test runs its accessor on real Keras/TensorFlow objects. When an upgrade removes or
renames the name, the test fails saying which name, which accessor and which tfscale code
needs a new way to do it, so that an upgrade is a one-file job. A scan checks that nothing
outside ``interop/internals.py`` reaches a private name.
"""

from __future__ import annotations

import ast
import gc
import threading
import weakref
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale.interop import internals, registry
from tfscale.testing import mirrored_on_cpus

pytestmark = pytest.mark.tf

_SRC = Path(__file__).resolve().parents[2] / "src" / "tfscale"


def _require(owner: Any, name: str, accessor: str, used_by: str) -> None:
    """Fails clearly when ``owner`` (an object or a class) no longer has ``name``."""
    if not hasattr(owner, name):
        pytest.fail(
            f"{type(owner).__name__ if not isinstance(owner, type) else owner.__name__}.{name} "
            f"is gone (Keras {keras.__version__}, TensorFlow {tf.__version__}): "
            f"tfscale.interop.internals.{accessor} needs another way; {used_by} depends on it."
        )


def _functional() -> keras.Model:
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))


# -- Keras models -------------------------------------------------------------------------------
def test_model_strategy_and_set_model_strategy() -> None:
    strategy = mirrored_on_cpus(2)
    with strategy.scope():
        inside = _functional()
    outside = _functional()
    _require(inside, "_distribute_strategy", "model_strategy", "scope.check_scope")
    assert internals.model_strategy(inside) is strategy
    assert internals.model_strategy(outside) is None
    default = tf.distribute.get_strategy()
    internals.set_model_strategy(inside, default)
    assert inside.distribute_strategy is default  # what Keras's fit then uses


def test_symbolic_build() -> None:
    model = _functional()
    model.compile(optimizer="adam", loss="mse")
    _require(model, "_symbolic_build", "symbolic_build", "benchmarks/step_vs_keras.py")
    internals.symbolic_build(model, (np.zeros((2, 4), "float32"), np.zeros((2, 2), "float32")))
    assert model.optimizer.built and model.built


def test_compile_config_objects() -> None:
    model = _functional()
    loss = keras.losses.MeanSquaredError()
    model.compile(optimizer="sgd", loss=loss)
    _require(model, "_compile_config", "compile_config_objects", "scope.fix_scope")
    stored = internals.compile_config_objects(model)
    assert stored is not None and stored["loss"] is loss, stored
    assert internals.compile_config_objects(_functional()) is None


def test_functional_graph_accessors() -> None:
    model = _functional()
    hidden, out = model.get_layer("hidden"), model.get_layer("out")
    _require(model, "_nodes", "functional_nodes", "parallel.partition (pipeline stages)")
    _require(out, "_inbound_nodes", "inbound_nodes", "parallel.partition")
    nodes = internals.functional_nodes(model)
    (node,) = internals.inbound_nodes(out)
    assert internals.node_key(out, 0) in nodes, (
        "Keras no longer keys a model's nodes as f'{id(op)}_ib-{index}': "
        "tfscale.interop.internals.node_key needs the new format (parallel.partition)"
    )
    (tensor,) = node.input_tensors
    _require(tensor, "_keras_history", "tensor_producer", "parallel.partition")
    assert internals.tensor_producer(tensor) is hidden
    assert internals.functional_nodes(keras.layers.Dense(2)) is None


# -- Keras variables ----------------------------------------------------------------------------
def test_backing_variable_and_reinitialize_variable() -> None:
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    kernel = layer.kernel
    _require(kernel, "_value", "backing_variable", "parallel.placement.move_weights")
    _require(kernel, "_initialize", "reinitialize_variable", "parallel.placement.move_weights")
    before = internals.backing_variable(kernel)
    assert isinstance(before, tf.Variable)
    with tf.device("/device:CPU:1"):
        internals.reinitialize_variable(kernel, tf.identity(before))
    after = internals.backing_variable(kernel)
    assert after is not before and after.device.endswith("CPU:1")
    np.testing.assert_array_equal(after.numpy(), before.numpy())


# -- TensorFlow: tf.distribute ------------------------------------------------------------------
def test_default_strategy_class_name() -> None:
    name = type(tf.distribute.get_strategy()).__name__
    assert name == internals.DEFAULT_STRATEGY_CLASS, (
        f"TensorFlow's default strategy is now {name!r}: update "
        "tfscale.interop.internals.DEFAULT_STRATEGY_CLASS (doctor --script tells it from the "
        "user's)"
    )


def test_variable_strategy() -> None:
    strategy = mirrored_on_cpus(2)
    with strategy.scope():
        inside = tf.Variable(1.0)
    outside = tf.Variable(1.0)
    _require(inside, "_distribute_strategy", "variable_strategy", "scope.check_scope")
    assert internals.variable_strategy(inside) is strategy
    assert internals.variable_strategy(outside) is None


def test_cross_device_ops() -> None:
    strategy = mirrored_on_cpus(2)
    _require(strategy.extended, "_cross_device_ops", "cross_device_ops", "profiling.collectives")
    assert isinstance(internals.cross_device_ops(strategy), tf.distribute.ReductionToOneDevice)


# -- TensorFlow: the eager context --------------------------------------------------------------
def test_eager_context_accessors() -> None:
    ctx = internals.eager_context()
    for name, accessor in (
        ("_context_handle", "context_started"),
        ("_initialized", "context_initialized"),
        ("_collective_ops_server_def", "forget_collective_setup"),
        ("_coordination_service_config", "forget_collective_setup"),
    ):
        _require(ctx, name, accessor, "strategy.build (worker start-up deadline, fallback)")
    tf.constant(1.0)  # the test session's runtime has started
    assert internals.context_started(ctx) and internals.context_initialized(ctx)
    assert hasattr(ctx, "configure_coordination_service")


def test_forget_collective_setup_clears_a_stand_in_context() -> None:
    class _Context:  # the real one is in use by this test session: never clear it
        _collective_ops_server_def = object()
        _coordination_service_config = object()

    ctx = _Context()
    internals.forget_collective_setup(ctx)
    assert ctx._collective_ops_server_def is None and ctx._coordination_service_config is None


def test_coordination_config_pb2() -> None:
    module = internals.coordination_config_pb2()
    job = module.CoordinatedJob(name="worker", num_tasks=2)
    assert (job.name, job.num_tasks) == ("worker", 2)


# -- TensorFlow: tf.data, profiler, cluster resolvers -------------------------------------------
def test_dataset_batch_size() -> None:
    batched = tf.data.Dataset.range(10).batch(4)
    _require(batched, "_batch_size", "dataset_batch_size", "profiling.script (profile)")
    assert int(internals.dataset_batch_size(batched)) == 4
    assert internals.dataset_batch_size(tf.data.Dataset.range(3)) is None


def test_tf_function_class() -> None:
    assert isinstance(tf.function(lambda: 1), internals.tf_function_class())
    assert callable(internals.tf_function_class().__call__)


def test_distributed_input_methods_and_strategy() -> None:
    """Each method exists where tfscale.training.turns wraps it, and a distributed dataset,
    its iterator and the input of distribute_datasets_from_function name their strategy."""
    for owner, name in internals.distributed_input_methods():
        _require(owner, name, "distributed_input_methods", "training.turns (prepare_loop)")
        assert name in vars(owner), f"{owner.__name__}.{name} is inherited: wrap its owner"
    strategy = mirrored_on_cpus(2)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(2))
    from_function = strategy.distribute_datasets_from_function(
        lambda _: tf.data.Dataset.range(4).batch(1)
    )
    iterator = iter(dataset)
    classes = {owner for owner, _ in internals.distributed_input_methods()}
    for value in (dataset, from_function, iterator):
        _require(value, "_strategy", "distributed_input_strategy", "training.turns")
        assert internals.distributed_input_strategy(value) is strategy
        assert any(isinstance(value, owner) for owner in classes)
    assert internals.distributed_input_strategy(tf.data.Dataset.range(2)) is None


def test_xplane_pb2() -> None:
    space = internals.xplane_pb2().XSpace()
    plane = space.planes.add(name="/device:CPU:0")
    assert space.planes[0].name == plane.name


def test_slurm_cluster_resolver_module() -> None:
    module = internals.slurm_cluster_resolver_module()
    assert module.expand_hostlist("n[1-2]") == ["n1", "n2"]


# -- the training package's names --------------------------------------------------------------
def test_replace_and_restore_set_an_attribute_on_one_instance() -> None:
    first, second = _functional(), _functional()
    registry.replace("compiled-functions", first, "predict_function", "replaced")
    assert first.predict_function == "replaced" and second.predict_function is None
    registry.restore("compiled-functions", first, "predict_function")
    assert "predict_function" not in vars(first)
    layer = keras.layers.Dense(2)
    registry.replace("remat-call", layer, "call", lambda *args, **kwargs: "replaced")
    assert layer.call(None) == "replaced"
    registry.restore("remat-call", layer, "call")
    assert "call" not in vars(layer) and layer(np.ones((1, 3), "float32")).shape == (1, 2)


def test_a_models_own_fit_reaches_the_prepared_classs_fit_below_it() -> None:
    """KerasHub's task models call ``super().fit(...)`` from their own ``fit``; the prepared
    class puts ``modelclass.Below.fit`` right above Keras's model class, where that lands."""
    from tfscale.training import modelclass

    class OwnFit(keras.Model):  # type: ignore[misc]
        def fit(self, *args: Any, **kwargs: Any) -> Any:
            return super().fit(*args, **kwargs)

    for cls in (OwnFit, type(_functional()), keras.Sequential, keras.Model):
        mro = modelclass.prepared_class(cls).__mro__
        assert mro.index(modelclass.Below) + 1 == mro.index(keras.Model), mro
    assert "fit" not in vars(keras.Model), _broken(
        "fit", "keras.Model defines fit itself", "training.modelclass.Below (where fit is reached)"
    )


def test_autocast_scope_is_read_and_entered() -> None:
    # training.layercalls (remat under a mixed policy) reads and re-enters Keras's scope.
    assert internals.autocast_dtype() is None
    variable = keras.Variable(np.ones(2, "float32"))
    with internals.autocast("bfloat16"):
        assert internals.autocast_dtype() == "bfloat16"
        assert keras.ops.convert_to_tensor(variable).dtype == "bfloat16"
    assert internals.autocast_dtype() is None


def test_flatten_layers() -> None:
    model = _functional()
    _require(model, "_flatten_layers", "flatten_layers", "training.layercalls, precision")
    names = [layer.name for layer in internals.flatten_layers(model, include_self=False)]
    assert "hidden" in names and "out" in names and model.name not in names


def test_seed_generators() -> None:
    dropout = keras.layers.Dropout(0.5)
    _require(dropout, "_seed_generators", "seed_generators", "training.randomness")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dropout(0.1)(dropout(inputs)))
    model.own = keras.random.SeedGenerator(3)  # a GAN's, on the model itself
    found = internals.seed_generators(model)
    assert len(found) == 3 and any(g is model.own for g in found)
    assert all(isinstance(g, keras.random.SeedGenerator) for g in found)
    assert any(g is dropout.seed_generator for g in found)


def test_tensorflow_trainer_class_is_the_base_of_keras_model() -> None:
    trainer = internals.tensorflow_trainer_class()
    assert trainer.__module__ == "keras.src.backend.tensorflow.trainer", trainer
    assert trainer in keras.Model.__mro__, (trainer, keras.Model.__mro__)
    for name in ("train_step", "test_step", "compute_loss", "get_metrics_result"):
        _require(trainer, name, "tensorflow_trainer_class", "internals.uses_default_step")


def test_uses_default_step() -> None:
    class Custom(keras.Model):
        def train_step(self, data: Any) -> Any:
            return super().train_step(data)

    assert internals.uses_default_step(_functional(), "train_step")
    assert not internals.uses_default_step(Custom(), "train_step")


def test_reduce_per_replica() -> None:
    strategy = mirrored_on_cpus(2)
    values = strategy.run(
        lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
    )
    assert float(internals.reduce_per_replica(values, strategy)) == 0.5  # the mean of 0 and 1


def test_array_input_and_validation_split() -> None:
    x, y = np.arange(10.0).reshape(10, 1), np.arange(10)
    assert internals.is_array_input(x, y, None)
    assert not internals.is_array_input(tf.data.Dataset.range(3), None, None)
    (train_x, _, _), (_, held_y, _) = internals.train_validation_split((x, y, None), 0.2)
    assert len(train_x) == 8 and list(held_y) == [8, 9]  # the last part validates


def test_lists_to_tuples() -> None:
    assert internals.lists_to_tuples(([1, [2, 3]], {"a": [4]})) == ((1, (2, 3)), {"a": (4,)})


def test_epoch_iterator_dataset_and_per_replica_specs() -> None:
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    strategy = mirrored_on_cpus(2)
    iterator = TFEpochIterator(
        x=np.zeros((8, 3), "float32"), batch_size=4, distribute_strategy=strategy
    )
    _require(iterator, "_distributed_dataset", "epoch_iterator_dataset", "training.prepare")
    spec = internals.epoch_iterator_dataset(iterator).element_spec
    components = internals.per_replica_component_specs(tf.nest.flatten(spec)[0])
    assert components is not None and len(components) == 2
    assert internals.per_replica_component_specs(tf.TensorSpec([2])) is None


def test_watch_epoch_iterators_hands_over_each_iterator_keras_makes() -> None:
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    strategy = mirrored_on_cpus(2)
    data = tf.data.Dataset.from_tensor_slices(np.zeros((8, 3), "float32")).batch(4)
    epochs = TFEpochIterator(x=data, distribute_strategy=strategy)
    _require(epochs, "_get_iterator", "watch_epoch_iterators", "training.data.FitInputs")
    made: list[Any] = []
    internals.watch_epoch_iterators(epochs, made.append)
    for _ in range(2):  # an epoch each, as fit and evaluate run it
        before = len(made)
        epochs.reset()
        steps = [step[-1] for step in epochs]  # (step, iterator); Keras 3.12: (begin, end, ...)
        # This epoch's iterator was handed over as it was made (Keras may make a spare).
        assert len(steps) == 2 and len(made) > before
        assert all(any(step is new for new in made[before:]) for step in steps)
    # No reference cycle: the epoch iterator is freed with its last reference.
    watched = weakref.ref(epochs)
    del epochs, steps
    assert watched() is None
    made.clear()


def test_forget_learned_epoch_length_only_for_unknown_lengths() -> None:
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    strategy = mirrored_on_cpus(2)
    data = tf.data.Dataset.from_tensor_slices(np.zeros((8, 3), "float32")).batch(4)
    unknown = TFEpochIterator(x=data.filter(lambda _: True), distribute_strategy=strategy)
    _require(unknown, "_num_batches", "forget_learned_epoch_length", "training.checkpoint")
    unknown._num_batches = 1  # as Keras learns it from a short (resumed) epoch
    internals.forget_learned_epoch_length(unknown)
    assert unknown.num_batches is None
    known = TFEpochIterator(x=data, distribute_strategy=strategy)
    internals.forget_learned_epoch_length(known)
    assert known.num_batches == 2


def test_set_initial_epoch() -> None:
    model = _functional()
    _require(model, "_initial_epoch", "set_initial_epoch", "training.checkpoint")
    internals.set_initial_epoch(model, 3)
    assert model._initial_epoch == 3


def test_optimizer_accessors() -> None:
    strategy = mirrored_on_cpus(2)
    optimizer = keras.optimizers.SGD(0.1)
    variables = [keras.Variable(np.ones(2, "float32"))]
    optimizer.build(variables)
    _require(optimizer, "_distribution_strategy", "set_optimizer_strategy", "training.adopt")
    _require(optimizer, "_trainable_variables", "optimizer_trainable_variables", "training")
    _require(optimizer, "_all_reduce_sum_gradients", "disable_builtin_all_reduce", "training")
    internals.set_optimizer_strategy(optimizer, strategy)
    assert optimizer._distribution_strategy is strategy
    assert internals.optimizer_trainable_variables(optimizer) == variables
    internals.disable_builtin_all_reduce(optimizer)
    assert optimizer._all_reduce_sum_gradients([(1, 2)]) == [(1, 2)]
    assert internals.distributed_container(variables[0]) is variables[0].value


def test_optimizer_variable_key_and_rekey_optimizer() -> None:
    kernel, bias = keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(2, "float32"))
    optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_list=[bias])
    optimizer.build([kernel, bias])
    _require(optimizer, "_var_key", "optimizer_variable_key", "training.adopt")
    _require(optimizer, "_trainable_variables_indices", "rekey_optimizer", "training.adopt")
    _require(optimizer, "_exclude_from_weight_decay", "rekey_optimizer", "training.adopt")
    old = [internals.optimizer_variable_key(optimizer, v) for v in (kernel, bias)]
    for variable in (kernel, bias):
        internals.reinitialize_variable(variable, variable.numpy())
    new = [internals.optimizer_variable_key(optimizer, v) for v in (kernel, bias)]
    assert set(old).isdisjoint(new)  # the key names the tf.Variable, which was re-created
    with pytest.raises(ValueError, match="Unknown variable"):
        optimizer.apply([tf.ones(2), tf.ones(2)], [kernel, bias])
    internals.rekey_optimizer(optimizer, dict(zip(old, new, strict=True)))
    optimizer.apply([tf.ones(2), tf.ones(2)], [kernel, bias])
    assert optimizer._use_weight_decay(kernel) and not optimizer._use_weight_decay(bias)
    assert int(optimizer.iterations.numpy()) == 1


def test_a_multi_optimizer_is_built_through_the_instance_build_and_asks_its_map() -> None:
    """training.adopt gives the optimizers a MultiOptimizer's function chooses the strategy,
    in an instance ``build`` that asks the map first (``optimizers_chosen``)."""
    if not hasattr(keras.optimizers, "MultiOptimizer"):
        pytest.skip(f"no MultiOptimizer before Keras 3.15 (this is {keras.__version__})")
    adam, sgd = keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1)
    multi = keras.optimizers.MultiOptimizer(lambda v: adam if "hidden" in v.path else sgd)
    _require(multi, "_optimizer_map", "optimizers_chosen", "training.adopt")
    model = _functional()
    assert internals.optimizers_chosen(multi, model.trainable_variables) == [adam] * 2 + [sgd] * 2
    assert internals.optimizers_chosen(sgd, model.trainable_variables) == []
    built: list[int] = []

    def build(var_list: Any) -> None:
        built.append(len(var_list))
        type(multi).build(multi, var_list)

    registry.replace("multi-optimizer-build", multi, "build", build)
    # Wrapped in a LossScaleOptimizer: Keras's build reaches it through the wrapper's.
    model.compile(keras.optimizers.LossScaleOptimizer(multi), "mse")
    model.fit(np.ones((4, 4), "float32"), np.ones((4, 2), "float32"), verbose=0)
    assert built == [4] and multi.optimizers == [adam, sgd]


def test_builtin_all_reduce_replaced_spares_prepared_optimizers() -> None:
    plain, prepared = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    internals.disable_builtin_all_reduce(prepared)
    with internals.builtin_all_reduce_replaced(lambda self, pairs: "refused"):
        assert plain._all_reduce_sum_gradients([]) == "refused"
        assert prepared._all_reduce_sum_gradients([]) == []
    assert plain._all_reduce_sum_gradients([]) == []  # outside a replica context: unchanged


def test_replica_count_scaling_off() -> None:
    module = internals.keras_loss_module()
    _require(module, "scale_loss_for_distribution", "replica_count_scaling_off", "training")
    _require(module, "unscale_loss_for_distribution", "replica_count_scaling_off", "training")
    strategy = mirrored_on_cpus(2)
    with strategy.scope():
        assert float(module.scale_loss_for_distribution(tf.constant(4.0))) == 2.0
        with internals.replica_count_scaling_off():
            assert float(module.scale_loss_for_distribution(tf.constant(4.0))) == 4.0
        assert float(module.scale_loss_for_distribution(tf.constant(4.0))) == 2.0


def test_losses_per_replica() -> None:
    layer_class = internals.keras_layer_class()
    for name in ("add_loss", "_get_own_losses", "_clear_losses"):
        _require(layer_class, name, "losses_per_replica", "training")
    assert issubclass(keras.layers.Layer, layer_class)
    layer = keras.layers.Dense(2)
    layer.add_loss(tf.constant(1.0))  # another thread's, as far as the block below goes
    seen: list[list[float]] = []
    with internals.losses_per_replica():
        layer.add_loss(tf.constant(2.0))
        seen.append([float(loss) for loss in layer.losses])
        layer._clear_losses()
        seen.append([float(loss) for loss in layer.losses])
    assert seen == [[2.0], []]
    # Keras's own list, cleared too: where no prepared loop or model of an earlier test is
    # alive in this process, whose switch (losses_per_thread) kept the first loss in this
    # thread's own list instead of Keras's.
    gc.collect()
    if not internals.losses_kept_per_thread():
        assert [float(loss) for loss in layer.losses] == []


def test_tensorflow_variable_class_is_the_base_of_keras_variable() -> None:
    variable_class = internals.tensorflow_variable_class()
    assert issubclass(keras.Variable, variable_class)
    assert isinstance(keras.Variable(1.0), variable_class)


def test_atomic_variable_updates() -> None:
    Variable = internals.tensorflow_variable_class()  # noqa: N806 (a class)
    for name in ("assign_add", "assign_sub"):
        _require(Variable, name, "atomic_variable_updates", "training.coordinator")
    variable = keras.Variable(1.0)
    _require(variable, "_value", "atomic_variable_updates", "training.coordinator")

    def ops(atomic: bool) -> set[str]:
        def update() -> None:
            if atomic:
                with internals.atomic_variable_updates():
                    variable.assign_add(2.0)
                    variable.assign_sub(0.5)
            else:
                variable.assign_add(2.0)
                variable.assign_sub(0.5)

        graph = tf.function(update).get_concrete_function().graph
        return {op.type for op in graph.get_operations()}

    assert {"AssignAddVariableOp", "AssignSubVariableOp"} <= ops(atomic=True)
    assert not {"AssignAddVariableOp", "AssignSubVariableOp"} & ops(atomic=False)  # Keras's
    with internals.atomic_variable_updates():
        variable.assign_add(2.0)  # eagerly too
    variable.assign_sub(0.5)
    assert float(variable.numpy()) == 2.5


def test_watch_gradient_targets_sees_the_target_and_keeps_the_gradient() -> None:
    _require(tf.GradientTape, "gradient", "watch_gradient_targets", "training.loop")
    seen: list[Any] = []

    def watcher(target: Any, sources: Any) -> None:
        seen.append((target, sources))

    first = internals.watch_gradient_targets(watcher)
    second = internals.watch_gradient_targets(watcher)  # held twice, called once
    try:
        variable = tf.Variable(3.0)
        with tf.GradientTape() as tape:
            loss = variable * variable
        assert float(tape.gradient(loss, variable)) == 6.0
    finally:
        first()
        second()
    assert len(seen) == 1 and seen[0][0] is loss and seen[0][1] is variable
    with tf.GradientTape() as tape:
        loss = variable * variable
    tape.gradient(loss, variable)
    assert len(seen) == 1  # unregistered


def test_watch_loss_reductions_records_keras_and_tf_nn_reductions() -> None:
    module = internals.keras_loss_module()
    _require(module, "scale_loss_for_distribution", "watch_loss_reductions", "training.loop")
    _require(tf.nn, "compute_average_loss", "watch_loss_reductions", "training.loop")
    _require(tf.nn, "scale_regularization_loss", "watch_loss_reductions", "training.loop")
    seen: list[str] = []
    undo = internals.watch_loss_reductions(lambda name, output, args, kwargs: seen.append(name))
    strategy = mirrored_on_cpus(2)

    def replica() -> Any:
        mean = keras.losses.MeanSquaredError()(tf.zeros((2, 1)), tf.ones((2, 1)))
        average = tf.nn.compute_average_loss(tf.ones(2))
        return mean, average, tf.nn.scale_regularization_loss(tf.constant(2.0))

    try:
        mean, average, regularization = strategy.run(replica)
    finally:
        undo()
    # What the originals return: a Keras mean divided by 2 replicas, 2 / (2 * 2), 2 / 2.
    values = [strategy.experimental_local_results(v)[0] for v in (mean, average, regularization)]
    assert [float(v) for v in values] == [0.5, 0.5, 1.0]
    assert {"keras_scale", "compute_average_loss", "scale_regularization_loss"} <= set(seen)


def test_autograph_origin_maps_generated_code_to_the_users_line() -> None:
    import sys

    seen: list[Any] = []

    @tf.autograph.experimental.do_not_convert
    def origin_of_caller() -> None:
        # Called from the converted step (through AutoGraph's converted_call): the nearest
        # frame of generated code is the step's.
        frame = sys._getframe(1)
        while frame is not None and "__autograph_generated_file" not in frame.f_code.co_filename:
            frame = frame.f_back  # type: ignore[assignment]
        seen.append(frame and internals.autograph_origin(frame.f_code, frame.f_lineno))

    def step(x: Any) -> Any:
        origin_of_caller()
        return x * 2

    tf.function(step)(tf.constant(1.0))
    here = Path(__file__).resolve()
    lines = here.read_text().splitlines()
    line = next(i for i, t in enumerate(lines, 1) if t.strip() == "origin_of_caller()")
    if seen[0] is None:
        pytest.fail(
            "AutoGraph's ag_source_map is gone or changed (TensorFlow "
            f"{tf.__version__}): tfscale.interop.internals.autograph_origin needs another way; "
            "scope.creation_stack (doctor --script's sites in tf.function steps) depends on it."
        )
    filename, number, function = seen[0]
    assert (Path(filename).resolve(), number, function) == (here, line, "step")
    assert internals.autograph_origin(step.__code__, line) is None  # not generated code


def test_the_switches_act_in_the_thread_that_entered_them_only() -> None:
    # Two fits tracing at once in two threads each keep their own setting, and leaving one
    # restores Keras's behaviour for good, whatever the other thread does (#21.4).
    module = internals.keras_loss_module()
    plain = keras.optimizers.SGD(0.1)
    inside, leave = threading.Event(), threading.Event()
    seen: list[Any] = []

    def other_thread() -> None:
        with (
            internals.replica_count_scaling_off(),
            internals.builtin_all_reduce_replaced(lambda self, pairs: "refused"),
        ):
            inside.set()
            leave.wait(30)
            seen.append(plain._all_reduce_sum_gradients([]))

    with mirrored_on_cpus(2).scope():
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert inside.wait(30)
        assert float(module.scale_loss_for_distribution(tf.constant(4.0))) == 2.0
        assert plain._all_reduce_sum_gradients([]) == []
        with internals.replica_count_scaling_off():
            leave.set()
            thread.join(30)
            assert float(module.scale_loss_for_distribution(tf.constant(4.0))) == 4.0
        assert float(module.scale_loss_for_distribution(tf.constant(4.0))) == 2.0
        assert float(module.unscale_loss_for_distribution(tf.constant(4.0))) == 8.0
    assert seen == ["refused"]


def test_strategy_supports_no_merge_call() -> None:
    _require(tf.__internal__.distribute, "strategy_supports_no_merge_call",
             "strategy_supports_no_merge_call", "training.optimizer")  # fmt: skip
    with mirrored_on_cpus(2).scope():
        assert internals.strategy_supports_no_merge_call() is False


def test_all_reduce_and_all_gather_without_gradient_give_tensorflows_results() -> None:
    # The no-merge_call path (MultiWorkerMirrored) runs in the worker-process tests.
    _require(_collective_extended(), "_replica_ctx_all_reduce", "all_reduce_without_gradient",
             "training.allreduce")  # fmt: skip
    strategy = mirrored_on_cpus(2)
    _require(strategy.extended, "_batch_gather_to", "all_gather_without_gradient",
             "training.sharding")  # fmt: skip

    def run(kind: str) -> bool:
        """Runs one traced step of ``kind``'s collectives; True when its graph was freed."""
        graphs: list[Any] = []

        @tf.function  # type: ignore[misc]
        def step() -> Any:
            graphs.append(weakref.ref(tf.compat.v1.get_default_graph()))

            def replica() -> Any:
                context = tf.distribute.get_replica_context()
                k = tf.cast(context.replica_id_in_sync_group, tf.float32) + 1.0
                dense = k * tf.constant([1.0, 2.0])
                rows = tf.IndexedSlices(k * tf.ones([1, 2]), tf.constant([1]), tf.constant([3, 2]))
                if kind == "tfscale":
                    summed = internals.all_reduce_without_gradient(context, "sum", [dense])[0]
                    sparse = internals.all_reduce_without_gradient(context, "SUM", [rows])[0]
                    gathered = internals.all_gather_without_gradient(context, dense, 0)
                    return summed, tf.convert_to_tensor(sparse), gathered
                if kind == "all_reduce":
                    sparse = context.all_reduce("SUM", [rows])[0]
                    return context.all_reduce("SUM", dense), tf.convert_to_tensor(sparse)
                return (context.all_gather(dense, axis=0),)

            return strategy.run(replica)

        results = [[v.numpy() for v in strategy.experimental_local_results(t)] for t in step()]
        expected = {
            "tfscale": [[3.0, 6.0], [[0, 0], [3, 3], [0, 0]], [1.0, 2.0, 2.0, 4.0]],
            "all_reduce": [[3.0, 6.0], [[0, 0], [3, 3], [0, 0]]],
            "all_gather": [[1.0, 2.0, 2.0, 4.0]],
        }[kind]
        for got, want in zip(results, expected, strict=True):
            for replica in range(2):
                np.testing.assert_array_equal(got[replica], want)
        del step
        gc.collect()
        return graphs[0]() is None

    assert run("tfscale")
    # TensorFlow's own methods wrap the collective in a tf.custom_gradient whose gradient
    # function, kept in the process-wide gradient registry, holds the step's graph
    # (tensorflow/tensorflow#97697): all_reduce's up to 2.21 (2.22.0rc0 frees it), and
    # all_gather's still on 2.22.0rc0 (its gradient closes over the inputs). Once the lowest
    # supported TensorFlow frees both, the two accessors can give way to ReplicaContext's.
    fixed = tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 22)
    assert run("all_reduce") is fixed
    assert run("all_gather") is False, "all_gather frees its graph now: see the comment"


def test_in_symbolic_build_is_true_only_while_keras_traces_for_shapes() -> None:
    seen: list[bool] = []

    class Probe(keras.layers.Layer):  # type: ignore[misc]
        def call(self, x: Any) -> Any:
            seen.append(internals.in_symbolic_build())
            return x

    probe = Probe()
    probe(keras.KerasTensor((None, 2)))  # a functional call: Keras's compute_output_spec
    probe(tf.ones([1, 2]))
    assert seen == [True, False]
    assert internals.in_symbolic_build() is False


def test_forget_custom_gradients_frees_the_graph_that_tf_recompute_grad_keeps() -> None:
    from tensorflow.python.framework import ops

    _require(ops, "_gradient_registry", "forget_custom_gradients", "training.layercalls")
    _require(ops._gradient_registry, "_registry", "forget_custom_gradients",
             "training.layercalls")  # fmt: skip
    weight = tf.Variable([0.5, -1.0])

    def run(forget: bool) -> bool:
        """Traces and runs one recomputed step; True when its graph was freed."""
        graphs: list[Any] = []
        found: list[set[str]] = []

        @tf.function  # type: ignore[misc]
        def step(x: tf.Tensor) -> Any:
            graph = tf.compat.v1.get_default_graph()
            graphs.append(weakref.ref(graph))
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.recompute_grad(lambda t: tf.reduce_sum(tf.sin(t) * weight))(x)
            gradients = tape.gradient(y, [x, weight])
            found.append(internals.custom_gradient_names(graph))
            if forget:
                internals.forget_custom_gradients(found[-1])
            return gradients

        x = tf.constant([0.3, 1.2])
        dx, dw = step(x)
        np.testing.assert_allclose(dx.numpy(), np.cos([0.3, 1.2]) * [0.5, -1.0], rtol=1e-6)
        np.testing.assert_allclose(dw.numpy(), np.sin([0.3, 1.2]), rtol=1e-6)
        # The forward's and the recomputing backward's (tf.recompute_grad's own nested one).
        assert len(found[0]) == 2 and all(n.startswith("CustomGradient-") for n in found[0])
        registered = ops._gradient_registry._registry
        assert all((name in registered) is not forget for name in found[0])
        del step
        gc.collect()
        return graphs[0]() is None

    assert run(forget=True)
    # TensorFlow keeps every graph that traced a tf.custom_gradient for the life of the
    # process, through the gradient function it registered (tensorflow/tensorflow#97697):
    # when this fails, the removal in training/layercalls.py can go.
    assert run(forget=False) is False, "tf.recompute_grad frees its graph now: see the comment"


def _collective_extended() -> type:
    from tensorflow.python.distribute import collective_all_reduce_strategy

    return collective_all_reduce_strategy.CollectiveAllReduceExtended


# -- what tfscale replaces on an instance or in its class -------------------------------------
# Each method tfscale puts on a Keras object (registry.replace) or in a prepared model's class
# (training/modelclass.py) only works while Keras calls it through the object (self.NAME(...))
# with the arguments tfscale's replacement takes. One test per name, each setting it on the
# instance as the registry does; test_every_instance_override_is_tested fails on a name with
# none.
def _on_instance(obj: Any, name: str, value: Any) -> None:
    obj.__dict__[name] = value


def _off_instance(obj: Any, name: str) -> None:
    obj.__dict__.pop(name, None)


_OVERRIDES_TESTED: dict[str, str | tuple[str, ...]] = {
    "make_train_function": "test_fit_calls_the_instance_make_train_function_and_train_function",
    "make_test_function": "test_evaluate_calls_the_instance_make_test_function",
    "_maybe_symbolic_build": "test_fit_calls_the_instance_maybe_symbolic_build",
    "compute_loss": "test_train_step_calls_the_instance_compute_loss_with_x",
    "apply": "test_apply_gradients_calls_the_instance_apply",
    "scale_loss": "test_train_step_calls_the_instance_scale_loss",
    "call": "test_layer_call_runs_the_instance_call",
    "get_metrics_result": "test_fit_reads_epoch_logs_through_the_instance_get_metrics_result",
    "fit": "test_a_models_own_fit_reaches_the_prepared_classs_fit_below_it",
    "build": (
        "test_the_first_call_of_an_unbuilt_model_runs_the_instance_build",
        "test_a_multi_optimizer_is_built_through_the_instance_build_and_asks_its_map",
        "test_fit_builds_the_optimizer_through_the_instance_build",
    ),
    "next": "test_random_ops_draw_through_the_instance_seed_generator_next",
    # tfscale's own state, which no Keras code reads: only the __dict__ write is assumed.
    "_tfscale": "test_replace_and_restore_set_an_attribute_on_one_instance",
    "_tfscale_update": "test_replace_and_restore_set_an_attribute_on_one_instance",
    "_tfscale_loop": "test_replace_and_restore_set_an_attribute_on_one_instance",
    "train_function": "test_fit_calls_the_instance_make_train_function_and_train_function",
    "test_function": "test_evaluate_calls_the_instance_make_test_function",
    "predict_function": "test_replace_and_restore_set_an_attribute_on_one_instance",
    "_collective_ops_server_def": "test_forget_collective_setup_clears_a_stand_in_context",
    "_coordination_service_config": "test_forget_collective_setup_clears_a_stand_in_context",
    "_all_reduce_sum_gradients": "test_optimizer_accessors",
    "_tfscale_sharded": "test_replace_and_restore_set_an_attribute_on_one_instance",
    "save_own_variables": "test_weights_files_save_and_load_through_the_instance_optimizer",
    "load_own_variables": "test_weights_files_save_and_load_through_the_instance_optimizer",
    "_trackable_children": "test_a_checkpoint_reads_the_replaced_checkpoint_children",
}


def test_weights_files_save_and_load_through_the_instance_optimizer(tmp_path: Path) -> None:
    """training.sharding saves a sharded optimizer's slots whole in Keras's weights files:
    ``save_weights`` / ``load_weights`` must reach the optimizer's instance methods."""
    model = _functional()
    model.compile(keras.optimizers.Adam(0.1), "mse")
    model.optimizer.build(model.trainable_variables)
    calls = []
    for name in ("save_own_variables", "load_own_variables"):
        keras_method = getattr(model.optimizer, name)

        def method(store: Any, keras_method: Any = keras_method, name: str = name) -> None:
            calls.append(name)
            keras_method(store)

        _on_instance(model.optimizer, name, method)
    model.save_weights(str(tmp_path / "m.weights.h5"))
    model.load_weights(str(tmp_path / "m.weights.h5"))
    assert calls == ["save_own_variables", "load_own_variables"]


def test_fit_builds_the_optimizer_through_the_instance_build() -> None:
    """training.sharding replaces a sharded optimizer's ``build`` (its slots are shards):
    Keras's fit must build the optimizer through the instance's."""
    model = _functional()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    optimizer = model.optimizer
    built = []
    keras_build = optimizer.build

    def build(variables: Any) -> None:
        built.append(len(variables))
        keras_build(variables)

    _on_instance(optimizer, "build", build)
    model.fit(np.ones((4, 4), "float32"), np.ones((4, 2), "float32"), verbose=0)
    assert built == [4]


def test_optimizer_update_accessors() -> None:
    kernel = keras.Variable(np.ones((2, 2), "float32"), name="kernel")
    bias = keras.Variable(np.ones(2, "float32"), name="bias")
    optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.5, global_clipnorm=1.0)
    optimizer.exclude_from_weight_decay(var_list=[bias])
    optimizer.build([kernel, bias])
    for name, accessor in (
        ("_clip_gradients", "optimizer_clip_gradients"),
        ("_use_weight_decay", "optimizer_uses_weight_decay"),
        ("_iterations", "optimizer_base_variables"),
        ("_learning_rate", "optimizer_base_variables"),
    ):
        _require(optimizer, name, accessor, "training.sharding")
    clipped = internals.optimizer_clip_gradients(
        optimizer, [tf.fill((2, 2), 3.0), tf.fill((2,), 4.0)]
    )
    assert abs(float(tf.linalg.global_norm(clipped)) - 1.0) < 1e-6
    assert internals.optimizer_uses_weight_decay(optimizer, kernel)
    assert not internals.optimizer_uses_weight_decay(optimizer, bias)
    base = internals.optimizer_base_variables(optimizer)
    assert [id(v) for v in base] == [id(v) for v in optimizer.variables[:2]]
    assert [v.path.split("/")[-1] for v in base] == ["iteration", "learning_rate"]
    nadam = keras.optimizers.Nadam(0.1)
    nadam.build([kernel])
    _require(nadam, "_u_product", "nadam_momentum_product", "training.sharding")
    assert internals.nadam_momentum_product(nadam) is nadam._u_product
    assert isinstance(internals.distributed_container(kernel), internals.trackable_base())


def test_a_checkpoint_reads_the_replaced_checkpoint_children(tmp_path: Path) -> None:
    """training.sharding saves a sharded optimizer's slots whole under ``_variables``."""
    holder = tf.Module()
    holder.kept = tf.Variable(1.0)
    replacement = tf.Variable(5.0)
    internals.replace_checkpoint_children(holder, {"kept": replacement})
    path = tf.train.Checkpoint(holder=holder).write(str(tmp_path / "c"))
    saved = tf.train.load_checkpoint(path).get_tensor("holder/kept/.ATTRIBUTES/VARIABLE_VALUE")
    assert float(saved) == 5.0
    replacement.assign(0.0)
    tf.train.Checkpoint(holder=holder).read(path).assert_consumed()
    assert (float(replacement.numpy()), float(holder.kept.numpy())) == (5.0, 1.0)


def test_random_ops_draw_through_the_instance_seed_generator_next() -> None:
    """training.randomness folds the replica id into what a generator's ``next`` returns:
    Keras's random ops (Dropout's included) must take their seed from the instance's."""
    dropout = keras.layers.Dropout(0.5, seed=1)
    generator = dropout.seed_generator
    calls = []
    keras_next = generator.next

    def next(ordered: bool = True) -> Any:
        calls.append(ordered)
        return keras_next(ordered)

    _on_instance(generator, "next", next)
    try:
        dropout(tf.ones((2, 4)), training=True)
        keras.random.normal((2,), seed=generator)
    finally:
        _off_instance(generator, "next")
    assert len(calls) == 2


def _compiled_functional(**compile_kw: Any) -> keras.Model:
    model = _functional()
    model.compile(optimizer="sgd", loss="mse", **compile_kw)
    return model


_XY = (np.ones((4, 4), "float32"), np.ones((4, 2), "float32"))


def _broken(name: str, what: str, used_by: str) -> str:
    return (
        f"Keras {keras.__version__} (TensorFlow {tf.__version__}) {what}: tfscale's per-instance "
        f"override of {name!r} no longer takes effect; {used_by} needs another way."
    )


def test_fit_calls_the_instance_make_train_function_and_train_function() -> None:
    model, seen = _compiled_functional(), []
    original = model.make_train_function

    def make(force: bool = False) -> Any:
        seen.append("make")
        original(force)
        function = model.train_function

        def train_function(iterator: Any) -> Any:
            seen.append("train")
            return function(iterator)

        model.train_function = train_function
        return train_function

    _on_instance(model, "make_train_function", make)
    model.fit(*_XY, batch_size=4, verbose=0)
    assert seen[:2] == ["make", "train"], _broken(
        "make_train_function",
        "fit does not call model.make_train_function() and then model.train_function(iterator)",
        "training.prepare.Prepared.make_train_function (the StepFunction)",
    )


def test_evaluate_calls_the_instance_make_test_function() -> None:
    model, seen = _compiled_functional(), []
    original = model.make_test_function

    def make(force: bool = False) -> Any:
        seen.append("make")
        return original(force)

    _on_instance(model, "make_test_function", make)
    model.evaluate(*_XY, batch_size=4, verbose=0)
    assert seen == ["make"], _broken(
        "make_test_function",
        "evaluate does not call model.make_test_function()",
        "training.prepare.Prepared.make_test_function",
    )


def test_fit_calls_the_instance_maybe_symbolic_build() -> None:
    import inspect

    model, seen = _compiled_functional(), []
    _require(model, "_maybe_symbolic_build", "override", "training.prepare.Prepared")
    parameters = list(inspect.signature(type(model)._maybe_symbolic_build).parameters)
    original = model._maybe_symbolic_build

    def build(iterator: Any = None, data_batch: Any = None) -> None:
        seen.append((iterator is not None, data_batch is not None))
        original(iterator=iterator, data_batch=data_batch)

    _on_instance(model, "_maybe_symbolic_build", build)
    model.fit(*_XY, batch_size=4, verbose=0)
    model.train_on_batch(*_XY)
    assert parameters[1:3] == ["iterator", "data_batch"] and seen[:2] == [
        (True, False),
        (False, True),
    ], _broken(
        "_maybe_symbolic_build",
        f"calls model._maybe_symbolic_build{tuple(parameters[1:])} as {seen}, not "
        "(iterator=...) from fit and (data_batch=...) from train_on_batch",
        "training.prepare.Prepared.symbolic_build (the build from the element spec)",
    )


def test_train_step_calls_the_instance_compute_loss_with_x() -> None:
    model, seen = _compiled_functional(), []
    original = model.compute_loss

    def compute_loss(*args: Any, **kwargs: Any) -> Any:
        seen.append(args[0] if args else kwargs.get("x"))
        return original(*args, **kwargs)

    _on_instance(model, "compute_loss", compute_loss)
    model.fit(*_XY, batch_size=4, verbose=0)
    assert seen and seen[0] is not None, _broken(
        "compute_loss",
        "train_step does not call model.compute_loss with x first or as x=",
        "training.prepare.Prepared.compute_loss (0 on a replica without examples)",
    )


def test_fit_reads_epoch_logs_through_the_instance_get_metrics_result() -> None:
    model, seen = _compiled_functional(metrics=["mae"]), []
    original = model.get_metrics_result

    def get_metrics_result() -> Any:
        seen.append(1)
        return {name: value * 0 + 7.0 for name, value in original().items()}

    _on_instance(model, "get_metrics_result", get_metrics_result)
    history = model.fit(*_XY, batch_size=4, verbose=0)
    assert seen and history.history["mae"] == [7.0], _broken(
        "get_metrics_result",
        "fit's epoch-end logs do not come from model.get_metrics_result()",
        "training.prepare.Prepared.get_metrics_result (metric results read as tensors)",
    )


def test_the_first_call_of_an_unbuilt_model_runs_the_instance_build() -> None:
    import functools

    model, seen = keras.Sequential([keras.layers.Dense(2)]), []
    build = model.build

    @functools.wraps(build)  # as training.loop does: Keras reads build's signature
    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append(args or tuple(kwargs.values()))
        return build(*args, **kwargs)

    _on_instance(model, "build", recorded)
    model(np.ones((2, 4), "float32"))
    assert seen and model.built, _broken(
        "build",
        "the first call of an unbuilt model does not run model.build(shape)",
        "training.loop._build_outside_steps (variables created outside the replica step)",
    )


def test_apply_gradients_calls_the_instance_apply() -> None:
    optimizer, seen = keras.optimizers.SGD(0.1), []
    variables = [keras.Variable(np.ones(2, "float32"))]
    optimizer.build(variables)
    _on_instance(optimizer, "apply", lambda grads, variables=None: seen.append(len(grads)))
    optimizer.apply_gradients([(np.ones(2, "float32"), variables[0])])
    assert seen == [1], _broken(
        "apply",
        "optimizer.apply_gradients does not call optimizer.apply(grads, variables)",
        "training.optimizer.DistributedUpdate (the all-reduce and update)",
    )


def test_train_step_calls_the_instance_scale_loss() -> None:
    model = _functional()
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
    seen, original = [], model.optimizer.scale_loss

    def scale_loss(loss: Any) -> Any:
        seen.append(loss)
        return original(loss)

    _on_instance(model.optimizer, "scale_loss", scale_loss)
    model.fit(*_XY, batch_size=4, verbose=0)
    assert seen, _broken(
        "scale_loss",
        "train_step does not call model.optimizer.scale_loss(loss) on a LossScaleOptimizer",
        "training.optimizer.DistributedUpdate.scale_loss (float16 loss divided by N)",
    )


def test_layer_call_runs_the_instance_call() -> None:
    model, seen = _functional(), []
    layer = model.get_layer("hidden")
    original = layer.call
    _on_instance(layer, "call", lambda *a, **k: seen.append(1) or original(*a, **k))
    model(np.ones((2, 4), "float32"))
    assert seen == [1], _broken(
        "call", "Layer.__call__ does not run layer.call", "training.layercalls (remat)"
    )


def test_metric_variables_are_per_replica_under_a_strategy() -> None:
    # training.function reads a step's logs as model.get_metrics_result() in cross-replica
    # context: the sum over replicas of per-replica (ON_READ) metric variables. Keras < 3.10
    # created them mirrored (every replica's update merged into one value), and History then
    # differed from one device's by up to 53% (issue #21).
    with mirrored_on_cpus(2).scope():
        metric = keras.metrics.Mean()
    (total, *_) = metric.variables
    synchronization = getattr(internals.backing_variable(total), "synchronization", None)
    assert synchronization == tf.VariableSynchronization.ON_READ, (
        f"Keras {keras.__version__} creates metric variables with {synchronization} under a "
        "strategy, not ON_READ: training.function's logs (get_metrics_result over all "
        "replicas) need another way to sum per-replica metric state."
    )


def test_experimental_get_compiler_ir_lowers_from_tensor_specs() -> None:
    # training.xla.check_compilable refuses a model XLA cannot compile before the first step
    # by lowering its forward and backward pass from the input's specs, running nothing.
    function = tf.function(lambda x: x * 2.0, jit_compile=True)
    lower = getattr(function, "experimental_get_compiler_ir", None)
    assert lower is not None, (
        f"TensorFlow {tf.__version__} has no Function.experimental_get_compiler_ir: "
        "training.xla.check_compilable needs another way to compile without running"
    )
    try:
        text = lower(tf.TensorSpec([2, 3], tf.float32))(stage="hlo")
    except Exception as error:
        pytest.fail(
            f"TensorFlow {tf.__version__}'s experimental_get_compiler_ir no longer lowers from "
            f"a TensorSpec ({error!r}): training.xla.check_compilable needs another way"
        )
    assert "multiply" in text


def test_every_instance_override_is_tested() -> None:
    """Every attribute a registry.replace call names, and every method of a prepared model's
    class (modelclass.Around / Below), has a test above."""
    from tfscale.training import modelclass

    overridden = set()
    for path in sorted(_SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "replace"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "registry"
                and len(node.args) > 2
                and isinstance(node.args[2], ast.Constant)
            ):
                overridden.add(node.args[2].value)
    assert overridden, "no registry.replace(...) call found: the scan is broken"
    for cls in (modelclass.Around, modelclass.Below):
        overridden.update(name for name in vars(cls) if not name.startswith("__"))
    untested = sorted(overridden - set(_OVERRIDES_TESTED))
    assert untested == [], (
        f"add a test of Keras still calling these through the instance: {untested}"
    )
    names = [n for v in _OVERRIDES_TESTED.values() for n in ((v,) if isinstance(v, str) else v)]
    assert all(name in globals() for name in names)


# -- nothing else reaches private names ---------------------------------------------------------
_PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.tsl", "tensorflow.compiler")


def _private_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        line = getattr(node, "lineno", 0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
            if any(n.startswith(_PRIVATE_MODULES) for n in names):
                found.append(f"{path.name}:{line} imports {names}")
        elif isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            owner = node.value.id if isinstance(node.value, ast.Name) else ""
            if (  # super(): the class's own method, as self
                isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id == "super"
            ):
                owner = "super"
            if (
                private and owner not in ("self", "cls", "sys", "os", "super")
            ) or node.attr == "__internal__":
                found.append(f"{path.name}:{line} .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
            and not str(node.args[1].value).startswith("__")
        ):
            found.append(f"{path.name}:{line} {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Constant) and node.value == internals.DEFAULT_STRATEGY_CLASS:
            found.append(f"{path.name}:{line} {node.value!r}")
    return found


def test_no_private_keras_or_tensorflow_name_outside_internals() -> None:
    found = []
    for path in sorted(_SRC.rglob("*.py")):
        relative = path.relative_to(_SRC).as_posix()
        if relative in ("interop/internals.py", "interop/registry.py"):
            continue
        found += [f"{relative}: {use}" for use in _private_uses(path)]
    assert found == [], "move these into tfscale/interop/internals.py (an accessor and a test each)"
