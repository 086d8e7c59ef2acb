"""A tensor's rows over the whole global batch, inside one replica's step.

A loss made of statistics of the whole batch (a mixture-of-experts layer's load-balancing
loss: the share of the tokens routed to each expert times its mean router probability; a
contrastive loss over in-batch negatives) is not a mean of per-example losses, so each
replica computing it from its own share gives another loss than one device's. Gathered over
the replicas (``tfscale.gather_batch``, ``global_load_balancing``), every replica computes
the batch's own; tfscale leaves such a loss out of its corrections of a replica's sums over
its share (``derives_from_gathered``).

The gradient is tfscale's, not ``ReplicaContext.all_gather``'s: tfscale's update is
``sum_r n_r g_r / sum_r n_r`` (``training/optimizer.py``: each replica's gradient weighed by
its examples), so the gradient a replica r' sends back through the gather to replica r's
rows must carry r''s weight, not r's. The backward pass all-reduces ``w_r' * dy_r'`` and
replica r divides its rows by ``w_r`` (``w``: each replica's weight in the update,
``StepContext.update_weight``: its examples, or as ``scale_loss`` made it): the update is
then the gradient of ``sum_r' (n_r' / n) L_r'``, one device's, on uneven splits too
(TensorFlow's gather sums ``dy`` unweighted, right only where every replica weighs alike).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.interop import internals
from tfscale.training.checks import no_load_balancing_loss
from tfscale.training.conventions import computed_from
from tfscale.training.optimizer import current_update_weight, gathered_in_step
from tfscale.training.xla import in_compiled_step

__all__ = ["derives_from_gathered", "gather_batch", "load_balancing_over_the_batch"]

_CARRIED = {"bool": tf.int32}  # the gather collective takes numbers only

# The ops whose outputs are gathered rows, per thread (MirroredStrategy traces each replica
# in one): a loss computed from them holds the whole batch's values on every replica, which
# the corrections for a replica's sums over its share must leave alone (derives_from_gathered).
_LOCAL = threading.local()


def _refuse_in_compiled_step() -> None:
    # global_load_balancing is refused before any work (checks.check_load_balancing); a
    # gather in a step compiled another way gets an error here.
    if in_compiled_step():
        raise TrainingError(
            explain(
                "A tensor is gathered over the replicas (tfscale.gather_batch, "
                "global_load_balancing) inside the step tfscale compiles with XLA, where no "
                "collective can run.",
                received="jit_compile=True",
                fix="train with jit_compile=False.",
            )
        )


def _gather(context: Any, value: Any) -> Any:
    carrier = _CARRIED.get(value.dtype.name)
    if carrier is None:
        return internals.all_gather_without_gradient(context, value, 0)
    carried = internals.all_gather_without_gradient(context, tf.cast(value, carrier), 0)
    return tf.cast(carried, value.dtype)


def _recorded(gathered: Any) -> Any:
    ops = getattr(_LOCAL, "ops", None)
    if ops is None:
        ops = _LOCAL.ops = weakref.WeakSet()
    ops.add(gathered.op)
    return gathered


def derives_from_gathered(tensor: Any) -> bool:
    """Whether ``tensor`` (traced in this thread) is computed from rows this module gathered
    over the replicas: then it may hold the whole batch's values rather than the replica's
    share's (``Prepared.compute_loss`` tells them apart by their rows)."""
    ops = getattr(_LOCAL, "ops", None)
    if not ops or getattr(tensor, "op", None) is None:
        return False
    return computed_from(tensor, ops.__contains__)


