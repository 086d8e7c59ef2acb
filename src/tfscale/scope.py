"""Scope checking: were a model's variables created inside the strategy's scope?

The classic reason for "only one GPU is used" is a model built outside
``strategy.scope()``: its variables are plain ``tf.Variable`` objects on one device, so
Keras trains it on the default (one-device) strategy, or fails with a bare
``AssertionError`` when ``fit`` runs inside the scope. This module

- records where each variable was created and which strategy's scope was active then
  (:func:`track_variable_creation`, built on ``tf.variable_creator_scope``),
- judges a model's variables against a strategy (:func:`check_scope`), using the public
  ``strategy.extended.variable_created_in_scope(v)`` on the ``tf.Variable`` behind each
  Keras 3 variable (``keras.Variable.value``), and
- rebuilds a model inside the scope with the same weights, compile settings and optimizer
  state (:func:`fix_scope`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import re
import sys
import sysconfig
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfscale.errors import ScopeError, explain
from tfscale.interop import internals
from tfscale.interop.internals import compile_config_objects, variable_strategy

__all__ = [
    "VariableOrigin",
    "check_scope",
    "creation_site",
    "creation_stack",
    "describe_stack",
    "fix_scope",
    "notify_repaired",
    "short_device",
    "track_variable_creation",
    "variable_origin",
    "watch_repairs",
]

# Frames inside these packages are never "where the user created a variable".
_LIBRARY_PACKAGES = ("tensorflow", "keras", "tf_keras", "tfscale", "optree", "tree", "absl")
_SHOWN_NAMES = 3


@dataclass(frozen=True)
class VariableOrigin:
    """Where and under which strategy one ``tf.Variable`` was created.

    Attributes:
        name: The variable's name as TensorFlow gave it.
        site: ``file:line`` of the first frame outside TensorFlow, Keras and tfscale, or
            None when no such frame exists.
        stack: That frame and its callers outside those libraries, innermost first, as
            ``file:line in function`` (at most 4).
        strategy: Class name of the strategy whose scope was active, or None when none was
            (the default strategy).
        num_replicas: Replicas of that strategy (1 outside any scope).
        device: The device the variable was placed on.
    """

    name: str
    site: str | None
    stack: tuple[str, ...]
    strategy: str | None
    num_replicas: int
    device: str


# id(tf.Variable) -> (weak reference, origin). The weak reference's callback drops the
# entry when the variable dies, so ids cannot be recycled into a stale entry.
_ORIGINS: dict[int, tuple[weakref.ReferenceType[Any], VariableOrigin]] = {}


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    dirs: list[str] = []
    for name in _LIBRARY_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(os.path.realpath(location) + os.sep)
    return tuple(dirs)


@functools.lru_cache(maxsize=1)
def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    found = {os.path.realpath(paths[key]) + os.sep for key in ("stdlib", "platstdlib")}
    return tuple(sorted(found))


@functools.lru_cache(maxsize=4096)
def _is_library_file(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return True
    if filename.startswith("<"):  # "<string>" (python -c), "<stdin>": the user's code
        return False
    path = os.path.realpath(filename)
    if path.startswith(_library_dirs()):
        return True
    if "site-packages" in path or "dist-packages" in path:
        return False
    return path.startswith(_stdlib_dirs())


def _show_path(filename: str) -> str:
    if filename.startswith("<"):
        return filename
    relative = os.path.relpath(filename)
    return filename if relative.startswith("..") else relative


def creation_stack(limit: int = 4) -> tuple[str, ...]:
    """The caller's frames outside TensorFlow, Keras, tfscale and the stdlib, innermost first.

    Args:
        limit: At most this many frames.

    Returns:
        ``file:line in function`` per frame, files relative to the working directory when
        inside it; empty when every frame belongs to a library.
    """
    found: list[str] = []
    frame = sys._getframe(1)
    while frame is not None and len(found) < limit:
        code = frame.f_code
        # Code a tf.function converted with AutoGraph runs from a generated file; the
        # user's own file and line come from its source map.
        origin = internals.autograph_origin(code, frame.f_lineno)
        if origin is not None:
            filename, line, function = origin
            found.append(f"{_show_path(filename)}:{line} in {function}")
        elif not _is_library_file(code.co_filename):
            found.append(f"{_show_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back  # type: ignore[assignment]
    return tuple(found)


def creation_site() -> str | None:
    """``file:line`` of the innermost caller outside TensorFlow, Keras, tfscale and stdlib."""
    stack = creation_stack(limit=1)
    return stack[0].rsplit(" in ", 1)[0] if stack else None


def _components(variable: Any) -> list[Any]:
    """The variable itself and, for a distributed one, each per-device component."""
    parts = [variable]
    if isinstance(variable, tf.distribute.DistributedValues):
        parts.extend(getattr(variable, "values", ()))
    return parts


def _strategy_now() -> tuple[str | None, int]:
    if not tf.distribute.has_strategy():
        return None, 1
    strategy = tf.distribute.get_strategy()
    return type(strategy).__name__, int(strategy.num_replicas_in_sync)


def _remember(variable: Any, origin: VariableOrigin) -> None:
    key = id(variable)

    def forget(_ref: weakref.ReferenceType[Any]) -> None:
        _ORIGINS.pop(key, None)

    try:
        ref = weakref.ref(variable, forget)
    except TypeError:  # not weak-referenceable: do not keep it alive to remember it
        return
    _ORIGINS[key] = (ref, origin)


@contextlib.contextmanager
def track_variable_creation(
    on_create: Callable[[Any, VariableOrigin], None] | None = None,
) -> Iterator[None]:
    """Records the creation site and active strategy of every variable created inside.

    Tracks variables created in the calling thread (TensorFlow's creator scopes are
    per thread), including the ``tf.Variable`` behind each Keras 3 variable. The records
    live as long as their variables and are read by :func:`check_scope` and
    :func:`variable_origin`.

    Example:
        ```python
        with tfscale.track_variable_creation():
            model = build_model()
        tfscale.check_scope(model, strategy)   # the error names train.py:12
        ```

    Args:
        on_create: Called with each new variable (a per-device component for a
            mirrored one) and its :class:`VariableOrigin`.

    Yields:
        Nothing; variables created in the block are tracked.
    """

    def creator(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        variable = next_creator(**kwargs)
        stack = creation_stack()
        site = stack[0].rsplit(" in ", 1)[0] if stack else None
        strategy, replicas = _strategy_now()
        for part in _components(variable):
            origin = VariableOrigin(
                name=str(getattr(part, "name", kwargs.get("name", ""))),
                site=site,
                stack=stack,
                strategy=strategy,
                num_replicas=replicas,
                device=str(getattr(part, "device", "") or ""),
            )
            _remember(part, origin)
            if on_create is not None:
                on_create(part, origin)
        return variable

    with tf.variable_creator_scope(creator):
        yield


def _tf_variable(variable: Any) -> Any:
    """The ``tf.Variable`` (maybe distributed) behind a Keras 3 variable, or itself."""
    if isinstance(variable, keras.Variable):
        return variable.value
    return variable


def variable_origin(variable: Any) -> VariableOrigin | None:
    """The recorded origin of a (Keras or TensorFlow) variable, or None if untracked."""
    for part in _components(_tf_variable(variable)):
        entry = _ORIGINS.get(id(part))
        if entry is not None and entry[0]() is part:
            return entry[1]
    return None


def short_device(device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:CPU:0`` -> ``/device:CPU:0``."""
    return re.sub(r"^/job:localhost/replica:0/task:0", "", device) or device


