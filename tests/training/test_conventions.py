"""Which terms of a ``compute_loss`` override's loss sum over the replica's examples
(``conventions.sums_over_examples``), read from traced graphs: the ones tfscale.fit makes
the batch's sum (``tests/training/test_equivalence.py`` trains them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import pytest
import tensorflow as tf

from tfscale.training.conventions import sums_over_examples

pytestmark = pytest.mark.tf


def _found(loss_of: Callable[..., Any], batch: int | None) -> list[tuple[str, float]]:
    """The summed tensors' op types and factors found in ``loss_of(x, y, kernel)``'s graph,
    ``x`` and ``y`` of leading dimension ``batch`` (None: unknown while tracing)."""
    kernel = tf.Variable(tf.ones((4, 3)))
    found: list[tuple[str, float]] = []

    @tf.function(input_signature=[tf.TensorSpec((batch, 3)), tf.TensorSpec((batch, 1))])
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        loss = loss_of(x, y, kernel)
        found.extend((t.op.type, f) for t, f in sums_over_examples(loss, (x, y, None)))
        return loss

    step.get_concrete_function()
    return found


def _per_example(x: tf.Tensor, y: tf.Tensor, kernel: tf.Variable) -> tf.Tensor:
    return tf.reduce_sum(tf.square(x @ tf.transpose(kernel[:, :3])[:, :1] - y), axis=1)


@pytest.mark.parametrize("batch", [None, 4])
def test_sums_over_the_examples_are_found_with_their_factors(batch: int | None) -> None:
    """Through constant factors only where the batch's size is unknown while tracing: where
    it is known, a constant may be that size (below)."""

    def loss(x: tf.Tensor, y: tf.Tensor, kernel: tf.Variable) -> tf.Tensor:
        per_example = _per_example(x, y, kernel)
        total = tf.reduce_sum(per_example)
        listed = keras.ops.sum([keras.ops.sum(per_example * 2.0), tf.constant(1.0)])
        scaled = tf.cast(0.5 * total, tf.float32) - listed / 4.0
        return scaled + tf.reduce_mean(per_example) - tf.reduce_sum(tf.square(per_example))

    found = sorted(_found(loss, batch))
    if batch is None:
        assert found == [("Sum", -1.0), ("Sum", -0.25), ("Sum", 0.5)]
    else:
        assert found == [("Sum", -1.0)]


@pytest.mark.parametrize("batch", [None, 4])
def test_means_sums_of_weights_and_sums_divided_by_a_count_are_not(batch: int | None) -> None:
    """The kernel's first dimension is the batch's when it is static (4): a sum over it is
    found only where it is computed from the data. ``keras.ops.shape(x)[0]`` is the number 4
    there: a mean by hand, not a sum divided by a constant."""

    def loss(x: tf.Tensor, y: tf.Tensor, kernel: tf.Variable) -> tf.Tensor:
        per_example = _per_example(x, y, kernel)
        count = tf.cast(tf.shape(x)[0], tf.float32)
        return (
            tf.reduce_mean(per_example)
            + tf.reduce_sum(per_example) / count
            + keras.ops.sum(per_example) / keras.ops.cast(keras.ops.shape(x)[0], "float32")
            + 0.01 * tf.reduce_sum(tf.square(kernel))
            + tf.reduce_sum(tf.reduce_mean(tf.square(x), axis=0))
            + keras.losses.MeanSquaredError()(y, x[:, :1])
        )

    assert _found(loss, batch) == []
