"""Every private Keras and TensorFlow name tfscale reaches, in one place.

Keras and TensorFlow have no public way to do a few things tfscale needs (find the strategy a
variable belongs to, walk a functional model's graph, bound the wait for a missing worker,
read a profiler trace). Each such access is one small function here, with one test in
``tests/test_internals.py`` that fails with a clear message when an upgrade removes or
renames the name, so that an upgrade is a one-file job. Nothing else in tfscale reads a
``_private`` attribute of a Keras or TensorFlow object or imports ``keras.src`` /
``tensorflow.python`` (``tests/test_internals.py`` scans for it).

Grouped by library; each docstring says which name, why it is needed, and the upstream issue
where there is one. Keras and TensorFlow are imported inside the functions, so importing this
module stays TensorFlow-free (the doctor's parent side uses it).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DEFAULT_STRATEGY_CLASS",
    "backing_variable",
    "compile_config_objects",
    "context_initialized",
    "context_started",
    "coordination_config_pb2",
    "cross_device_ops",
    "dataset_batch_size",
    "eager_context",
    "forget_collective_setup",
    "functional_nodes",
    "inbound_nodes",
    "model_strategy",
    "node_key",
    "reinitialize_variable",
    "set_model_strategy",
    "slurm_cluster_resolver_module",
    "symbolic_build",
    "tensor_producer",
    "variable_strategy",
    "xplane_pb2",
]


# -- Keras models -------------------------------------------------------------------------------
def model_strategy(model: Any) -> Any:
    """``Model._distribute_strategy``: the strategy whose scope the model was built in.

    Keras 3 records it on the model and trains with it; there is no public getter. None
    when the model was built outside any scope. (``scope.check_scope`` / ``fix_scope``.)
    """
    return getattr(model, "_distribute_strategy", None)


def set_model_strategy(model: Any, strategy: Any) -> None:
    """``Model._distribute_strategy = strategy``: the strategy Keras's ``fit`` distributes with.

    A pipelined model places its own ops on its stages' devices and declares the default
    (no-op) strategy as its own, so ``fit`` does not replicate it. (``parallel/placement.py``.)
    """
    model._distribute_strategy = strategy


def symbolic_build(model: Any, data_batch: Any) -> None:
    """``Model._symbolic_build``: creates the model's, metrics' and optimizer's variables.

    What Keras's own ``fit`` runs before its first step; a benchmark that times the first
    steps of two loops builds both sides this way first. (``benchmarks/step_vs_keras.py``.)
    """
    model._symbolic_build(data_batch=data_batch)


def compile_config_objects(model: Any) -> dict[str, Any] | None:
    """``Model._compile_config.config``: the objects ``compile()`` received, in memory.

    The public ``get_compile_config()`` serializes them, which fails for lambdas and
    unregistered custom losses; ``fix_scope`` recompiles a clone with the same objects.
    None when the model was not compiled. (``scope.py``.)
    """
    stored = getattr(getattr(model, "_compile_config", None), "config", None)
    return None if stored is None else dict(stored)


def functional_nodes(model: Any) -> Any:
    """``Functional._nodes``: the keys of the nodes that belong to this model's graph.

    A layer reused by another model has inbound nodes of that model too; only the nodes
    listed here are this model's. None for a model that is not functional (a subclassed
    one). (``parallel/partition.py``.)
    """
    return getattr(model, "_nodes", None)


def inbound_nodes(operation: Any) -> list[Any]:
    """``Operation._inbound_nodes``: every call of a layer in every model it is part of.

    Keras 3 has no public accessor (tf.keras had ``inbound_nodes``). (``partition.py``.)
    """
    return list(operation._inbound_nodes)


def node_key(operation: Any, index: int) -> str:
    """The key Keras gives the ``index``-th inbound node of ``operation`` in ``_nodes``.

    The format ``f"{id(op)}_ib-{index}"`` is written in ``keras.src.ops.function`` (and the
    models' ``_nodes`` sets); it has no public name. (``partition.py``.)
    """
    return f"{id(operation)}_ib-{index}"


def tensor_producer(tensor: Any) -> Any:
    """``KerasTensor._keras_history[0]``: the operation (layer) that produced a symbolic
    tensor, to follow a functional model's graph from a layer to its inputs. (``partition.py``.)
    """
    return tensor._keras_history[0]


# -- Keras variables ----------------------------------------------------------------------------
def backing_variable(variable: Any) -> Any:
    """``keras.Variable._value``: the ``tf.Variable`` holding a Keras variable's value.

    The public ``.value`` may return an autocast copy, not the variable; moving a weight to
    another device needs the variable itself. None where there is none. (``placement.py``.)
    """
    return getattr(variable, "_value", None)


def reinitialize_variable(variable: Any, value: Any) -> None:
    """``keras.Variable._initialize``: re-creates the ``tf.Variable`` behind a Keras variable.

    Called under a ``tf.device`` scope, the new ``tf.Variable`` lives there while the Keras
    variable object (which layers, optimizers and checkpoints refer to) stays the same:
    Keras has no public way to move an existing weight to another device. (``placement.py``.)
    """
    variable._initialize(value)


# -- TensorFlow: tf.distribute ------------------------------------------------------------------
#: ``type(tf.distribute.get_strategy()).__name__`` outside every scope: TensorFlow's private
#: default strategy class, which the doctor must tell from strategies the user built. Its name
#: is compared as text because the doctor's parent process imports no TensorFlow.
DEFAULT_STRATEGY_CLASS = "_DefaultDistributionStrategy"


def variable_strategy(variable: Any) -> Any:
    """``tf.Variable._distribute_strategy``: the strategy a variable was created under.

    TensorFlow has no public getter; ``strategy.extended.variable_created_in_scope`` reads
    this same attribute. None outside any scope. (``scope.py``.)
    """
    return getattr(variable, "_distribute_strategy", None)


def cross_device_ops(strategy: Any) -> Any:
    """``strategy.extended._cross_device_ops``: the all-reduce implementation in use, named in
    the all-reduce benchmark's results. None where the strategy has none (one device).
    (``profiling/collectives.py``.)
    """
    return getattr(strategy.extended, "_cross_device_ops", None)


# -- TensorFlow: the eager context --------------------------------------------------------------
def eager_context() -> Any:
    """``tensorflow.python.eager.context.context()``: the process's eager context.

    Needed to configure the coordination service with a registration deadline before
    MultiWorkerMirroredStrategy does (the public API has none), and to undo a failed
    multi-worker set-up. (``strategy/build.py``.)
    """
    from tensorflow.python.eager import context

    return context.context()


def context_started(ctx: Any) -> bool:
    """``Context._context_handle``: whether the runtime has started (then collectives and
    the coordination service can no longer be configured). (``strategy/build.py``.)
    """
    return getattr(ctx, "_context_handle", None) is not None


def context_initialized(ctx: Any) -> bool:
    """``Context._initialized``: whether the context finished initializing; True when
    unknown, so that nothing is undone by mistake. (``strategy/build.py``.)
    """
    return bool(getattr(ctx, "_initialized", True))


def forget_collective_setup(ctx: Any) -> None:
    """Clears ``Context._collective_ops_server_def`` and ``_coordination_service_config``.

    Workaround (TF 2.21, reproduced in tests/test_strategy.py): when
    MultiWorkerMirroredStrategy cannot start its gRPC server the context keeps both, and
    every later op retries the same server and fails, so no fallback strategy could run.
    Only called while the context is still uninitialized. (``strategy/build.py``.)
    """
    for name in ("_collective_ops_server_def", "_coordination_service_config"):
        if hasattr(ctx, name):
            setattr(ctx, name, None)


def coordination_config_pb2() -> Any:
    """``tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2``: the message that
    configures the coordination service (``CoordinatedJob``); not exported by ``tf``.
    (``strategy/build.py``.)
    """
    import importlib

    return importlib.import_module("tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2")


# -- TensorFlow: tf.data, profiler, cluster resolvers -------------------------------------------
def dataset_batch_size(dataset: Any) -> Any:
    """``BatchDataset._batch_size``: the batch size of ``dataset.batch(n)`` without
    ``drop_remainder``, whose element spec leaves the batch dimension unknown. None for
    other datasets. (``profiling/script.py``.)
    """
    return getattr(dataset, "_batch_size", None)


def xplane_pb2() -> Any:
    """``tensorflow.tsl.profiler.protobuf.xplane_pb2``: the format of the TF profiler's trace.

    TF 2.21's profiler writes XPlane only (no ``trace.json.gz``); TensorFlow's own generated
    module reads it. (``profiling/timeline.py``, ``benchmarks/pipeline_overlap.py``.)
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2 as module

    return module


def slurm_cluster_resolver_module() -> Any:
    """``tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver``: TensorFlow's
    Slurm hostlist expansion, which ``tests/test_hostlist.py`` checks tfscale's against.
    """
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver

    return slurm_cluster_resolver
