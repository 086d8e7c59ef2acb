"""Pure checks of the all-reduce's bucketing (``training/allreduce.py``); the reduction
itself is checked against one device in ``test_equivalence.py``."""

from __future__ import annotations

import pytest
import tensorflow as tf

from tfscale.training.allreduce import buckets

pytestmark = pytest.mark.tf


def test_buckets_fill_from_the_last_value_backwards_until_the_size_is_reached() -> None:
    values = [tf.zeros([10]), None, tf.zeros([100]), tf.zeros([3]), tf.zeros([2])]
    # float32: 40, -, 400, 12 and 8 bytes; buckets close once they hold 16 bytes or more.
    assert buckets(values, 16) == [[4, 3], [2], [0]]
    assert buckets(values, None) == [[4, 3, 2, 0]]
    # A value larger than a bucket is never cut (cutting measured slower: docs/profiling.md).
    assert buckets([tf.zeros([1000])], 16) == [[0]]
    # ... and a bucket of its own: the small values after it do not wait for it.
    assert buckets([tf.zeros([2]), tf.zeros([1000]), tf.zeros([1])], 16) == [[2], [1], [0]]
    assert buckets([None], 16) == [] and buckets([None], None) == []