def _variable_path(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "?"))


def _strategy_devices(strategy: tf.distribute.Strategy) -> tuple[str, ...]:
    try:
        return tuple(short_device(d) for d in strategy.extended.worker_devices)
    except (RuntimeError, NotImplementedError, AttributeError):
        return ()


def _describe_strategy(strategy: tf.distribute.Strategy) -> str:
    devices = _strategy_devices(strategy)
    where = f" on {', '.join(devices)}" if devices else ""
    replicas = int(strategy.num_replicas_in_sync)
    plural = "replica" if replicas == 1 else "replicas"
    return f"{type(strategy).__name__} ({replicas} {plural}{where})"


@dataclass(frozen=True)
class _VariableFacts:
    """What check_scope needs to know about one variable, gathered once."""

    path: str
    owned: bool  # strategy.extended.variable_created_in_scope(v)
    other_strategy: str | None  # class name of the strategy that owns it instead, if any
    devices: tuple[str, ...]
    site: str | None
    stack: tuple[str, ...] = ()


def describe_stack(stack: Sequence[str]) -> str:
    """``a.py:3 in f, called from b.py:9`` for a stack from :func:`creation_stack`."""
    if not stack:
        return ""
    callers = ", ".join(frame.rsplit(" in ", 1)[0] for frame in stack[1:3])
    return stack[0] + (f", called from {callers}" if callers else "")


