"""A tensor's rows over the whole global batch, inside one replica's step.

A loss made of statistics of the whole batch (a mixture-of-experts layer's load-balancing
loss: the share of the tokens routed to each expert times its mean router probability) is not
a mean of per-example losses, so each replica computing it from its own share gives another
loss than one device's. Gathered over the replicas, every replica computes the batch's own.

The gradient is tfscale's, not ``ReplicaContext.all_gather``'s: tfscale's update is
``sum_r n_r g_r / sum_r n_r`` (``training/optimizer.py``: each replica's gradient weighed by
its examples), so the gradient a replica r' sends back through the gather to replica r's
rows must carry r''s weight, not r's. The backward pass all-reduces ``n_r' * dy_r'`` and
replica r divides its rows by ``n_r``: the update is then the gradient of
``sum_r' (n_r' / n) L_r'``, one device's, on uneven splits too (TensorFlow's gather sums
``dy`` unweighted, right only where every replica holds as many examples).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from tfscale.interop import internals
from tfscale.training.checks import check_load_balancing, no_load_balancing_loss
from tfscale.training.xla import in_compiled_step

__all__ = ["load_balancing_over_the_batch"]

_CARRIED = {"bool": tf.int32}  # the gather collective takes numbers only


def _refuse_in_compiled_step() -> None:
    # Refused before any work (checks.check_load_balancing); a step compiled another way
    # (a compute_loss the user compiles) still gets the same error here.
    if in_compiled_step():
        check_load_balancing(True, jit_compile=True)


def _gather(context: Any, value: Any) -> Any:
    carrier = _CARRIED.get(value.dtype.name)
    if carrier is None:
        return internals.all_gather_without_gradient(context, value, 0)
    carried = internals.all_gather_without_gradient(context, tf.cast(value, carrier), 0)
    return tf.cast(carried, value.dtype)


def gather_rows(value: Any) -> Any:
    """``value``'s rows of every replica, in replica order, without a gradient (a mask)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    _refuse_in_compiled_step()
    return _gather(context, value)


def gather_rows_weighted(value: Any, examples: Any) -> Any:
    """``value``'s rows of every replica, in replica order, with the gradient of tfscale's
    example-weighted update (module doc); ``examples``: this replica's example count."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    _refuse_in_compiled_step()
    rows = tf.shape(value)[0]
    counts = _gather(context, tf.reshape(rows, [1]))
    first = tf.reduce_sum(counts[: context.replica_id_in_sync_group])
    weight = tf.cast(examples, tf.float32)

    @tf.custom_gradient  # released with the step's others (internals.gradient_functions_released)
    def gathered(mine: Any) -> Any:
        def backward(upstream: Any) -> Any:
            weighted = tf.cast(upstream, tf.float32) * weight
            (summed,) = internals.all_reduce_without_gradient(context, "sum", [weighted])
            own = tf.math.divide_no_nan(summed[first : first + rows], weight)
            return tf.cast(own, mine.dtype)

        return _gather(context, mine), backward

    return gathered(value)


@contextlib.contextmanager
def load_balancing_over_the_batch(model: Any, examples: Any) -> Iterator[None]:
    """KerasHub's load-balancing losses traced in this replica's train step, while active,
    are the whole batch's (``internals.load_balancing_over_the_batch``); ``examples``: the
    replica's example count, its weight in the update.

    Raises:
        TrainingError: No layer of ``model`` computed such a loss in the step.
    """
    gathered: list[Any] = []

    def with_gradient(value: Any) -> Any:
        gathered.append(value)
        return gather_rows_weighted(value, examples)

    with internals.load_balancing_over_the_batch(with_gradient, gather_rows):
        yield
    if not gathered:
        raise no_load_balancing_loss(model)
