"""The gradient all-reduce: dense gradients packed into buckets, sparse ones gathered.

Dense gradients are flattened and concatenated, so a model with many small weights costs one
collective per bucket, not one per weight. With ``bucket_bytes`` set, the gradients are cut
into buckets of about that size, filled from the last layer's gradient backwards: the
backward pass computes those first, and each bucket's collective depends only on its own
gradients, so TensorFlow's executor starts it while the earlier layers' gradients are still
being computed (PyTorch DDP's buckets, without threads of our own); a gradient of a
bucket's size or more is reduced alone, in place, never cut. Without it, one packed
collective waits for the whole backward pass, which costs the least per byte when a model is
small (see ``choose_bucket_bytes``).

``compression`` casts each dense gradient to bfloat16 or float16 before the all-reduce and
back after it (Horovod's ``Compression.fp16``): half the bytes, and the sum itself is rounded
to the compressed type. ``tf.IndexedSlices`` (the gradient of an ``Embedding`` lookup) are
all-reduced as slices, which TensorFlow implements as a gather of the rows each replica
touched: their bytes grow with the rows touched, not with the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.interop import internals

__all__ = [
    "ALL_REDUCE_SCOPE",
    "COMPRESSIONS",
    "Compression",
    "all_reduce_packed",
    "buckets",
    "check_compression",
    "choose_bucket_bytes",
]

# The name scope of the gradient collectives, so tests and profilers find them in a graph.
ALL_REDUCE_SCOPE = "tfscale_gradient_all_reduce"

Compression = Literal["bf16", "fp16"]
COMPRESSIONS: dict[str, tf.DType] = {"bf16": tf.bfloat16, "fp16": tf.float16}


def check_compression(value: object) -> Compression | None:
    """``gradient_compression=``: None, ``"bf16"`` or ``"fp16"``.

    Raises:
        TrainingError: Another value.
    """
    if value is None or value in COMPRESSIONS:
        return value  # type: ignore[return-value]
    raise TrainingError(
        explain(
            "Unknown gradient_compression.",
            received=repr(value),
            allowed='None (float32), "bf16" or "fp16"',
            fix='gradient_compression="bf16" (float32\'s range; "fp16" needs loss scaling)',
        )
    )


def choose_bucket_bytes(total_bytes: int, alpha_s: float, beta_s_per_byte: float) -> int | None:
    """The bucket size that minimizes an all-reduce's cost under the alpha-beta model.

    With ``n`` buckets of ``total / n`` bytes each costing ``alpha + beta * bytes``, the part
    that cannot hide behind the backward pass is about ``n * alpha + beta * total / n``
    (every bucket's latency, plus the transfer of the last bucket, which waits for the whole
    backward pass): smallest at ``n = sqrt(beta * total / alpha)``, so buckets of
    ``sqrt(alpha * total / beta)`` bytes.

    Args:
        total_bytes: The gradients' bytes per update.
        alpha_s: Fixed seconds per collective (latency).
        beta_s_per_byte: Seconds per byte (inverse bandwidth).

    Returns:
        Bytes per bucket, or None when one packed all-reduce is cheaper (fewer than two
        buckets would be optimal).
    """
    if total_bytes <= 0 or alpha_s <= 0 or beta_s_per_byte <= 0:
        return None
    size = math.sqrt(alpha_s * total_bytes / beta_s_per_byte)
    if size * 2 > total_bytes:
        return None
    return int(size)


def _nbytes(value: Any) -> int:
    count = value.shape.num_elements()
    return int(count if count is not None else 1) * value.dtype.size


def buckets(values: Sequence[Any], bucket_bytes: int | None) -> list[list[int]]:
    """Groups the indices of ``values`` (None skipped) into buckets, last values first.

    Each bucket holds consecutive values, in reverse order, until it reaches
    ``bucket_bytes``; a value of ``bucket_bytes`` or more is a bucket of its own (the
    smaller values before it go in theirs, which starts before its gradient exists, and
    it is all-reduced in place instead of copied into a buffer). None puts everything in
    one bucket.
    """
    present = [i for i in reversed(range(len(values))) if values[i] is not None]
    if not bucket_bytes:
        return [present] if present else []
    out: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in present:
        nbytes = _nbytes(values[index])
        if current and nbytes >= bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
        if size >= bucket_bytes:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out


def _flat_size(tensor: tf.Tensor) -> Any:
    count = tensor.shape.num_elements()
    # A gradient's static shape can be partly unknown (a Dense kernel applied to a 3-D
    # input has a gradient of static shape (None, units)); its size is then read at run time.
    return count if count is not None else tf.size(tensor)


def _reduce_packed(
    values: Sequence[tf.Tensor], context: tf.distribute.ReplicaContext
) -> list[tf.Tensor]:
    """One collective per dtype of ``values`` (usually one in all), each a packed buffer."""
    groups: dict[tf.DType, list[int]] = {}
    for index, value in enumerate(values):
        groups.setdefault(value.dtype, []).append(index)
    # One call per dtype: MultiWorkerMirroredStrategy's collective implementation packs the
    # tensors of one call into one buffer, which fails for mixed dtypes.
    reduced = [
        internals.all_reduce_without_gradient(
            context,
            tf.distribute.ReduceOp.SUM,
            [tf.concat([tf.reshape(values[i], [-1]) for i in indices], axis=0)],
        )[0]
        for indices in groups.values()
    ]
    out: list[Any] = [None] * len(values)
    for flat, indices in zip(reduced, groups.values(), strict=True):
        sizes = [_flat_size(values[i]) for i in indices]
        static = all(isinstance(s, int) for s in sizes)
        pieces = tf.split(flat, sizes if static else tf.stack(sizes), num=len(indices))
        for i, piece in zip(indices, pieces, strict=True):
            shape = values[i].shape
            target = shape if shape.is_fully_defined() else tf.shape(values[i])
            out[i] = tf.ensure_shape(tf.reshape(piece, target), shape)
    return out


def all_reduce_packed(
    values: Sequence[Any],
    context: tf.distribute.ReplicaContext,
    *,
    bucket_bytes: int | None = None,
    compression: Compression | None = None,
    keep: Sequence[int] = (),
) -> list[Any]:
    """Sums ``values`` over all replicas: packed buckets for dense tensors, gathers for slices.

    Args:
        values: Tensors, ``tf.IndexedSlices`` or None (left as None), from replica context,
            in the optimizer's (forward) order.
        context: The current replica context.
        bucket_bytes: Bytes per bucket; None reduces every dense tensor in one collective.
        compression: Reduce dense floating-point tensors in this type; None keeps theirs.
        keep: Indices of values never compressed (e.g. an example count).

    Returns:
        The summed values, in the order given, each with its own shape and dtype.
    """
    target = None if compression is None else COMPRESSIONS[compression]
    dense: list[Any] = [None] * len(values)
    sparse: list[int] = []
    for index, value in enumerate(values):
        if isinstance(value, tf.IndexedSlices):
            sparse.append(index)
        elif value is not None:
            cast = target is not None and index not in keep and value.dtype.is_floating
            dense[index] = tf.cast(value, target) if cast else value
    out: list[Any] = list(values)
    # Compressed, the values kept in their own type cannot share a bucket's buffer. They go
    # in a collective of their own, created first: collectives run in the order they are
    # created, and the example count is known before the backward pass, so its collective
    # runs during it instead of adding a round trip after the last gradient.
    first = [i for i in keep if target is not None and dense[i] is not None]
    with tf.name_scope(ALL_REDUCE_SCOPE):
        if first:
            for index, summed in zip(
                first, _reduce_packed([dense[i] for i in first], context), strict=True
            ):
                out[index] = summed
            dense = [None if i in first else value for i, value in enumerate(dense)]
        for bucket in buckets(dense, bucket_bytes):
            for index, summed in zip(
                bucket, _reduce_packed([dense[i] for i in bucket], context), strict=True
            ):
                out[index] = tf.cast(summed, values[index].dtype)
        if sparse:
            gathered = internals.all_reduce_without_gradient(
                context, tf.distribute.ReduceOp.SUM, [values[i] for i in sparse]
            )
            for index, slices in zip(sparse, gathered, strict=True):
                out[index] = slices
    return out
