"""The facts a memory plan is made from, gathered from a model once (TensorFlow runs here).

The activations are read from the model's own graph: one replica's forward pass, a loss
over its outputs and the backward pass to every trainable variable are traced (not run) at
the per-replica batch, and the traced ops are walked in order (``liveness.peak_bytes``).
Reading the graph, rather than summing the layers' output shapes, sees what the backward
pass really keeps: a Dense layer's ``relu`` output and its input, a softmax's output, an
attention's score matrices, the temporaries of a convolution's gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.training.memory.liveness import OpRecord, peak_bytes
from tfscale.training.memory.plan import ModelFacts

__all__ = ["input_specs", "model_facts", "optimizer_slots"]


def _nbytes(shape: Any, dtype: Any) -> int:
    dtype = tf.as_dtype(dtype)
    if dtype in (tf.resource, tf.variant, tf.string):
        return 0
    shape = tf.TensorShape(shape)
    if shape.rank is None:
        return 0
    return int(np.prod([d if d is not None else 1 for d in shape.as_list()])) * dtype.size


def _variable_bytes(variables: Sequence[Any]) -> list[int]:
    return [_nbytes(v.shape, v.dtype) for v in variables]


def input_specs(model: Any, batch: int, input_shape: Any = None) -> list[tf.TensorSpec]:
    """One replica's input batch as tensor specs: the model's inputs, or ``input_shape``.

    Raises:
        TrainingError: The model has no known inputs and no ``input_shape`` was given.
    """
    if input_shape is not None:
        shapes = (
            input_shape
            if input_shape and isinstance(input_shape[0], (tuple, list))
            else [input_shape]
        )
        return [tf.TensorSpec((batch, *tuple(s)), tf.float32) for s in shapes]
    try:
        inputs = tf.nest.flatten(model.inputs)
    except (AttributeError, ValueError):
        inputs = []
    if not inputs:
        raise TrainingError(
            explain(
                "The memory plan needs the model's input shape, and this model has none "
                "(it was not built from keras.Input).",
                received=type(model).__name__,
                allowed="a functional model, or input_shape= one example's shape",
                fix="pass input_shape=(...) to tfscale.plan_memory, e.g. input_shape=(28, 28).",
            )
        )
    return [tf.TensorSpec((batch, *tuple(t.shape[1:])), t.dtype) for t in inputs]


def optimizer_slots(optimizer: Any, trainable: Sequence[Any]) -> tuple[int, int]:
    """``(slots per trainable variable, bytes of its other variables)``.

    A built optimizer's variables are counted; an unbuilt one is probed: a fresh optimizer
    of the same class and configuration is built on one small variable and its variables of
    that shape are counted (a few bytes, nothing of the model is touched).
    """
    if optimizer is None:
        return 0, 0
    if getattr(optimizer, "built", False) and trainable:
        shapes = {tuple(v.shape) for v in trainable}
        per_param = [v for v in optimizer.variables if tuple(v.shape) in shapes]
        others = [v for v in optimizer.variables if tuple(v.shape) not in shapes]
        slot_bytes = sum(_variable_bytes(per_param))
        trainable_bytes = max(1, sum(_variable_bytes(trainable)))
        return round(slot_bytes / trainable_bytes), sum(_variable_bytes(others))
    import keras

    with tf.init_scope():
        probe_shape = (3, 7)  # a shape no scalar counter has
        fresh = type(optimizer).from_config(optimizer.get_config())
        variable = keras.Variable(np.zeros(probe_shape, np.float32), name="probe")
        fresh.build([variable])
        slots = sum(1 for v in fresh.variables if tuple(v.shape) == probe_shape)
        rest = [v for v in fresh.variables if tuple(v.shape) != probe_shape]
    return slots, sum(_variable_bytes(rest))


def _layer_output_bytes(model: Any) -> int:
    """One example's outputs of every layer (what recomputation keeps), 0 where unknown."""
    total = 0
    for layer in getattr(model, "layers", []):
        if type(layer).__name__ == "InputLayer":
            continue
        try:
            outputs = tf.nest.flatten(layer.output)
        except (AttributeError, ValueError):
            return 0
        total += sum(_nbytes(t.shape[1:], t.dtype) for t in outputs)
    return total


def _graph_ops(graph: Any) -> list[OpRecord]:
    return [
        OpRecord(
            op.type,
            tuple(t.name for t in op.inputs),
            tuple((t.name, _nbytes(t.shape, t.dtype)) for t in op.outputs),
        )
        for op in graph.get_operations()
    ]


def _loss(outputs: Any) -> tf.Tensor:
    # A loss over every output: its gradient flows back through the whole model, as the
    # model's own loss's does (a loss adds a few output-sized tensors, no more).
    floats = [t for t in tf.nest.flatten(outputs) if t.dtype.is_floating]
    return tf.add_n([tf.reduce_mean(tf.cast(t, tf.float32)) for t in floats])


def model_facts(model: Any, batch_per_replica: int, input_shape: Any = None) -> ModelFacts:
    """Gathers the plan's facts: variable and optimizer bytes, and the activations of one
    replica's traced forward and backward pass at ``batch_per_replica``.

    Raises:
        TrainingError: The model's inputs are unknown (pass ``input_shape``), or the
            batch is not a positive integer.
    """
    if isinstance(batch_per_replica, bool) or int(batch_per_replica) < 1:
        raise TrainingError(
            explain(
                "The per-replica batch of a memory plan must be a positive integer.",
                received=batch_per_replica,
                allowed="an int >= 1",
            )
        )
    batch = int(batch_per_replica)
    specs = input_specs(model, batch, input_shape)
    trainable = list(model.trainable_variables)

    def forward_backward(*inputs: tf.Tensor) -> list[Any]:
        with tf.GradientTape() as tape:
            outputs = model(inputs[0] if len(inputs) == 1 else list(inputs), training=True)
            loss = _loss(outputs)
        return tape.gradient(loss, trainable)  # type: ignore[no-any-return]

    concrete = tf.function(forward_backward, autograph=False).get_concrete_function(*specs)
    gradients = [t.name for t in concrete.outputs]
    peak, at_end = peak_bytes(_graph_ops(concrete.graph), kept=gradients)
    weights = _variable_bytes(model.weights)
    trainable_bytes = _variable_bytes(trainable)
    slots, extra = optimizer_slots(getattr(model, "optimizer", None), trainable)
    return ModelFacts(
        name=str(getattr(model, "name", type(model).__name__)),
        weight_bytes=sum(weights),
        trainable_bytes=sum(trainable_bytes),
        largest_variable_bytes=max(trainable_bytes, default=0),
        optimizer_slots=slots,
        optimizer_extra_bytes=extra,
        traced_batch=batch,
        activation_bytes=max(0, peak - at_end),
        layer_output_bytes=_layer_output_bytes(model) * batch,
        input_bytes=sum(_nbytes(s.shape, s.dtype) for s in specs),
    )
