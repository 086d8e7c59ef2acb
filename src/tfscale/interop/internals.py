"""Every private Keras and TensorFlow name tfscale reaches, in one place.

Keras and TensorFlow have no public way to do a few things tfscale needs (re-create a model's
variables under a strategy, switch off the optimizer's built-in all-reduce, let a compiled
step see losses unscaled by the replica count). Each such access is one small function here,
with a test in ``tests/test_internals.py`` that fails with a clear message when an upgrade
removes or renames the name, so that an upgrade is a one-file job.

Grouped by library; each docstring says why the name is needed.

Keras and TensorFlow are imported inside the functions, so importing this module stays
TensorFlow-free (the doctor's parent side uses it). Nothing else in tfscale outside
``training/`` reads a ``_private`` attribute of a Keras or TensorFlow object or imports
``keras.src`` / ``tensorflow.python`` (``tests/test_internals.py`` scans for it).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from tfscale.interop import registry

__all__ = [
    "DEFAULT_STRATEGY_CLASS",
    "BatchTotals",
    "all_gather_without_gradient",
    "all_reduce_without_gradient",
    "as_batch_sum",
    "atomic_variable_updates",
    "autocast",
    "autocast_dtype",
    "autograph_origin",
    "backing_variable",
    "batch_examples_ratio",
    "broadcast_any_initial_value",
    "builtin_all_reduce_replaced",
    "compile_config_objects",
    "context_initialized",
    "context_started",
    "coordination_config_pb2",
    "cross_device_ops",
    "custom_gradient_names",
    "dataset_batch_size",
    "distributed_container",
    "distributed_input_methods",
    "distributed_input_strategy",
    "eager_context",
    "epoch_iterator_dataset",
    "flatten_layers",
    "forget_collective_setup",
    "forget_custom_gradients",
    "functional_nodes",
    "gradient_functions_released",
    "in_symbolic_build",
    "inbound_nodes",
    "is_array_input",
    "keras_layer_class",
    "keras_loss_module",
    "lists_to_tuples",
    "load_balancing_modules",
    "load_balancing_over_the_batch",
    "losses_per_replica",
    "losses_per_thread",
    "model_strategy",
    "nadam_momentum_product",
    "node_key",
    "optimizer_base_variables",
    "optimizer_clip_gradients",
    "optimizer_trainable_variables",
    "optimizer_uses_weight_decay",
    "per_replica_component_specs",
    "per_replica_losses_active",
    "reduce_per_replica",
    "register_same_name",
    "reinitialize_variable",
    "replace_checkpoint_children",
    "replica_count_scaling_off",
    "seed_generators",
    "set_initial_epoch",
    "set_model_strategy",
    "set_optimizer_strategy",
    "slurm_cluster_resolver_module",
    "strategy_supports_no_merge_call",
    "symbolic_build",
    "tensor_producer",
    "tensorflow_trainer_class",
    "tensorflow_variable_class",
    "tf_function_class",
    "trackable_base",
    "train_validation_split",
    "uses_default_step",
    "variable_strategy",
    "watch_epoch_iterators",
    "watch_gradient_targets",
    "watch_loss_reductions",
    "xplane_pb2",
]


# -- instances ------------------------------------------------------------------------------
def register_same_name(made: type, cls: type) -> None:
    """Makes Keras's saving record ``made`` under ``cls``'s registered name.

    ``keras.saving`` records an object's class by ``get_registered_name(type(obj))``, looked up
    by class object in ``GLOBAL_CUSTOM_NAMES``: a registered model class (KerasHub's are,
    as ``keras_hub>GPT2CausalLM``) would be saved under the bare class name by its prepared
    subclass, and not load. Only the name is registered: loading still finds ``cls``.
    """
    from keras.src.saving import object_registration

    names = object_registration.GLOBAL_CUSTOM_NAMES
    if cls in names:
        names[made] = names[cls]


# -- Keras models ---------------------------------------------------------------------------
def set_model_strategy(model: Any, strategy: Any) -> None:
    """``model._distribute_strategy``: the strategy Keras's ``fit`` distributes with.

    Keras records the strategy whose scope was active when the model was created; a model
    moved into another strategy's scope must say so, or ``fit`` keeps the old one.
    """
    model._distribute_strategy = strategy


def in_symbolic_build() -> bool:
    """Whether Keras is tracing for shapes only (``compute_output_spec``: a model's build, a
    functional call on ``KerasTensor``s), where no gradient is ever taken (private:
    ``keras.src.backend.common.symbolic_scope.in_symbolic_scope``)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return bool(in_symbolic_scope())


def symbolic_build(model: Any, data_batch: Any) -> None:
    """``model._symbolic_build``: creates the model's, metrics' and optimizer's variables.

    What Keras's own ``fit`` runs before its first step (``_maybe_symbolic_build``), called
    here with one replica's batch because Keras's version reduces a distributed batch with
    ``strategy.reduce``, which fails under MultiWorkerMirroredStrategy
    ("Attempt to convert a value (PerReplica...)", keras-team/keras#20585).
    """
    model._symbolic_build(data_batch=data_batch)


def epoch_iterator_dataset(epoch_iterator: Any) -> Any:
    """The dataset behind Keras's ``TFEpochIterator`` (``_distributed_dataset``)."""
    return epoch_iterator._distributed_dataset


class _MadeFrom:
    """What a watched ``EpochIterator._get_iterator`` returns: Keras only calls ``iter`` on it,
    which makes the iterator as Keras would and hands it to the watcher first."""

    def __init__(self, data: Any, made: Callable[[Any], None]) -> None:
        self._data = data
        self._made = made

    def __iter__(self) -> Any:
        iterator = iter(self._data)
        self._made(iterator)
        return iterator


def watch_epoch_iterators(epoch_iterator: Any, made: Callable[[Any], None]) -> None:
    """Hands ``made`` every iterator Keras's ``EpochIterator`` makes over its data, as it
    makes it (``iter(self._get_iterator())``: each epoch's, each ``evaluate``'s).

    ``_get_iterator`` is replaced on this one instance. The replacement reaches the instance
    through a weak reference, so it adds no reference cycle: the epoch iterator is still
    freed the moment its last reference goes.
    """
    owner = weakref.ref(epoch_iterator)
    data_of = type(epoch_iterator)._get_iterator

    def get_iterator() -> _MadeFrom:
        return _MadeFrom(data_of(owner()), made)

    epoch_iterator._get_iterator = get_iterator


def forget_learned_epoch_length(epoch_iterator: Any) -> None:
    """Makes Keras's ``EpochIterator`` count the next epoch's batches again.

    For an input of unknown length Keras learns an epoch's length from the first epoch that
    ends (``_num_batches = _steps_seen`` in ``catch_stop_iteration``) and runs that many
    steps in every later epoch. A resumed epoch (its first batches skipped) is shorter than
    the others, so it must not be learned from. Inputs of known length are left alone.
    """
    if epoch_iterator.data_adapter.num_batches is None:
        epoch_iterator._num_batches = None


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """``model._initial_epoch``: the epoch ``fit`` starts at, as BackupAndRestore sets it."""
    model._initial_epoch = epoch


