"""Pure checks of the all-reduce's bucketing (``training/allreduce.py``), and that a fit's
traced step does not outlive it; the reduction itself is checked against one device in
``test_equivalence.py``."""

from __future__ import annotations

import pytest
import tensorflow as tf

import tfscale
from tfscale.testing import graphs_left_alive
from tfscale.training.allreduce import buckets

from .helpers import DATA, strategy_for, tiered, tiny_model

pytestmark = pytest.mark.tf


# `make test` runs the replicated update; sharded state and remat (the same release of what
# the fit traced) in `make test-full`.
@pytest.mark.parametrize(
    ("sharded", "remat"),
    tiered(
        [(False, False), (True, False), (False, True)],
        {"sharded": "replicated", "remat": "replicated"},
        "tests/training/test_allreduce.py::test_nothing_a_fit_traced_outlives_it",
        ids=["replicated", "sharded", "remat"],
    ),
)
def test_nothing_a_fit_traced_outlives_it(sharded: bool, remat: bool) -> None:
    """Every graph a fit traced (its step, the guard's branches with the update of every
    replica, the input's functions) is freed once the model is gone. TensorFlow's own
    ``ReplicaContext.all_reduce`` / ``all_gather`` kept the step alive for the life of the
    process (tensorflow/tensorflow#97697, TensorFlow <= 2.21: about 6 MiB a fit of this tiny
    model in a sweep); tfscale's all-reduce and gather leave it free
    (``internals.all_reduce_without_gradient``). So did ``tf.recompute_grad`` under
    ``remat=True``, by the same registry (8 MiB a fit more): tfscale removes what it
    registered once the step is traced (``training/layercalls.py``)."""
    x, y = DATA
    strategy = strategy_for(2)

    def fit() -> None:
        model = tiny_model(strategy, "adam", lr=0.01)
        tfscale.fit(model, x[:64], y[:64], batch_size=16, epochs=1, verbose=0,
                    strategy=strategy, shard_optimizer_state=sharded, remat=remat)  # fmt: skip

    traced, alive = graphs_left_alive(fit)
    # The step, its branches, the input's functions.
    assert len(traced) > 5 and any("multi_step" in name for name in traced), traced
    assert not alive, f"graphs of a finished fit still alive: {alive}"


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