def _owner(tf_variable: Any) -> Any:
    return variable_strategy(tf_variable)


def _facts(variable: Any, strategy: tf.distribute.Strategy) -> _VariableFacts:
    tf_variable = _tf_variable(variable)
    owned = bool(strategy.extended.variable_created_in_scope(tf_variable))
    owner = _owner(tf_variable)
    parts = _components(tf_variable)
    if len(parts) > 1:
        parts = parts[1:]
    devices = tuple(dict.fromkeys(short_device(str(p.device)) for p in parts))
    origin = variable_origin(variable)
    return _VariableFacts(
        path=_variable_path(variable),
        owned=owned,
        other_strategy=None if owned or owner is None else type(owner).__name__,
        devices=devices,
        site=origin.site if origin else None,
        stack=origin.stack if origin else (),
    )


def _model_variables(model: Any) -> list[Any]:
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        variables.extend(optimizer.variables)
    return variables


def _misplaced(facts: Sequence[_VariableFacts], num_replicas: int) -> list[_VariableFacts]:
    """Variables the strategy does not own that break or waste it (pure)."""
    return [f for f in facts if not f.owned and (f.other_strategy is not None or num_replicas > 1)]


def _scope_message(bad: Sequence[_VariableFacts], total: int, strategy_text: str) -> str:
    """Words the ScopeError for variables ``bad`` out of ``total`` (pure)."""
    first = bad[0]
    where = f", created at {describe_stack(first.stack)}" if first.stack else ""
    devices = sorted({d for f in bad for d in f.devices})
    other = sorted({f.other_strategy for f in bad if f.other_strategy})
    if other:
        problem = (
            f"{len(bad)} of {total} variables belong to another {'/'.join(other)} than the "
            f"strategy checked, {strategy_text} (first: {first.path}{where})."
        )
    else:
        problem = (
            f"{len(bad)} of {total} variables were created outside strategy.scope() "
            f"(first: {first.path}{where}). They live on {', '.join(devices)} only, so "
            f"training runs on 1 device instead of {strategy_text}."
        )
    shown = [f"{f.path} ({f.site})" if f.site else f.path for f in bad[:_SHOWN_NAMES]]
    more = f" and {len(bad) - _SHOWN_NAMES} more" if len(bad) > _SHOWN_NAMES else ""
    received = f"{', '.join(shown)}{more}, on {', '.join(devices)}"
    if not any(f.site for f in bad):
        received += (
            " (creation sites unknown: build inside tfscale.track_variable_creation(), "
            "or run `tfscale doctor --script train.py`)"
        )
    fix = (
        "build the model inside the scope:\n"
        "    with strategy.scope():\n"
        "        model = build_model()\n"
        "        model.compile(...)\n"
        "or call model = tfscale.fix_scope(model, strategy)."
    )
    return explain(
        problem,
        received=received,
        allowed=f"variables created inside the scope of {strategy_text}",
        fix=fix,
    )


def _resolve_strategy(model: Any, strategy: tf.distribute.Strategy | None) -> Any:
    from tfscale.strategy.current import strategy_in_effect

    found = strategy_in_effect(model, strategy)
    if found is not None:
        return found
    for variable in _model_variables(model):
        owner = _owner(_tf_variable(variable))
        if owner is not None:
            return owner
    return tf.distribute.get_strategy()


def _require_model(model: Any, function: str) -> None:
    if not isinstance(model, (keras.layers.Layer, tf.Module)):
        raise ScopeError(
            explain(
                f"{function} needs a Keras model (or layer) whose variables it can inspect.",
                received=type(model).__name__,
                allowed="keras.Model, keras.layers.Layer or tf.Module",
            )
        )


