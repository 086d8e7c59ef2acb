"""XLA for a whole replica step: forward, backward and the step's own metrics in one cluster.

Compiling only the model's forward call fails on recurrent layers: the ``while`` loop of an
LSTM or GRU keeps its activations in a TensorList that the uncompiled backward pass must read
("Support for TensorList crossing the XLA/TF boundary is not implemented"). Keras's
one-device ``jit_compile=True`` compiles its whole step function, optimizer included; under a
strategy that would put the all-reduce and the optimizer's ``merge_call`` inside the cluster,
which fails. So each replica's ``train_step`` is compiled with the optimizer's ``apply``
*deferred*::

    replica r    compiled(data)    tf.function(jit_compile=True):
                                     model.train_step(data)  forward, loss, tape.gradient,
                                                             metrics; optimizer.apply(g, v)
                                                             only records g (deferring)
                                     -> outputs, g
                 optimizer.apply(g, v)   uncompiled: tfscale's distributed update (example
                                         weighting, the all-reduce, merge_call, the update)

Deferring moves the update after the rest of the step, which changes nothing for a step that
applies gradients once, at its end (Keras's own ``train_step`` and nearly every override). A
step applying several times (a GAN's two optimizers) may compute later gradients from weights
the earlier update changed, so it is refused under ``jit_compile=True`` rather than trained
differently.

Before the first step, :func:`check_compilable` lowers the model's forward and backward pass
to XLA (``experimental_get_compiler_ir``: nothing runs) and turns a failure into a
``TrainingError`` naming the layer whose op XLA refused.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import keras
import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.interop import internals
from tfscale.training.adopt import has_call

__all__ = ["check_compilable", "compiled_step", "defer", "xla_error"]


@dataclass
class _Deferred:
    update: Any  # the optimizer's DistributedUpdate
    variables: Sequence[Any] | None
    grads: list[Any] = field(default_factory=list)


_LOCAL = threading.local()


@contextlib.contextmanager
def _deferring() -> Iterator[list[_Deferred]]:
    previous = getattr(_LOCAL, "deferred", None)
    calls: list[_Deferred] = []
    _LOCAL.deferred = calls
    try:
        yield calls
    finally:
        _LOCAL.deferred = previous


def in_compiled_step() -> bool:
    """Whether this thread is tracing the compiled part of a step (:func:`compiled_step`)."""
    return getattr(_LOCAL, "deferred", None) is not None


def defer(update: Any, grads: Sequence[Any], variables: Sequence[Any] | None) -> bool:
    """Records an ``apply`` traced inside a compiled step (then True: apply nothing now).

    Called by the distributed update's ``apply``; False outside a compiled step.
    """
    calls = getattr(_LOCAL, "deferred", None)
    if calls is None:
        return False
    calls.append(_Deferred(update, None if variables is None else list(variables), list(grads)))
    return True


def compiled_step(step: Callable[[Any], Any], data: Any, *, name: str) -> Any:
    """Runs ``step(data)`` (one replica's train or test step) compiled with XLA, then applies
    the gradients it gave the optimizer, outside the compiled cluster.

    Raises:
        TrainingError: The step applied gradients more than once.
    """
    calls: list[_Deferred] = []

    def body(data: Any) -> Any:
        with _deferring() as traced:
            outputs = step(data)
        calls.extend(traced)
        return outputs, [call.grads for call in traced]

    function = tf.function(body, jit_compile=True, autograph=False, reduce_retracing=True)
    outputs, grads = function(data)
    if len(calls) > 1:
        raise TrainingError(
            explain(
                "With jit_compile=True tfscale compiles the train_step up to its gradients "
                "and applies them after it (the all-reduce cannot run inside XLA); this "
                f"train_step applies gradients {len(calls)} times, and a later gradient may "
                "depend on an earlier update, which would then be computed from stale weights.",
                received=f"{name}.train_step calling optimizer.apply / apply_gradients "
                f"{len(calls)} times",
                allowed="a train_step that applies gradients once (Keras's own)",
                fix="train this model with jit_compile=False.",
            )
        )
    for call, given in zip(calls, grads, strict=True):
        call.update.apply(given, call.variables)
    return outputs


# -- refusing what XLA cannot compile -----------------------------------------------------
_XLA_MARKERS = (
    "XLA_",
    "XLA/TF boundary",
    "Detected unsupported operations",
    "must be a compile-time constant",
    "tf2xla",
)


def is_xla_failure(error: BaseException) -> bool:
    """Whether ``error`` is XLA refusing to compile (not a failure of the computation)."""
    return isinstance(error, (tf.errors.OpError, ValueError)) and any(
        marker in str(error) for marker in _XLA_MARKERS
    )


def _layer_of(model: Any, message: str) -> Any:
    """The deepest layer of ``model`` whose name scope holds a node the message names."""
    nodes = re.findall(r"\{\{node ([^}]+)\}\}", message)
    nodes += re.findall(r"node '?([\w/.-]+)'?", message)
    layers = internals.flatten_layers(model, include_self=False)
    best, depth = None, -1
    for node in nodes:
        parts = node.split("/")
        for layer in layers:
            pattern = re.compile(re.escape(layer.name) + r"(_\d+)?")
            for position, part in enumerate(parts[:-1]):
                exact = part == layer.name
                if (exact or pattern.fullmatch(part)) and position + exact * 0.5 > depth:
                    best, depth = layer, position + exact * 0.5
    return best


def _first_line(message: str) -> str:
    text = message.strip().splitlines()[0] if message.strip() else message
    return text[:400]


def xla_error(model: Any, error: BaseException) -> TrainingError:
    """The ``TrainingError`` for XLA refusing to compile ``model``'s step."""
    message = str(error)
    layer = _layer_of(model, message)
    where = (
        f"layer {layer.name!r} ({type(layer).__name__})"
        if layer is not None
        else "an op outside the model's layers (the loss, the metrics or the train_step)"
    )
    return TrainingError(
        explain(
            f"XLA cannot compile the step of model {model.name!r}: {where} uses an "
            "operation XLA does not support.",
            received=_first_line(message),
            allowed="layers whose ops XLA compiles (no tf.py_function / numpy_function, "
            "string ops or data-dependent output shapes)",
            fix="train with jit_compile=False (tfscale.fit(..., jit_compile=False) or "
            "compile(jit_compile=False)), or rewrite that layer with XLA-compatible ops.",
        )
    )


def _static(spec: Any) -> Any:
    if not isinstance(spec, tf.TensorSpec):
        return spec
    shape = [2 if d is None else d for d in spec.shape.as_list()] if spec.shape.rank else []
    return tf.TensorSpec(shape if spec.shape.rank is not None else [2], spec.dtype)


def check_compilable(model: Any, data_spec: Any) -> None:
    """Lowers ``model``'s forward and backward pass on one batch of ``data_spec`` to XLA.

    Nothing runs and no variable changes (``experimental_get_compiler_ir``); unknown
    dimensions are taken as 2. What this cannot see (the loss, the metrics, a ``train_step``
    override) fails at the first step, before any update, and gets the same error
    (``StepFunction``).

    Raises:
        TrainingError: XLA cannot compile it; the message names the layer.
    """
    if not has_call(model):
        return  # keras-io's GAN, VAE: the train_step is compiled at the first step
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data_spec)
    x = tf.nest.map_structure(_static, x)
    if not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(x)):
        return  # sparse or ragged inputs: the first step will tell (StepFunction)

    # experimental_get_compiler_ir takes TensorSpecs as its own arguments only, not nested in
    # a dict or list (a model with named inputs): handed flat, packed back inside.
    flat = tf.nest.flatten(x)

    def trial(training: bool) -> None:
        def forward_backward(*given: Any) -> Any:
            inputs = tf.nest.pack_sequence_as(x, list(given))
            with tf.GradientTape() as tape:
                outputs = model(inputs, training=training)
                total = tf.add_n(
                    [
                        tf.reduce_sum(tf.cast(t, tf.float32))
                        for t in tf.nest.flatten(outputs)
                        if t.dtype.is_floating
                    ]
                    or [tf.constant(0.0)]
                )
            return tape.gradient(total, model.trainable_variables)

        function = tf.function(forward_backward, jit_compile=True, autograph=False)
        function.experimental_get_compiler_ir(*flat)(stage="hlo")

    # Traced in cross-replica context, a training-mode state update (batch normalization's
    # moving statistics) writes every replica's copy, which one XLA cluster cannot reach: the
    # inference pass is lowered instead. A layer that draws random numbers in inference too
    # (keras-io's VAE sampling layer) advances its seed generator's state in either pass:
    # then nothing is left to lower here, and the first step compiles each replica's step
    # and refuses it there, before any update (StepFunction).
    try:
        for training in (True, False):
            try:
                trial(training=training)
                break
            except ValueError as error:
                if "located in device" not in str(error):
                    raise
    except Exception as error:
        if is_xla_failure(error):
            raise xla_error(model, error) from None
        raise
