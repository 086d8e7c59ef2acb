"""The distributed update's example weighting (the rest is tested through training runs)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tfscale.training.optimizer import _weighted

pytestmark = pytest.mark.tf


def test_a_replica_with_no_examples_weighs_exactly_zero_even_with_a_nan_gradient() -> None:
    nan = float("nan")
    dense = _weighted(tf.constant([nan, float("inf"), 1.0]), tf.constant(0.0))
    assert dense.numpy().tolist() == [0.0, 0.0, 0.0]
    np.testing.assert_array_equal(_weighted(tf.constant([0.5, 1.0]), tf.constant(3.0)), [1.5, 3.0])
    rows = tf.IndexedSlices(tf.constant([[nan, 2.0]]), tf.constant([1]), tf.constant([3, 2]))
    empty = _weighted(rows, tf.constant(0.0))
    assert isinstance(empty, tf.IndexedSlices)
    assert empty.values.numpy().tolist() == [[0.0, 0.0]]
    assert _weighted(rows, tf.constant(2.0)).values.numpy()[0, 1] == 4.0