def check_scope(model: Any, strategy: tf.distribute.Strategy | None = None) -> None:
    """Raises when a model's variables are not distributed by ``strategy``.

    A model built outside ``strategy.scope()`` of a multi-replica strategy has plain
    variables on one device: Keras trains it on one device (or fails with a bare
    ``AssertionError`` when ``fit`` runs inside the scope). Single-replica strategies
    (OneDevice, the default) accept variables created anywhere, unless another strategy
    owns them. The optimizer's variables are checked too once it is built.

    Args:
        model: A Keras model or layer (or ``tf.Module``).
        strategy: The strategy the model will run under. Defaults to the strategy of the
            scope active now, else the one the model was built under, else the one owning
            its variables; with none of those there is nothing to check.

    Raises:
        ScopeError: Some variables were created outside the strategy's scope. The message
            names the first ones, how many, their devices, where they were created (when
            tracked by :func:`track_variable_creation`) and how to fix it.
    """
    _require_model(model, "check_scope")
    strategy = _resolve_strategy(model, strategy)
    variables = _model_variables(model)
    facts = [_facts(v, strategy) for v in variables]
    num_replicas = int(strategy.num_replicas_in_sync)
    bad = _misplaced(facts, num_replicas)
    if bad:
        raise ScopeError(_scope_message(bad, len(facts), _describe_strategy(strategy)))


@contextlib.contextmanager
def _compile_state_hidden(model: Any) -> Iterator[None]:
    """Makes ``model`` look uncompiled while Keras clones it.

    clone_model recompiles a compiled clone from the *serialized* compile config, which
    fails for a lambda or an unregistered custom loss ("Requested the deserialization of
    a Python lambda"); fix_scope compiles the clone itself from the objects in memory.
    """
    compiled = getattr(model, "compiled", False)
    model.compiled = False
    try:
        yield
    finally:
        model.compiled = compiled


def _clone(model: Any) -> Any:
    """A new model with the same architecture; Keras builds it when shapes are known."""
    try:
        # Sequential and functional models are cloned layer by layer; other models through
        # get_config()/from_config() (with their build config, so they come back built).
        with _compile_state_hidden(model):
            clone = keras.models.clone_model(model)
    except (NotImplementedError, TypeError, ValueError, KeyError) as error:
        raise ScopeError(
            explain(
                f"fix_scope cannot rebuild {type(model).__name__}: Keras could not clone it "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}).",
                received=f"a subclassed model of type {type(model).__name__}",
                allowed="a Sequential or functional model, or a subclassed model with "
                "get_config() returning its constructor arguments",
                fix="build the model inside the scope yourself:\n"
                "    with strategy.scope():\n"
                "        model = build_model()\n"
                f"or give {type(model).__name__} a get_config() method.",
            )
        ) from error
    if len(clone.weights) != len(model.weights) and model.get_build_config():
        clone.build_from_config(model.get_build_config())
    return clone


def _copy_values(source: Sequence[Any], target: Sequence[Any], what: str) -> None:
    mismatch = len(source) != len(target) or any(
        tuple(s.shape) != tuple(t.shape) for s, t in zip(source, target, strict=False)
    )
    if mismatch:
        raise ScopeError(
            explain(
                f"fix_scope rebuilt the model but its {what} do not match the original's.",
                received=f"{len(source)} original against {len(target)} rebuilt {what}",
                allowed="the same number and shapes in the same order",
                fix="build the model inside strategy.scope() yourself, then "
                "model.set_weights(old_model.get_weights()).",
            )
        )
    for old, new in zip(source, target, strict=True):
        new.assign(np.asarray(old.numpy()))


def _clone_metric(metric: Any) -> Any:
    if isinstance(metric, keras.metrics.Metric):
        return type(metric).from_config(metric.get_config())
    if isinstance(metric, dict):
        return {k: _clone_metric(v) for k, v in metric.items()}
    if isinstance(metric, (list, tuple)):
        return type(metric)(_clone_metric(m) for m in metric)
    return metric