def gather_rows(value: Any) -> Any:
    """``value``'s rows of every replica, in replica order, without a gradient (a mask)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    _refuse_in_compiled_step()
    return _recorded(_gather(context, value))


def gather_rows_weighted(value: Any) -> Any:
    """``value``'s rows of every replica, in replica order, with the gradient of tfscale's
    weighted update (module doc)."""
    return _gathered_weighted(value)[0]


def _gathered_weighted(value: Any) -> tuple[Any, Any]:
    """:func:`gather_rows_weighted`'s rows, and where this replica's own begin in them."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value, tf.constant(0)
    _refuse_in_compiled_step()
    gathered_in_step()
    rows = tf.shape(value)[0]
    counts = _gather(context, tf.reshape(rows, [1]))
    first = tf.reduce_sum(counts[: context.replica_id_in_sync_group])

    @tf.custom_gradient  # released with the step's others (internals.gradient_functions_released)
    def gathered(mine: Any) -> Any:
        def backward(upstream: Any) -> Any:
            # The replica's weight in the update, read as the backward pass is traced: after
            # scale_loss, which may change it (a float8 model's loss share). No step in
            # tfscale's test step, where no gradient is taken.
            weight = current_update_weight()
            weight = tf.ones(()) if weight is None else weight
            weighted = tf.cast(upstream, tf.float32) * weight
            (summed,) = internals.all_reduce_without_gradient(context, "sum", [weighted])
            own = tf.math.divide_no_nan(summed[first : first + rows], weight)
            return tf.cast(own, mine.dtype)

        return _gather(context, mine), backward

    return _recorded(gathered(value)), first


@contextlib.contextmanager
def load_balancing_over_the_batch(model: Any) -> Iterator[None]:
    """KerasHub's load-balancing losses traced in this replica's train step, while active,
    are the whole batch's (``internals.load_balancing_over_the_batch``).

    Raises:
        TrainingError: No layer of ``model`` computed such a loss in the step.
    """
    gathered: list[Any] = []

    def with_gradient(value: Any) -> Any:
        gathered.append(value)
        return gather_rows_weighted(value)

    with internals.load_balancing_over_the_batch(with_gradient, gather_rows):
        yield
    if not gathered:
        raise no_load_balancing_loss(model)


def gather_batch(value: Any, *, return_offset: bool = False) -> Any:
    """``value``'s rows for the whole global batch: every replica's, in replica order.

    Call it inside a model's ``call``, ``train_step`` or ``compute_loss`` where a loss needs
    the whole batch rather than the replica's share of it: a contrastive loss over in-batch
    negatives (CLIP, SimCLR), where one device compares each example with every other one
    of the batch. A loss computed from gathered tensors is the whole batch's on every
    replica, and tfscale's update is then one device's (the gather's gradient carries the
    weight tfscale gives each replica: module doc; such a loss is left out of tfscale's
    corrections of a replica's sums over its share). Where there is nothing to gather (no
    strategy, one replica, Keras building the model) it returns ``value``; in tfscale's test
    step it gathers without a gradient.

    A loss may also compare only the replica's own examples with the gathered ones (CLIP's
    "local" loss: ``n x B`` similarities per replica instead of ``B x B``): with
    ``return_offset=True`` it also returns where this replica's rows begin in the gathered
    tensor, so that example i's positive is row ``offset + i``. Such a loss holds the
    replica's share of the batch, as any other, and is weighed as one.

    Args:
        value: A tensor whose first dimension holds this replica's rows (its share of the
            batch's examples, or anything per example); the rows of the replicas may differ
            in number (an uneven split).
        return_offset: Also return the index of this replica's first row in the result.

    Returns:
        A tensor of every replica's rows of ``value``, concatenated in replica order; with
        ``return_offset``, the pair of it and that index (an int32 scalar tensor).

    Raises:
        TrainingError: Called under a strategy outside a step of a model trained by
            ``tfscale.fit`` or ``tfscale.prepare`` (a custom loop, Keras's own fit: their
            weighting of the replicas is not the gather's), or inside a step compiled with
            XLA.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return (value, tf.constant(0)) if return_offset else value
    value = tf.convert_to_tensor(value)
    # tfscale's train step, or its test step (where no gradient is taken).
    if current_update_weight() is not None or internals.per_replica_losses_active():
        gathered, offset = _gathered_weighted(value)
        return (gathered, offset) if return_offset else gathered
    raise TrainingError(
        explain(
            "tfscale.gather_batch was called in a replica's step that tfscale did not trace: "
            "its gradient must carry the weight tfscale's update gives each replica, which "
            "only tfscale's own step knows.",
            received=f"tfscale.gather_batch under {type(context.strategy).__name__}, outside "
            "a step of a model trained by tfscale.fit or tfscale.prepare",
            allowed="a model's call, train_step or compute_loss, trained by tfscale.fit or "
            "tfscale.prepare(model) + model.fit",
            fix="train the model with tfscale.fit(model, ...) or tfscale.prepare(model) and "
            "then model.fit(...).",
        )
    )