def flatten_layers(model: Any, include_self: bool = True) -> list[Any]:
    """``Layer._flatten_layers``: every layer nested in ``model``, recursively."""
    return list(model._flatten_layers(include_self=include_self, recursive=True))


def seed_generators(model: Any) -> list[Any]:
    """``Layer._seed_generators``: every ``keras.random.SeedGenerator`` the model's layers (and
    the model itself) track, each once.

    Keras has no public list of them; the random ops of a step draw their seeds from these.
    """
    found: dict[int, Any] = {}
    for layer in flatten_layers(model):
        for generator in getattr(layer, "_seed_generators", ()):
            found.setdefault(id(generator), generator)
    return list(found.values())


def tensorflow_trainer_class() -> Any:
    """The TensorFlow backend's trainer class, a base of ``keras.Model``, which defines or
    inherits Keras's own ``train_step``, ``compute_loss``, ``get_metrics_result``...

    It lives in ``keras/src/backend/tensorflow/trainer.py`` under two names: ``TensorFlowTrainer``
    up to Keras 3.15, ``Trainer`` from Keras 3.16's pre-releases on (keras-nightly
    3.16.0.dev2026102704, ``make test-next``), where ``keras/src/models/model.py`` imports it.
    """
    from keras.src.backend.tensorflow import trainer

    found = getattr(trainer, "TensorFlowTrainer", None)
    return found if found is not None else trainer.Trainer


def uses_default_step(model: Any, name: str) -> bool:
    """Whether ``model``'s class keeps Keras's own method ``name`` (``train_step``,
    ``test_step``, ``compute_loss``, ``compute_metrics``, ``get_metrics_result``...).

    Compared with the TensorFlow backend's trainer class, which defines or inherits them.
    """
    # A prepared model's class wraps its own (training.modelclass): judge the model's class.
    cls = type(model)
    own = getattr(cls.__dict__.get("_tfscale_model_class", cls), name, None)
    return own is getattr(tensorflow_trainer_class(), name)


def reduce_per_replica(values: Any, strategy: Any) -> Any:
    """Keras's reduction of a step's per-replica outputs to one value each (mean).

    Used for what a custom ``train_step`` returns beyond the model's metrics, so those values
    reach callbacks exactly as under ``model.fit``.
    """
    from keras.src.backend.tensorflow.trainer import reduce_per_replica as reduce

    return reduce(values, strategy, reduction="auto")


def is_array_input(x: Any, y: Any, sample_weight: Any) -> bool:
    """Whether Keras reads ``(x, y, sample_weight)`` with its array adapter (slices arrays)."""
    from keras.src.trainers.data_adapters.array_data_adapter import can_convert_arrays

    return bool(can_convert_arrays((x, y, sample_weight)))


def lists_to_tuples(structure: Any) -> Any:
    """``keras.src.tree.lists_to_tuples``: how Keras's array adapter hands nested inputs on."""
    from keras.src import tree

    return tree.lists_to_tuples(structure)


def train_validation_split(arrays: Any, validation_split: float) -> tuple[Any, Any]:
    """Keras's own split of arrays for ``validation_split`` (the last part validates)."""
    from keras.src.trainers.data_adapters.array_slicing import train_validation_split as split

    return split(arrays, validation_split=validation_split)  # type: ignore[no-any-return]


def model_strategy(model: Any) -> Any:
    """``Model._distribute_strategy``: the strategy whose scope the model was built in.

    Keras 3 records it on the model and trains with it; there is no public getter. None
    when the model was built outside any scope. (``scope.check_scope`` / ``fix_scope``.)
    """
    return getattr(model, "_distribute_strategy", None)


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


# -- Keras variables and optimizers ---------------------------------------------------------
def reinitialize_variable(variable: Any, value: Any) -> None:
    """``keras.Variable._initialize``: re-creates the ``tf.Variable`` behind a Keras variable.

    Called inside ``strategy.scope()``, the new ``tf.Variable`` is distributed (mirrored, or
    sync-on-read for metrics) with the variable's own aggregation and synchronization, while
    the Keras variable object, which layers, optimizers and checkpoints refer to, stays the
    same. Keras has no public way to move an existing model into a strategy.
    """
    variable._initialize(value)


