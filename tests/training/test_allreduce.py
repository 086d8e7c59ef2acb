"""Pure checks of the all-reduce's bucketing (``training/allreduce.py``), and that a fit's
traced step does not outlive it; the reduction itself is checked against one device in
``test_equivalence.py``."""

from __future__ import annotations

import gc
import weakref

import pytest
import tensorflow as tf

import tfscale
from tfscale.training.allreduce import buckets

from .helpers import DATA, strategy_for, tiny_model

pytestmark = pytest.mark.tf


def _graphs() -> dict[int, object]:
    return {id(o): o for o in gc.get_objects() if type(o).__name__ == "FuncGraph"}


@pytest.mark.parametrize(
    ("sharded", "remat"),
    [(False, False), (True, False), (False, True)],
    ids=["replicated", "sharded", "remat"],
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

    before = _graphs()
    fit()
    traced = [weakref.ref(g) for i, g in _graphs().items() if i not in before]
    assert len(traced) > 5  # the step, its branches, the input's functions
    fit()  # a second fit: a graph the first left to it (a cache) would be freed by now
    gc.collect()
    alive = sorted(str(getattr(r(), "name", "")) for r in traced if r() is not None)
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
