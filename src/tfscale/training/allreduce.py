"""The gradient all-reduce: dense gradients packed into one collective, sparse ones gathered.

Dense gradients of one dtype are flattened and concatenated, so a model with many small
weights costs one collective per update, not one per weight. ``tf.IndexedSlices`` (the
gradient of an ``Embedding`` lookup) are all-reduced as slices, which TensorFlow implements as
a gather of the rows each replica touched: the bytes exchanged grow with the rows touched, not
with the vocabulary, and the optimizer receives slices exactly as on one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

__all__ = ["ALL_REDUCE_SCOPE", "all_reduce_packed"]

# The name scope of the gradient collectives, so tests and profilers find them in a graph.
ALL_REDUCE_SCOPE = "tfscale_gradient_all_reduce"


def _flat_size(tensor: tf.Tensor) -> Any:
    count = tensor.shape.num_elements()
    # A gradient's static shape can be partly unknown (a Dense kernel applied to a 3-D
    # input has a gradient of static shape (None, units)); its size is then read at run time.
    return count if count is not None else tf.size(tensor)


def all_reduce_packed(values: Sequence[Any], context: tf.distribute.ReplicaContext) -> list[Any]:
    """Sums ``values`` over all replicas: one packed collective per dtype for dense tensors.

    Args:
        values: Tensors, ``tf.IndexedSlices`` or None (left as None), from replica context.
        context: The current replica context.

    Returns:
        The summed values, in the order given, each with its own shape.
    """
    groups: dict[tf.DType, list[int]] = {}
    sparse: list[int] = []
    for index, value in enumerate(values):
        if value is None:
            continue
        if isinstance(value, tf.IndexedSlices):
            sparse.append(index)
        else:
            groups.setdefault(value.dtype, []).append(index)
    out: list[Any] = list(values)
    with tf.name_scope(ALL_REDUCE_SCOPE):
        flats = [
            tf.concat([tf.reshape(values[i], [-1]) for i in indices], axis=0)
            for indices in groups.values()
        ]
        reduced = context.all_reduce(
            tf.distribute.ReduceOp.SUM, flats + [values[i] for i in sparse]
        )
    for flat, indices in zip(reduced[: len(flats)], groups.values(), strict=True):
        sizes = [_flat_size(values[i]) for i in indices]
        static = all(isinstance(s, int) for s in sizes)
        pieces = tf.split(flat, sizes if static else tf.stack(sizes), num=len(indices))
        for i, piece in zip(indices, pieces, strict=True):
            shape = values[i].shape
            target = shape if shape.is_fully_defined() else tf.shape(values[i])
            out[i] = tf.ensure_shape(tf.reshape(piece, target), shape)
    for i, slices in zip(sparse, reduced[len(flats) :], strict=True):
        out[i] = slices
    return out
