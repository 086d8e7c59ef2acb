"""Moving an existing model into a strategy, in place.

A model built (or compiled, or trained) outside ``strategy.scope()`` has plain variables on
one device. Instead of rebuilding it as a copy (``tfscale.fix_scope``), each Keras variable
gets a new distributed ``tf.Variable`` behind it with the same value, created the way Keras
creates it (``internals.reinitialize_variable``). The model, its layers, its optimizer and
anything holding them keep the same objects, so the user's model and optimizer hold the
trained state afterwards and a second ``fit`` continues the optimizer (Adam's moments and
``iterations``) where the first stopped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.interop import internals, registry
from tfscale.training.randomness import draw_per_replica

__all__ = [
    "adopt",
    "all_variables",
    "has_call",
    "keras_accumulation_steps",
    "model_optimizers",
    "outside_variables",
    "wrapped_optimizers",
]


# keras.optimizers.MultiOptimizer is new in Keras 3.15; an empty tuple matches nothing before.
_MULTI_OPTIMIZER: Any = getattr(keras.optimizers, "MultiOptimizer", ())


def has_call(model: Any) -> bool:
    """Whether the model has a forward pass; keras-io's GAN and VAE have none (their
    ``train_step`` drives sub-models), so nothing can be built or lowered from ``model(x)``."""
    return type(model).call is not keras.Model.call


def model_optimizers(model: Any) -> list[Any]:
    """The model's optimizer and every optimizer held as one of its attributes (a GAN's)."""
    found: dict[int, Any] = {}

    def add(value: Any) -> None:
        if isinstance(value, keras.optimizers.Optimizer):
            found.setdefault(id(value), value)

    add(getattr(model, "optimizer", None))
    for value in list(vars(model).values()):
        if isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        elif isinstance(value, dict):
            for item in value.values():
                add(item)
        else:
            add(value)
    return list(found.values())


def wrapped_optimizers(optimizer: Any) -> list[Any]:
    """The optimizer and every optimizer it wraps, each once: a ``LossScaleOptimizer``'s
    ``inner_optimizer``, a ``MultiOptimizer``'s ``optimizers`` (Keras 3.15; those a callable
    map makes appear when it is built), and theirs.

    Each holds its own strategy, its own built-in all-reduce and its own tables of variables,
    so whatever tfscale sets on an optimizer it sets on each of these.
    """
    found: dict[int, Any] = {}

    def add(each: Any) -> None:
        if not isinstance(each, keras.optimizers.Optimizer) or id(each) in found:
            return
        found[id(each)] = each
        add(getattr(each, "inner_optimizer", None))
        for child in getattr(each, "optimizers", None) or ():
            add(child)

    add(optimizer)
    return list(found.values())


def keras_accumulation_steps(optimizer: Any) -> int:
    """Keras's own ``gradient_accumulation_steps`` set on the optimizer or any it wraps (0:
    none); tfscale refuses it for its own ``accumulation_steps``."""
    return max(
        (getattr(o, "gradient_accumulation_steps", None) or 0)
        for o in wrapped_optimizers(optimizer)
    )


def all_variables(model: Any, optimizers: Sequence[Any] = ()) -> list[Any]:
    """Every variable of the model: weights, metrics' state, its optimizers' state (and that
    of ``optimizers``, a custom loop's, which the model does not hold)."""
    seen: dict[int, Any] = {}
    groups: list[Iterable[Any]] = [model.variables, model.metrics_variables]
    for optimizer in _optimizers(model, optimizers):
        groups.append(optimizer.variables)
    for group in groups:
        for variable in group:
            seen.setdefault(id(variable), variable)
    return list(seen.values())


def _optimizers(model: Any, optimizers: Sequence[Any]) -> list[Any]:
    found = {id(o): o for o in model_optimizers(model)}
    for optimizer in optimizers:
        found.setdefault(id(optimizer), optimizer)
    return list(found.values())


def outside_variables(
    model: Any, strategy: tf.distribute.Strategy, optimizers: Sequence[Any] = ()
) -> list[Any]:
    """The model's variables (weights, metrics, optimizer state) ``strategy`` does not hold."""
    return [
        v
        for v in all_variables(model, optimizers)
        if not strategy.extended.variable_created_in_scope(internals.distributed_container(v))
    ]


def _value_for(variable: Any) -> Any:
    container = internals.distributed_container(variable)
    if container.synchronization == tf.VariableSynchronization.ON_READ:
        # Sync-on-read state (metrics) sums its replicas when read; it restarts from zero,
        # as fit resets metrics at every epoch anyway.
        return tf.zeros(container.shape, container.dtype)
    return container.numpy()


def _reinitialize(variable: Any, value: Any) -> None:
    """Re-creates the ``tf.Variable`` behind ``variable`` as trainable as the one it replaces.

    Keras creates it with ``trainable=variable.trainable``. A weight frozen after it was
    created (transfer learning: ``base.trainable = False`` on a built model) keeps a trainable
    ``tf.Variable`` under Keras's flag, and ``GradientTape`` watches it again once it is
    unfrozen. Re-created with the flag of the moment, it would stay unwatched for good: the
    fine-tuning ``fit`` after ``base.trainable = True`` and a recompile would get no gradient
    for it and leave it unchanged.
    """
    frozen = variable.trainable
    variable.trainable = bool(
        getattr(internals.distributed_container(variable), "trainable", frozen)
    )
    try:
        internals.reinitialize_variable(variable, value)
    finally:
        variable.trainable = frozen


def adopt(model: Any, strategy: tf.distribute.Strategy, optimizers: Sequence[Any] = ()) -> int:
    """Makes ``strategy`` hold every variable of ``model``, keeping values and objects, and
    the model's random ops draw per replica (``randomness.py``).

    Returns:
        How many variables were moved.

    Raises:
        TrainingError: A variable is a plain ``tf.Variable`` that Keras did not create (it
            cannot be moved; the model must be built inside the scope).
    """
    outside = outside_variables(model, strategy, optimizers)
    foreign = [v for v in outside if not isinstance(v, keras.Variable)]
    if foreign:
        raise TrainingError(
            explain(
                f"{len(foreign)} variables of model {model.name!r} are plain tf.Variables "
                "created outside the strategy's scope, which tfscale cannot move.",
                received=[getattr(v, "name", str(v)) for v in foreign[:3]],
                fix="build the model inside the scope:\n"
                "    with strategy.scope():\n"
                "        model = build_model()",
            )
        )
    tops = _optimizers(model, optimizers)
    every_optimizer = list({id(o): o for t in tops for o in wrapped_optimizers(t)}.values())
    if outside:
        from tfscale.scope import notify_repaired

        before = [internals.backing_variable(v) for v in outside]
        values = [_value_for(v) for v in outside]
        old_keys = [_keys(o, outside) for o in every_optimizer]
        internals.broadcast_any_initial_value(strategy)  # bfloat16, int8 on several workers
        with strategy.scope(), tf.init_scope():
            for variable, value in zip(outside, values, strict=True):
                _reinitialize(variable, value)
        for optimizer, old in zip(every_optimizer, old_keys, strict=True):
            new = _keys(optimizer, outside)
            internals.rekey_optimizer(optimizer, dict(zip(old, new, strict=True)))
        notify_repaired(before, "tfscale.prepare")
    internals.set_model_strategy(model, strategy)
    draw_per_replica(model)
    for optimizer in every_optimizer:
        internals.set_optimizer_strategy(optimizer, strategy)
        if isinstance(optimizer, _MULTI_OPTIMIZER) and not optimizer.built:
            _strategy_for_chosen(optimizer, strategy)
    return len(outside)


def _strategy_for_chosen(optimizer: Any, strategy: tf.distribute.Strategy) -> None:
    """A ``MultiOptimizer`` whose map is a function finds its optimizers as it builds, and
    builds each at once: one made outside the scope would create its variables for another
    strategy ("Mixing different tf.distribute.Strategy objects"). Its ``build`` first gives
    each optimizer the map chooses the strategy."""
    build = type(optimizer).build.__get__(optimizer)

    def build_in_strategy(var_list: Any) -> None:
        for chosen in internals.optimizers_chosen(optimizer, var_list):
            for each in wrapped_optimizers(chosen):
                internals.set_optimizer_strategy(each, strategy)
        build(var_list)

    registry.replace("multi-optimizer-build", optimizer, "build", build_in_strategy)


def _keys(optimizer: Any, variables: Sequence[Any]) -> list[Any]:
    """The key ``optimizer`` files each variable under: it names the ``tf.Variable`` behind
    the Keras variable, so it changes when that is re-created (``internals.rekey_optimizer``)."""
    return [internals.optimizer_variable_key(optimizer, v) for v in variables]