def _compile_arguments(model: Any) -> dict[str, Any]:
    """The arguments ``model.compile`` received, with stateful objects cloned."""
    # The in-memory objects passed to compile(): the public get_compile_config() serializes
    # them, which fails for lambdas and unregistered custom losses.
    stored = compile_config_objects(model)
    if stored is None:
        stored = keras.saving.deserialize_keras_object(model.get_compile_config())
    arguments = dict(stored)
    optimizer = model.optimizer
    # model.optimizer already holds the LossScaleOptimizer that auto_scale_loss may have
    # added, so it is cloned as is and the rebuilt model must not wrap it again.
    arguments["optimizer"] = type(optimizer).from_config(optimizer.get_config())
    arguments["auto_scale_loss"] = False
    for key in ("metrics", "weighted_metrics"):
        arguments[key] = _clone_metric(arguments.get(key))
    accepted = inspect.signature(model.compile).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        arguments = {k: v for k, v in arguments.items() if k in accepted}
    return arguments


#: ``listener(variables, how)``: the ``tf.Variable`` objects a repair left behind.
RepairListener = Callable[[Sequence[Any], str], None]
_REPAIR_LISTENERS: list[RepairListener] = []


def watch_repairs(listener: RepairListener) -> None:
    """Calls ``listener(variables, how)`` each time a model built outside a strategy's scope
    is repaired: by :func:`fix_scope` (``how="tfscale.fix_scope"``, the original model's
    variables, which the returned clone replaces) or by ``tfscale.fit`` / ``tfscale.prepare``
    moving them into the scope in place (``how="tfscale.prepare"``, the ``tf.Variable``
    objects that held them before). ``doctor --script`` uses it not to report variables the
    script repaired before training.
    """
    _REPAIR_LISTENERS.append(listener)


def _backing(variable: Any) -> Any:
    backing = internals.backing_variable(variable)
    return variable if backing is None else backing


def notify_repaired(variables: Sequence[Any], how: str) -> None:
    """Tells the :func:`watch_repairs` listeners which ``tf.Variable`` objects were replaced.

    Args:
        variables: Keras variables (their backing ``tf.Variable`` is reported) or
            ``tf.Variable`` objects, as they were before the repair.
        how: What repaired them.
    """
    if not _REPAIR_LISTENERS:
        return
    backing = [_backing(v) for v in variables]
    for listener in list(_REPAIR_LISTENERS):
        listener(backing, how)


def fix_scope(model: Any, strategy: tf.distribute.Strategy) -> Any:
    """Rebuilds ``model`` inside ``strategy.scope()`` with the same state.

    Keeps the weights (trainable and not), the compile settings (optimizer configuration,
    loss, metrics, loss weights, ``jit_compile``, ``steps_per_execution``, ``run_eagerly``)
    and, when the optimizer was built, its state (iterations, moments and other slots,
    copied in order). Loss objects are shared with the original (they hold no state);
    metrics and the optimizer are new objects.

    Args:
        model: A Keras model: Sequential, functional, or subclassed with ``get_config``.
        strategy: The strategy whose scope the new model is built in.

    Returns:
        A new model whose variables belong to ``strategy`` (mirrored for a Mirrored
        strategy). The original model is left unchanged.

    Raises:
        ScopeError: The model cannot be cloned (a subclassed model without
            ``get_config``), or its weights or optimizer state do not fit the clone.
    """
    _require_model(model, "fix_scope")
    if not isinstance(model, keras.Model):
        raise ScopeError(
            explain(
                "fix_scope rebuilds Keras models only.",
                received=type(model).__name__,
                allowed="keras.Model (Sequential, functional, or subclassed with get_config)",
                fix="build the layer inside strategy.scope().",
            )
        )
    with strategy.scope():
        clone = _clone(model)
        _copy_values(model.weights, clone.weights, "weights")
        if getattr(model, "compiled", False) and model.optimizer is not None:
            clone.compile(**_compile_arguments(model))
            if getattr(model.optimizer, "built", False):
                clone.optimizer.build(clone.trainable_variables)
                _copy_values(
                    model.optimizer.variables, clone.optimizer.variables, "optimizer variables"
                )
    check_scope(clone, strategy)
    optimizer = getattr(model, "optimizer", None)
    notify_repaired(
        [*model.weights, *model.metrics_variables, *getattr(optimizer, "variables", [])],
        "tfscale.fix_scope",
    )
    return clone