def distributed_container(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras variable (``keras.Variable.value`` is public)."""
    return getattr(variable, "value", variable)


def backing_variable(variable: Any) -> Any:
    """``keras.Variable._value``: the ``tf.Variable`` holding a Keras variable's value.

    The public ``.value`` may return an autocast copy, not the variable; moving a weight to
    another device needs the variable itself. None where there is none. (``placement.py``.)
    """
    return getattr(variable, "_value", None)


def set_optimizer_strategy(optimizer: Any, strategy: Any) -> None:
    """``optimizer._distribution_strategy``: the strategy a Keras TF optimizer updates with.

    Keras's TF optimizer records the strategy current when it was created and uses it to
    place its slots and to run its update; an optimizer moved into a strategy must say so.
    """
    if hasattr(optimizer, "_distribution_strategy"):
        optimizer._distribution_strategy = strategy


def optimizer_variable_key(optimizer: Any, variable: Any) -> Any:
    """``optimizer._var_key``: the key a Keras optimizer files a variable under.

    Keras's TensorFlow optimizer keys its tables (which slot belongs to which weight, which
    weights skip weight decay) by the ``tf.Variable`` behind each Keras variable, not by the
    Keras variable: re-creating that ``tf.Variable`` (``reinitialize_variable``) changes it.
    """
    return optimizer._var_key(variable)


def optimizers_chosen(optimizer: Any, variables: Sequence[Any]) -> list[Any]:
    """``MultiOptimizer._optimizer_map``: the optimizer its map picks for each variable.

    A ``MultiOptimizer`` (Keras 3.15) given a function learns its optimizers only as its
    ``build`` asks the function, variable by variable, and builds each at once; asking it the
    same first is the only way to reach them before they create their variables. Empty for
    any other optimizer.
    """
    choose = getattr(optimizer, "_optimizer_map", None)
    if choose is None or not callable(choose):
        return []
    return [choose(variable) for variable in variables]


def rekey_optimizer(optimizer: Any, keys: dict[Any, Any]) -> None:
    """Re-files every table of ``optimizer`` keyed by ``_var_key`` under the new keys.

    ``keys`` maps each moved variable's old key to its new one. The tables are the dict and
    set attributes holding such keys: ``_trainable_variables_indices`` (without which a built
    optimizer refuses its own weights: "Unknown variable ... can only be called for the
    variables it was originally built with"), ``_exclude_from_weight_decay`` and its cache
    (without which an excluded weight would silently decay), and any other Keras keeps the
    same way (``MultiOptimizer``'s ``_var_to_optimizer_idx``). Each is changed in place, so
    Keras's tracking wrappers stay.
    """
    for value in list(vars(optimizer).values()):
        if isinstance(value, dict) and any(key in keys for key in value):
            items = list(value.items())
            value.clear()
            value.update({keys.get(key, key): item for key, item in items})
        elif isinstance(value, set) and any(key in keys for key in value):
            members = list(value)
            value.clear()
            value.update({keys.get(key, key) for key in members})


def disable_builtin_all_reduce(optimizer: Any) -> None:
    """Makes a Keras TF optimizer apply gradients as given, without all-reducing them.

    Keras 3's TensorFlow optimizer sums gradients over replicas inside ``apply`` whenever it
    runs in a replica context (``_backend_update_step`` -> ``_all_reduce_sum_gradients``) and
    has no switch to turn it off (tf.keras had ``experimental_aggregate_gradients``;
    keras-team/keras#19308 asks for it back). tfscale reduces the gradients itself, once per
    update, before the optimizer sees them.
    """
    if hasattr(type(optimizer), "_all_reduce_sum_gradients"):
        registry.replace("optimizer-all-reduce-off", optimizer, "_all_reduce_sum_gradients", list)


# The per-call settings of the switches below (``builtin_all_reduce_replaced``,
# ``replica_count_scaling_off``, ``atomic_variable_updates``): the Keras names are replaced
# through the registry while a switch is entered anywhere, by layers that read these
# variables and otherwise do what Keras's own did, so that a thread that did not enter a
# switch (another fit, a plain Keras loop) sees Keras's own behaviour.
_ALL_REDUCE_REPLACEMENT: contextvars.ContextVar[Callable[[Any, Any], Any] | None] = (
    contextvars.ContextVar("tfscale_all_reduce_replacement", default=None)
)
_PER_REPLICA_LOSSES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tfscale_per_replica_losses", default=False
)


class BatchTotals(Protocol):
    """What one replica's step knows of the whole batch (``replica_count_scaling_off``)."""

    def examples_ratio(self) -> Any:
        """The batch's examples over this replica's (a scalar tensor; 0 where it has none)."""

    def known_examples_ratio(self) -> Any:
        """:meth:`examples_ratio`, or None where it cannot be made (inside an XLA-compiled
        step, unless made before it)."""

    def total(self, value: Any) -> Any:
        """The sum of a scalar ``value`` over every replica of the step; None where it
        cannot be made (inside an XLA-compiled step)."""


# While ``replica_count_scaling_off`` is entered with them: the step's ``BatchTotals``.
_BATCH_TOTALS: contextvars.ContextVar[BatchTotals | None] = contextvars.ContextVar(
    "tfscale_batch_totals", default=None
)


@contextlib.contextmanager
def _switched(
    setting: contextvars.ContextVar[Any], value: Any, releases: list[Callable[[], None]]
) -> Iterator[None]:
    """``setting`` is ``value`` in this thread while active; then the switches' installs (the
    ``releases`` of their ``registry.install``) are let go."""
    token = setting.set(value)
    try:
        yield
    finally:
        setting.reset(token)
        for release in releases:
            release()


def _all_reduce_switch(keras: Callable[..., Any]) -> Callable[..., Any]:
    def switched(self: Any, grads_and_vars: Any) -> Any:
        replacement = _ALL_REDUCE_REPLACEMENT.get()
        if replacement is None:
            return keras(self, grads_and_vars)
        return replacement(self, grads_and_vars)

    return switched


@contextlib.contextmanager
def builtin_all_reduce_replaced(replacement: Callable[[Any, Any], Any]) -> Iterator[None]:
    """Replaces ``TFOptimizer._all_reduce_sum_gradients`` while active, in this thread.

    Optimizers prepared by tfscale override it on the instance
    (:func:`disable_builtin_all_reduce`), which wins; any other optimizer reaching its
    built-in all-reduce calls ``replacement(optimizer, grads_and_vars)`` instead. Only code
    running in the thread that entered this sees it: enter it inside the replica function
    (MirroredStrategy runs each replica in a thread of its own).
    """
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    release = registry.install(
        "all-reduce-switch", TFOptimizer, "_all_reduce_sum_gradients", _all_reduce_switch
    )
    with _switched(_ALL_REDUCE_REPLACEMENT, replacement, [release]):
        yield


def optimizer_trainable_variables(optimizer: Any) -> list[Any]:
    """``optimizer._trainable_variables``: what ``apply(grads)`` without variables updates."""
    return list(optimizer._trainable_variables)


def optimizer_base_variables(optimizer: Any) -> list[Any]:
    """``optimizer._iterations`` and ``optimizer._learning_rate`` where it is a variable: the
    state a Keras optimizer has before it is built (not a slot of any weight)."""
    import keras

    rate = optimizer._learning_rate
    return [optimizer._iterations, *([rate] if isinstance(rate, keras.Variable) else [])]


def optimizer_clip_gradients(optimizer: Any, grads: list[Any]) -> list[Any]:
    """``optimizer._clip_gradients``: the optimizer's ``clipnorm`` / ``clipvalue`` /
    ``global_clipnorm`` applied to ``grads``, as its ``apply`` would (sharded state applies
    the optimizer's update without its ``apply``: ``training/sharding.py``)."""
    return list(optimizer._clip_gradients(grads))


def optimizer_uses_weight_decay(optimizer: Any, variable: Any) -> bool:
    """``optimizer._use_weight_decay``: whether the optimizer decays ``variable`` (Keras's
    ``exclude_from_weight_decay`` by variable and by name pattern)."""
    return bool(optimizer._use_weight_decay(variable))


def nadam_momentum_product(optimizer: Any) -> Any:
    """``Nadam._u_product``: the product of momentum factors Nadam advances once per update."""
    return optimizer._u_product


def replace_checkpoint_children(trackable: Any, replaced: dict[str, Any]) -> None:
    """Makes checkpoints see ``replaced[name]`` as ``trackable``'s child ``name``
    (``Trackable._trackable_children``, which saving and restoring both read).

    A sharded optimizer's ``_variables`` holds only its base state; its checkpoint must hold
    the whole slots under that same child, whether reached as ``optimizer`` or as
    ``model.optimizer`` (one object in the checkpoint's graph), so the checkpoint is the
    unsharded optimizer's (``training/sharding.py``).
    """
    original = type(trackable)._trackable_children.__get__(trackable)

    def children(*args: Any, **kwargs: Any) -> dict[str, Any]:
        found = dict(original(*args, **kwargs))
        found.update(replaced)
        return found

    registry.replace("sharded-optimizer", trackable, "_trackable_children", children)


def trackable_base() -> Any:
    """``tf.__internal__.tracking.Trackable``: the base of an object that a checkpoint saves
    through ``_serialize_to_tensors`` / ``_restore_from_tensors`` (sharded optimizer slots,
    saved whole)."""
    import tensorflow as tf

    return tf.__internal__.tracking.Trackable


def autocast_dtype() -> Any:
    """The dtype Keras casts float variables to where they are read now (a mixed policy's
    compute dtype inside a layer's ``__call__``), or None.

    ``keras.src.backend.common.variables.get_autocast_scope``: remat recomputes a layer's call
    in the backward pass, outside that layer's ``__call__`` and its autocast scope, and reads
    its variables there (``training/layercalls.py``).
    """
    from keras.src.backend.common.variables import get_autocast_scope

    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


def autocast(dtype: Any) -> Any:
    """``keras.src.backend.common.variables.AutocastScope(dtype)``: float variables read as
    ``dtype`` inside it (None: as they are)."""
    from keras.src.backend.common.variables import AutocastScope

    return AutocastScope(dtype)


# -- Keras layers' added losses ------------------------------------------------------------
# While ``losses_per_replica`` is entered in this thread: each layer's losses added in it
# (``add_loss``), by layer (weakly: a layer gone takes its entry along, and a new one never
# meets the entry of a gone one with its id, in a thread that outlives both).
_Own = weakref.WeakKeyDictionary  # layer -> its losses added in this thread
_REPLICA_LOSSES: contextvars.ContextVar[_Own[Any, list[Any]] | None] = contextvars.ContextVar(
    "tfscale_replica_losses", default=None
)
# While ``losses_per_thread`` is held (a prepared custom loop lives): each thread's own.
_THREAD_LOSSES = threading.local()
_THREAD_HOLDS = [0]


def _own_list() -> _Own[Any, list[Any]] | None:
    own = _REPLICA_LOSSES.get()
    if own is None and _THREAD_HOLDS[0] > 0:
        own = getattr(_THREAD_LOSSES, "losses", None)
        if own is None:
            own = _THREAD_LOSSES.losses = weakref.WeakKeyDictionary()
    return own


def per_replica_losses_active() -> bool:
    """Whether this thread is inside :func:`replica_count_scaling_off` (tracing one of
    tfscale's replica steps, train or test)."""
    return bool(_PER_REPLICA_LOSSES.get())


def _in_stateless_scope() -> bool:
    from keras.src import backend

    return bool(backend.in_stateless_scope())


def _add_loss_switch(keras: Callable[..., Any]) -> Callable[..., Any]:
    def switched(self: Any, loss: Any) -> Any:
        keras(self, loss)
        own = _own_list()
        if own is not None and not _in_stateless_scope():
            import keras as keras_module

            own.setdefault(self, []).extend(keras_module.tree.flatten(loss))

    return switched


def _own_losses_switch(keras: Callable[..., Any]) -> Callable[..., Any]:
    def switched(self: Any) -> Any:
        own = _own_list()
        if own is None or _in_stateless_scope():
            return keras(self)
        return list(own.get(self, ()))

    return switched


def _clear_losses_switch(keras: Callable[..., Any]) -> Callable[..., Any]:
    def switched(self: Any) -> Any:
        keras(self)  # clears the sub-layers through this switch too (their class's method)
        own = _own_list()
        if own is not None:
            own.pop(self, None)

    return switched


@contextlib.contextmanager
def losses_per_replica() -> Iterator[None]:
    """Makes the losses layers add (``add_loss``, activity regularizers) while this is active,
    in this thread, this thread's own.

    A Keras layer keeps its added losses in one list (``Layer._losses``), which
    MirroredStrategy's replica threads share while they trace one step. A thread runs until
    it reaches a ``merge_call``, so where one sits inside the forward pass (a synchronized
    BatchNormalization's all-reduce, ``global_load_balancing``'s gather) the threads
    interleave there: a replica that enters the model clears the losses another already
    added (its gradient then lacks them: a penalty before a synchronized BatchNormalization
    trained 5e-3 away from one device), and a replica reading its losses gets every earlier
    replica's too (the reported loss counts them twice; Keras's own fit under a strategy
    does both). While this is active, ``add_loss``, a layer's own losses and their clearing
    read and write a list of this thread's.
    """
    with _switched(_REPLICA_LOSSES, weakref.WeakKeyDictionary(), _install_losses_switches()):
        yield


def _install_losses_switches() -> list[Callable[[], None]]:
    layer = keras_layer_class()
    return [
        registry.install("replica-losses", layer, name, switch)
        for name, switch in (
            ("add_loss", _add_loss_switch),
            ("_get_own_losses", _own_losses_switch),
            ("_clear_losses", _clear_losses_switch),
        )
    ]


def losses_per_thread() -> Callable[[], None]:
    """Makes every thread's added losses its own (as :func:`losses_per_replica` does in
    tfscale's step) until the returned release is called: held while a prepared custom loop
    lives, whose replicas run in threads tfscale does not start (the user's
    ``strategy.run``). A penalty before a synchronized BatchNormalization was cleared by the
    other replica there too (2e-2 from one device's weights, under TensorFlow alone as well).
    In a single thread nothing changes: its losses are its own either way."""
    releases = _install_losses_switches()
    with _WATCH_LOCK:
        _THREAD_HOLDS[0] += 1
    released = [False]

    def release() -> None:
        with _WATCH_LOCK:
            if released[0]:
                return
            released[0] = True
            _THREAD_HOLDS[0] -= 1
        for each in releases:
            each()

    return release


def losses_kept_per_thread() -> bool:
    """Whether :func:`losses_per_thread` is held now (a prepared custom loop or prepared
    model alive somewhere in the process): then every thread's added losses are its own,
    also in code tfscale was not handed."""
    with _WATCH_LOCK:
        return _THREAD_HOLDS[0] > 0


def keras_layer_class() -> Any:
    """``keras.src.layers.layer.Layer``, which defines ``add_loss``, ``_get_own_losses`` and
    ``_clear_losses`` (:func:`losses_per_replica`); ``keras.layers.Layer`` is the backend's
    subclass of it."""
    from keras.src.layers.layer import Layer

    return Layer


# -- Keras losses ---------------------------------------------------------------------------
def keras_loss_module() -> Any:
    """``keras.src.losses.loss``, home of the replica-count scaling of losses."""
    from keras.src.losses import loss

    return loss


def _loss_scaling_switch(keras: Callable[..., Any]) -> Callable[..., Any]:
    def switched(value: Any, *args: Any, **kwargs: Any) -> Any:
        return value if _PER_REPLICA_LOSSES.get() else keras(value, *args, **kwargs)

    return switched


def _batch_reduction_switch(keras: Callable[..., Any]) -> Callable[..., Any]:
    def switched(
        values: Any, sample_weight: Any = None, reduction: str = "sum_over_batch_size"
    ) -> Any:
        loss = keras(values, sample_weight, reduction)
        # Keras returns ``values`` themselves where nothing is reduced (no reduction, or a
        # scalar the loss function reduced itself): those stay per-replica means.
        if tuple(values.shape) in ((), (0,)):
            return loss
        if reduction == "sum":
            return as_batch_sum(loss)
        if reduction == "mean_with_sample_weight" and sample_weight is not None:
            # Keras divides by this replica's sum of weights; one device by the batch's.
            return _share_of_batch(loss, sample_weight)
        return loss

    return switched


def _masked_mean_switch(keras: Callable[..., Any]) -> Callable[..., Any]:
    def switched(
        values: Any,
        sample_weight: Any = None,
        mask: Any = None,
        reduction: Any = "sum_over_batch_size",
        dtype: Any = None,
    ) -> Any:
        loss = keras(values, sample_weight, mask, reduction, dtype)
        # A mask makes a mean divide by this replica's unmasked entries (Keras's apply_mask:
        # weights of total / valid); one device divides by the batch's.
        if mask is None or reduction not in ("mean", "sum_over_batch_size"):
            return loss
        if tuple(getattr(values, "shape", ())) in ((), (0,)):
            return loss
        return _share_of_batch(loss, mask)

    return switched


def _share_of_batch(loss: Any, weights: Any) -> Any:
    """``loss``, a mean divided by this replica's sum of ``weights`` (its sample weights or
    its unmasked entries), made its share of the batch's: times that sum over the batch's,
    then as a sum (:func:`as_batch_sum`). Unchanged without the step's totals, or where the
    batch's sum cannot be made (inside an XLA-compiled step: each replica's own mean, as
    Keras's own fit under a strategy gives)."""
    totals = _BATCH_TOTALS.get()
    if totals is None:
        return loss
    import tensorflow as tf

    local = tf.reduce_sum(tf.cast(weights, loss.dtype))
    total = totals.total(local)
    if total is None:
        return loss
    return as_batch_sum(loss * tf.math.divide_no_nan(local, tf.cast(total, loss.dtype)))


def batch_examples_ratio() -> Any:
    """The batch's examples over this replica's (a scalar tensor, 0 where it has none) in the
    step :func:`replica_count_scaling_off` is entered with ``totals`` for; None elsewhere and
    inside a step compiled with XLA, where no all-reduce can run."""
    totals = _BATCH_TOTALS.get()
    return None if totals is None else totals.known_examples_ratio()


def as_batch_sum(value: Any) -> Any:
    """``value``, this replica's sum over its share of the batch, made the per-replica mean
    that tfscale's weighing by examples turns into the batch's sum: times the batch's
    examples over the replica's, while :func:`replica_count_scaling_off` is entered with
    ``totals``; else ``value`` itself (see there)."""
    totals = _BATCH_TOTALS.get()
    if totals is None:
        return value
    import tensorflow as tf

    return value * tf.cast(totals.examples_ratio(), value.dtype)


@contextlib.contextmanager
def replica_count_scaling_off(totals: BatchTotals | None = None) -> Iterator[None]:
    """Lets losses computed while this is active, in this thread, be per-replica means.

    Under a strategy with N replicas Keras divides each ``Loss`` result and the sum of the
    model's extra losses by N (``scale_loss_for_distribution``) and multiplies the loss
    metric back (``unscale_loss_for_distribution``), so that summing gradients over replicas
    gives the mean. A ``compute_loss`` override or a ``train_step`` that computes its own
    loss is scaled once, twice or never depending on how it was written, and an uneven split
    of a batch is weighted wrongly (tensorflow/tensorflow#42446). tfscale instead weights
    each replica by its example count in its own all-reduce, so every loss must be the plain
    per-replica value while the step is traced. Only code running in the thread that entered
    this sees it: enter it inside the replica function (MirroredStrategy runs each replica in
    a thread of its own); other threads keep Keras's scaling.

    Three Keras reductions, and masked means, are not per-replica means. ``reduction="sum"`` is
    the sum over the batch: Keras leaves it unscaled, so summing gradients over replicas gives
    one device's; weighed by examples as a mean, it gave one device's divided by N (0.41 apart
    on a small regressor, 2 replicas, ``tests/training/test_equivalence.py``).
    ``"mean_with_sample_weight"`` divides by the sum of the replica's sample weights, one device
    by the batch's (Keras's own fit under a strategy too: 0.05 apart on a small regressor), and
    a mean under a mask by the replica's unmasked entries. With ``totals`` given, a sum is
    multiplied by the batch's examples over the replica's, which tfscale's weighing turns back
    into the batch's sum, and a weighted or masked mean is first made this replica's share of
    the batch's (one scalar all-reduce of the weights or the unmasked entries).
    """
    module = keras_loss_module()
    releases = [
        registry.install("loss-scaling-switch", module, name, _loss_scaling_switch)
        for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution")
    ]
    releases.append(
        registry.install("loss-scaling-switch", module, "reduce_values", _batch_reduction_switch)
    )
    releases.append(
        registry.install(
            "loss-scaling-switch", module, "reduce_weighted_values", _masked_mean_switch
        )
    )
    token = _BATCH_TOTALS.set(totals)
    try:
        with _switched(_PER_REPLICA_LOSSES, True, releases):
            yield
    finally:
        _BATCH_TOTALS.reset(token)


def tensorflow_variable_class() -> Any:
    """The TensorFlow backend's ``Variable`` class, the base of ``keras.Variable`` whose
    ``assign_add`` / ``assign_sub`` ``atomic_variable_updates`` switches.

    Read from the backend package, which exports it in every version: its module moved from
    ``keras/src/backend/tensorflow/core.py`` (up to Keras 3.15) to
    ``keras/src/backend/tensorflow/ops/core.py`` (Keras 3.16's pre-releases, ``make test-next``).
    """
    from keras.src.backend import tensorflow

    return tensorflow.Variable


_ATOMIC_UPDATES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tfscale_atomic_updates", default=False
)


def _atomic_switch(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def layer(keras: Callable[..., Any]) -> Callable[..., Any]:
        from keras.src.backend.common.stateless_scope import in_stateless_scope

        def switched(self: Any, value: Any) -> Any:
            if not _ATOMIC_UPDATES.get() or in_stateless_scope():
                return keras(self, value)
            import tensorflow as tf

            backing = self._value
            return getattr(backing, name)(tf.cast(value, backing.dtype))

        return switched

    return layer


_ATOMIC_LAYERS = {name: _atomic_switch(name) for name in ("assign_add", "assign_sub")}


@contextlib.contextmanager
def atomic_variable_updates() -> Iterator[None]:
    """Makes ``keras.Variable.assign_add`` / ``assign_sub`` one atomic update, in this thread.

    Keras's are ``self.assign(self + value)`` (``keras/src/backend/common/variables.py``): a
    read, then a write. Where several workers update the same variable at once (metrics and
    ``optimizer.iterations`` on a parameter server), an update made between another's read
    and write is lost (measured: 144 of 256 examples counted by a metric over 2 workers).
    Inside this, they are the backing ``tf.Variable``'s own ``assign_add`` / ``assign_sub``
    (AssignAddVariableOp, which holds the variable's lock). Enter it inside the replica
    function: only code traced in the thread that entered it sees it.
    """
    releases = [
        registry.install("atomic-updates", tensorflow_variable_class(), name, layer)
        for name, layer in _ATOMIC_LAYERS.items()
    ]
    with _switched(_ATOMIC_UPDATES, True, releases):
        yield


_WATCH_LAYERS: dict[Any, Callable[[Callable[..., Any]], Callable[..., Any]]] = {}
_WATCH_LOCK = threading.Lock()


def _gradient_layer(callback: Callable[[Any, Any], None]) -> Callable[..., Any]:
    def layer(original: Callable[..., Any]) -> Callable[..., Any]:
        def gradient(self: Any, target: Any, sources: Any, *args: Any, **kwargs: Any) -> Any:
            callback(target, sources)
            return original(self, target, sources, *args, **kwargs)

        return gradient

    return layer


def watch_gradient_targets(callback: Callable[[Any, Any], None]) -> Callable[[], None]:
    """Calls ``callback(target, sources)`` before every ``tf.GradientTape.gradient`` until
    the returned release is called (the registry's ``gradient-watch``).

    A custom training loop computes its loss in the user's code: this is where tfscale sees
    which loss a replica differentiates (``training/conventions.py``), so that the
    distributed update can weigh the gradient as one device's. TensorFlow has no public hook
    on a tape's target. A callback that raises stops the ``gradient`` call with its error.
    One callback watched several times is called once per gradient.
    """
    import tensorflow as tf

    with _WATCH_LOCK:
        layer = _WATCH_LAYERS.setdefault(("gradient", callback), _gradient_layer(callback))
    return registry.install("gradient-watch", tf.GradientTape, "gradient", layer)


def _reduction_layer(
    callback: Callable[[str, Any, Any, dict[str, Any]], None], name: str
) -> Callable[..., Any]:
    def layer(original: Callable[..., Any]) -> Callable[..., Any]:
        def reduction(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            callback(name, output, args, kwargs)
            return output

        return reduction

    return layer


def watch_loss_reductions(
    callback: Callable[[str, Any, Any, dict[str, Any]], None],
) -> Callable[[], None]:
    """Calls ``callback(name, output, args, kwargs)`` after each loss reduction that scales
    by the replica count or the global batch, until the returned release is called (the
    registry's ``reduction-watch``).

    ``name`` is ``"keras_scale"`` (``keras.src.losses.loss.scale_loss_for_distribution``,
    which a Keras ``Loss`` object's mean goes through: divided by the replica count),
    ``"compute_average_loss"`` or ``"scale_regularization_loss"`` (``tf.nn``'s). The module
    attributes are replaced, which is how user code and Keras's ``reduce_values`` look them
    up; the watch sits above or below ``replica_count_scaling_off``'s switch, whichever came
    first (the callback sees which by the output).
    """
    import tensorflow as tf

    targets = [
        (keras_loss_module(), "scale_loss_for_distribution", "keras_scale"),
        (tf.nn, "compute_average_loss", "compute_average_loss"),
        (tf.nn, "scale_regularization_loss", "scale_regularization_loss"),
    ]
    releases = []
    for owner, attribute, name in targets:
        with _WATCH_LOCK:
            layer = _WATCH_LAYERS.setdefault(
                ("reduction", callback, name), _reduction_layer(callback, name)
            )
        releases.append(registry.install("reduction-watch", owner, attribute, layer))

    def release() -> None:
        for each in releases:
            each()

    return release


# -- KerasHub -------------------------------------------------------------------------------
# The KerasHub function every mixture-of-experts decoder of KerasHub 0.32 calls (Mixtral,
# QwenMoe, Qwen3Moe, Qwen3.5-MoE), each module with its own copy, looked up in the module's
# globals at each call: ``compute_load_balancing_loss(router_logits, num_experts, top_k,
# attention_mask)`` (``router_logits``: one row per token of the batch).
_LOAD_BALANCING = "compute_load_balancing_loss"
_KERAS_HUB_MODELS = "keras_hub.src.models."

# While ``load_balancing_over_the_batch`` is entered: how to gather a tensor's rows over the
# step's whole batch (the router logits, with a gradient; a mask, without).
_BATCH_GATHER: contextvars.ContextVar[tuple[Callable[[Any], Any], Callable[[Any], Any]] | None] = (
    contextvars.ContextVar("tfscale_batch_gather", default=None)
)


def load_balancing_modules() -> list[Any]:
    """The imported KerasHub modules that define ``compute_load_balancing_loss`` with the
    signature above (``keras_hub.src.models.<model>.<model>_decoder``)."""
    import inspect
    import sys

    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(_KERAS_HUB_MODELS):
            continue
        function = getattr(module, _LOAD_BALANCING, None)
        if function is None or not callable(function):
            continue
        try:
            parameters = list(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            continue
        if parameters[:4] == ["router_logits", "num_experts", "top_k", "attention_mask"]:
            found.append(module)
    return found


def _load_balancing_switch(keras_hub: Callable[..., Any]) -> Callable[..., Any]:
    def switched(
        router_logits: Any, num_experts: Any, top_k: Any, attention_mask: Any = None
    ) -> Any:
        gathers = _BATCH_GATHER.get()
        if gathers is not None:
            with_gradient, without_gradient = gathers
            router_logits = with_gradient(router_logits)
            if attention_mask is not None:
                attention_mask = without_gradient(attention_mask)
        return keras_hub(
            router_logits=router_logits,
            num_experts=num_experts,
            top_k=top_k,
            attention_mask=attention_mask,
        )

    return switched


@contextlib.contextmanager
def load_balancing_over_the_batch(
    with_gradient: Callable[[Any], Any], without_gradient: Callable[[Any], Any]
) -> Iterator[None]:
    """Makes KerasHub's load-balancing losses, computed in this thread while active, the
    loss of the step's whole batch, as on one device.

    A mixture-of-experts layer adds ``coefficient * E * sum_e f_e * P_e`` (``f_e``: the share
    of the batch's tokens routed to expert e, ``P_e``: its mean router probability), a
    product of two means over the tokens of the batch it is given: under a strategy each
    replica balances its own share (Keras's own fit too; a tiny Mixtral ends 0.30 apart
    from one device after 10 steps). While this is active, ``compute_load_balancing_loss``
    reads the router logits and the attention mask of every replica's tokens
    (``with_gradient`` / ``without_gradient`` gather a tensor's rows over the replicas), so
    each replica computes the whole batch's loss.
    """
    releases = [
        registry.install("load-balancing", module, _LOAD_BALANCING, _load_balancing_switch)
        for module in load_balancing_modules()
    ]
    with _switched(_BATCH_GATHER, (with_gradient, without_gradient), releases):
        yield


# -- TensorFlow -----------------------------------------------------------------------------
_AUTOGRAPH_FILE = "__autograph_generated_file"


def autograph_origin(code: Any, line: int) -> tuple[str, int, str] | None:
    """The user's ``(file, line, function)`` behind a line of AutoGraph-generated code.

    A ``tf.function`` runs the user's Python converted by AutoGraph from a generated file
    (``/tmp/__autograph_generated_file*.py``); the converted function carries
    ``ag_source_map`` (``tensorflow/python/autograph/impl/api.py``), from generated
    ``LineLocation(filename, lineno)`` to an ``OriginInfo`` whose ``loc`` is the user's.
    Found through the function object that owns ``code``. None for other code or when
    the map has no entry. (``scope.creation_stack``: where a step created a variable.)
    """
    generated: str = getattr(code, "co_filename", "")
    if _AUTOGRAPH_FILE not in generated:
        return None
    import gc

    for owner in gc.get_referrers(code):
        source_map = getattr(owner, "ag_source_map", None)
        if getattr(owner, "__code__", None) is not code or not source_map:
            continue
        for location, info in source_map.items():
            if location.filename == generated and location.lineno == line:
                return str(info.loc.filename), int(info.loc.lineno), str(info.function_name)
    return None


def strategy_supports_no_merge_call() -> bool:
    """``tf.__internal__.distribute.strategy_supports_no_merge_call``.

    True where replica code may branch on a value and call the optimizer inside the branch
    (MultiWorkerMirrored); MirroredStrategy's replica threads need ``merge_call`` for that.
    """
    import tensorflow as tf

    supports: Callable[[], bool] = tf.__internal__.distribute.strategy_supports_no_merge_call
    return bool(supports())


def _batch_destination(value: Any) -> Any:
    """Where a batched collective leaves ``value``'s result: TensorFlow's own choice in
    ``ReplicaContext.all_reduce`` / ``all_gather`` (``distribute_lib._batch_reduce_destination``):
    a plain tensor's device (one device), else the distributed value itself (each replica's)."""
    import tensorflow as tf

    return value.device if isinstance(value, tf.Tensor) else value


def all_reduce_without_gradient(context: Any, reduce_op: Any, values: Sequence[Any]) -> list[Any]:
    """``ReplicaContext.all_reduce(reduce_op, values)`` without its ``tf.custom_gradient``.

    TensorFlow wraps the all-reduce of dense tensors in a ``tf.custom_gradient``, which in a
    traced function registers a gradient function in TensorFlow's process-wide gradient
    registry that holds the result tensors, so the whole traced step (its graph, its nested
    functions, the optimizer's update on every replica) stays alive for the life of the
    process: a sweep of fresh fits of a small MLP kept about 6 MiB a fit more, and the guard's
    branch functions stayed in the eager context (tensorflow/tensorflow#97697; TensorFlow
    2.22.0rc0 frees an all-reduce's graph, not yet an all-gather's: the accessor's test in
    ``tests/interop/test_internals.py`` says when both can go). tfscale reduces gradients,
    which are never differentiated again, so the same collectives are created as TensorFlow
    creates them, minus the wrapper:
    ``merge_call`` + ``batch_reduce_to`` where the strategy needs ``merge_call``, else the
    strategy's replica-context all-reduce (private: ``_replica_ctx_all_reduce``), as
    ``ReplicaContext.all_reduce`` itself does. (``training/allreduce.py``.)
    """
    import tensorflow as tf

    if isinstance(reduce_op, str):  # "sum" / "SUM", as ReplicaContext.all_reduce takes it
        reduce_op = tf.distribute.ReduceOp(reduce_op.upper())
    values = list(values)
    strategy = context.strategy
    if strategy_supports_no_merge_call():
        return list(strategy.extended._replica_ctx_all_reduce(reduce_op, values))

    def reduce(distribution: Any, *flat: Any) -> Any:
        pairs = [(value, _batch_destination(value)) for value in flat]
        return distribution.extended.batch_reduce_to(reduce_op, pairs)

    return list(context.merge_call(reduce, args=tuple(values)))


def all_gather_without_gradient(context: Any, value: Any, axis: int) -> Any:
    """``ReplicaContext.all_gather(value, axis)`` of one dense tensor without its
    ``tf.custom_gradient`` (which keeps the traced step alive: see
    :func:`all_reduce_without_gradient`): TensorFlow's own ``merge_call`` to the strategy's
    batched gather (private: ``_batch_gather_to``). (``training/sharding.py``.)
    """

    import tensorflow as tf

    def gather(distribution: Any, flat: Any) -> Any:
        pairs = [(flat, _batch_destination(flat))]
        return distribution.extended._batch_gather_to(pairs, axis)[0]

    # TensorFlow's gather collective takes float16/32/64 and int32/64 only: a bfloat16
    # optimizer state sharded across workers travels as float32 (exact) and is cast back.
    carrier = _COLLECTIVE_CARRIERS.get(value.dtype.name)
    if carrier is None:
        return context.merge_call(gather, args=(value,))
    return tf.cast(context.merge_call(gather, args=(tf.cast(value, carrier),)), value.dtype)


def custom_gradient_names(graph: Any) -> set[str]:
    """The names under which ``tf.custom_gradient`` registered gradient functions for the ops
    of ``graph`` (a traced function's graph).

    In a traced function, ``tf.custom_gradient`` (and ``tf.recompute_grad``, built on it, whose
    backward pass is a second one) registers its gradient function in TensorFlow's
    process-wide gradient registry under a fresh name, ``CustomGradient-N``, which the
    ``IdentityN`` op that makes its outputs carries (its private ``_gradient_op_type``
    attribute). See :func:`forget_custom_gradients`.
    """
    names: set[str] = set()
    for op in graph.get_operations():
        if op.type != "IdentityN":
            continue
        try:
            name = op.get_attr("_gradient_op_type")
        except ValueError:
            continue  # an IdentityN without an overridden gradient
        names.add(name.decode() if isinstance(name, bytes) else str(name))
    return names


def forget_custom_gradients(names: set[str]) -> None:
    """Removes the gradient functions registered under ``names`` from TensorFlow's
    process-wide gradient registry (private: ``ops._gradient_registry``).

    A gradient function ``tf.custom_gradient`` registers while a function is traced closes over
    that function's tensors, so the registry keeps the whole traced graph alive for the life of
    the process (tensorflow/tensorflow#97697, the same leak as the all-reduce's: see
    :func:`all_reduce_without_gradient`); a sweep of fresh fits with ``remat=True`` kept about
    8 MiB a fit more than without. The entry is only read by symbolic gradients of that graph
    (a ``GradientTape`` uses the function it recorded), so once the step that made it is traced,
    backward pass included, nothing reads it again. (:func:`gradient_functions_released`.)
    """
    from tensorflow.python.framework import ops

    registered = ops._gradient_registry._registry
    for name in names:
        registered.pop(name, None)


@contextlib.contextmanager
def gradient_functions_released(graphs: dict[int, Any]) -> Iterator[None]:
    """While a step is traced inside: at the end, the gradient functions registered for the ops
    of the graph it is traced into, and of ``graphs`` (nested graphs that code inside adds,
    by id), leave TensorFlow's registry (:func:`forget_custom_gradients`).

    The step's own graph and its nested ones only: another thread tracing at the same time
    traces into its own graphs and keeps what it registered. The step is never differentiated
    again once traced (tfscale's step functions are called, not differentiated), so nothing
    reads those entries after the trace. A ``tf.custom_gradient`` inside a ``tf.cond`` /
    ``tf.while_loop`` branch or a nested ``tf.function`` that nobody added stays registered.
    (``training/function.py``'s step; ``training/layercalls.py`` adds remat's graphs.)
    """
    import tensorflow as tf

    if tf.inside_function():
        graph = tf.compat.v1.get_default_graph()
        graphs.setdefault(id(graph), graph)
    try:
        yield
    finally:
        for each in graphs.values():
            forget_custom_gradients(custom_gradient_names(each))


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


def per_replica_component_specs(spec: Any) -> list[Any] | None:
    """``PerReplicaSpec._value_specs``: one spec per local replica (None for other specs)."""
    components = getattr(spec, "_value_specs", None)
    return list(components) if components else None


# -- TensorFlow: the eager context ----------------------------------------------------------
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
            registry.replace("collective-setup", ctx, name, None)


# Dtypes TensorFlow's collectives cannot carry (the broadcast of initial values takes bool,
# float16/32/64 and int32/64; the gather, float16/32/64 and int32/64), each with one that
# holds its every value exactly.
_COLLECTIVE_CARRIERS = {
    "bfloat16": "float32",
    "float8_e4m3fn": "float32",
    "float8_e5m2": "float32",
    "int8": "int32",
    "uint8": "int32",
    "int16": "int32",
    "uint16": "int32",
    "uint32": "int64",
}
_CARRIED = "_get_variable_creator_initial_value"


def broadcast_any_initial_value(strategy: Any) -> None:
    """Lets ``strategy`` (a MultiWorkerMirroredStrategy of several workers) create variables
    of every dtype: ``CollectiveAllReduceExtended._get_variable_creator_initial_value``
    replaced on its ``extended`` object.

    Workaround (TF 2.21 and 2.16, reproduced in ``tests/training/test_multiworker.py``): each
    new variable's initial value is broadcast from the chief with a collective that carries
    bool, float16/32/64 and int32/64 only, so a bfloat16 model (KerasHub's LLMs in bfloat16)
    or an int8-quantized one (QLoRA) cannot be created on 2 workers: "InvalidArgumentError:
    Value for attr 'T' of bfloat16 is not in the list of allowed values". Such a value
    travels cast to a dtype that holds it exactly (float32, int32, int64) and is cast back.
    Other strategies, one worker, and a strategy already given it are left as they are.
    """
    import tensorflow as tf
    from tensorflow.python.trackable import base as trackable

    extended = getattr(strategy, "extended", None)
    if (
        not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        or getattr(extended, "_num_workers", 1) <= 1
        or _CARRIED in vars(extended)
        or not hasattr(extended, _CARRIED)
    ):
        return
    own = getattr(extended, _CARRIED)

    def initial_value(replica_id: int, device: Any, primary_var: Any, **kwargs: Any) -> Any:
        if replica_id != 0:  # the other devices of a worker copy its first one's value
            return own(replica_id, device, primary_var, **kwargs)

        def carried() -> Any:
            with tf.device(device):
                value = kwargs["initial_value"]
                if callable(value):
                    value = value()
                if isinstance(value, trackable.CheckpointInitialValue):
                    value = value.wrapped_value
                value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
            carrier = _COLLECTIVE_CARRIERS.get(value.dtype.name)
            if carrier is None:
                return own(replica_id, device, primary_var, **{**kwargs, "initial_value": value})()
            sent = own(
                replica_id,
                device,
                primary_var,
                **{**kwargs, "initial_value": tf.cast(value, carrier), "dtype": carrier},
            )()
            with tf.device(device):
                return tf.cast(sent, value.dtype)

        return carried

    registry.replace("collective-initial-values", extended, _CARRIED, initial_value)


_COORDINATION_CONFIG_MODULES = (
    "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2",  # TensorFlow 2.21
    "tensorflow.tsl.protobuf.coordination_config_pb2",  # TensorFlow 2.16 (and 2.18)
)


def coordination_config_pb2() -> Any:
    """``tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2`` (older TensorFlow:
    ``tensorflow.tsl.protobuf``): the message that configures the coordination service
    (``CoordinatedJob``); not exported by ``tf``. (``strategy/build.py``.)

    Raises:
        ModuleNotFoundError: None of the known places has it (the last place's error).
    """
    import importlib

    for name in _COORDINATION_CONFIG_MODULES[:-1]:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    return importlib.import_module(_COORDINATION_CONFIG_MODULES[-1])


# -- TensorFlow: tf.data, profiler, cluster resolvers ---------------------------------------
def dataset_batch_size(dataset: Any) -> Any:
    """``BatchDataset._batch_size``: the batch size of ``dataset.batch(n)`` without
    ``drop_remainder``, whose element spec leaves the batch dimension unknown. None for
    other datasets. (``profiling/script.py``.)
    """
    return getattr(dataset, "_batch_size", None)


def distributed_input_methods() -> list[tuple[Any, str]]:
    """``input_lib``'s ``DistributedDataset.__iter__``, ``DistributedDatasetsFromFunction.
    __iter__``, ``DistributedIteratorBase.get_next`` and ``get_next_as_optional``: where a
    distributed input makes and reads its multi-device iterators (``next(iterator)`` and
    ``for batch in dist_dataset`` go through ``get_next``), which take their strategy's turn
    while a prepared loop lives; tf.distribute has no public hook. (``training/turns.py``.)
    """
    from tensorflow.python.distribute import input_lib

    return [
        (input_lib.DistributedDataset, "__iter__"),
        (input_lib.DistributedDatasetsFromFunction, "__iter__"),
        (input_lib.DistributedIteratorBase, "get_next"),
        (input_lib.DistributedIteratorBase, "get_next_as_optional"),
    ]


def distributed_input_strategy(value: Any) -> Any:
    """``_strategy`` of a distributed dataset or iterator: the strategy whose devices it
    reads onto (None for anything else). (``training/turns.py``.)
    """
    return getattr(value, "_strategy", None)


def tf_function_class() -> Any:
    """``polymorphic_function.Function``: the class of what ``tf.function`` returns, whose
    ``__call__`` ``tfscale profile`` wraps to time a custom loop's steps (the calls of a
    ``tf.function`` whose trace called ``strategy.run``); ``tf.function`` has no public
    per-call hook. (``profiling/loopsteps.py``.)
    """
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    return polymorphic_function.Function


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
