"""Collectives benchmark: all-reduce buffers with the strategy's cross-device ops, report bandwidth.

Buffers of a range of sizes, and the model's real gradients (all of them in one call, as a
training step reduces them), are summed across replicas with the same
``ReplicaContext.all_reduce`` a training step uses, so the strategy's own cross-device ops
(NCCL on GPUs, collective ring on CPUs) do the work. Bandwidths follow nccl-tests:
``algbw = bytes / time`` and ``busbw = algbw * 2 (n - 1) / n``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tfscale.interop.internals import all_reduce_without_gradient, cross_device_ops
from tfscale.profiling import metrics

__all__ = ["DEFAULT_SIZES", "CollectiveResult", "benchmark_allreduce"]

DEFAULT_SIZES: tuple[int, ...] = (4 * 1024, 64 * 1024, 1024 * 1024, 16 * 1024 * 1024)


@dataclass(frozen=True)
class CollectiveResult:
    """One all-reduce measurement.

    Attributes:
        label: ``"4 KiB"`` or ``"model gradients (6 tensors)"``.
        size_bytes: Bytes reduced per replica per call.
        replicas: Number of participating replicas.
        seconds: Median seconds per all-reduce.
        algbw: Algorithm bandwidth, bytes/s.
        busbw: Bus bandwidth, bytes/s.
        implementation: Class name of the strategy's cross-device ops.
    """

    label: str
    size_bytes: int
    replicas: int
    seconds: float
    algbw: float
    busbw: float
    implementation: str


def _human(size: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def benchmark_allreduce(
    strategy: Any,
    sizes: Sequence[int] = DEFAULT_SIZES,
    gradient_sizes: Sequence[int] = (),
    repeats: int = 10,
    on_step: Callable[[], None] | None = None,
) -> list[CollectiveResult]:
    """All-reduces float32 buffers of each size, and the model's gradients, and times them.

    Args:
        strategy: A multi-replica strategy (Mirrored or MultiWorkerMirrored).
        sizes: Buffer sizes in bytes.
        gradient_sizes: Bytes of each of the model's gradients; reduced as one packed buffer,
            as ``tfscale.fit`` packs them into one all-reduce per update.
        repeats: Timed calls per size (after one warm-up call); the median is reported.
        on_step: Called after each size, e.g. to advance a progress bar.

    Returns:
        One result per size, then one for the model's gradients if given.
    """
    import tensorflow as tf

    replicas = int(strategy.num_replicas_in_sync)
    ops = cross_device_ops(strategy)
    implementation = type(ops).__name__ if ops is not None else type(strategy).__name__

    @tf.function
    def reduce(buffers: Any) -> Any:
        def replica(*values: Any) -> Any:
            # The identity places each buffer on the replica's device: under
            # MultiWorkerMirroredStrategy an all-reduce of a function input that has no
            # device fails with "destinations can not be empty".
            placed = [tf.identity(value) for value in values]
            # The update's own all-reduce (training/allreduce.py), which frees its graph.
            context = tf.distribute.get_replica_context()
            return all_reduce_without_gradient(context, tf.distribute.ReduceOp.SUM, placed)

        return strategy.run(replica, args=tuple(buffers))

    cases: list[tuple[str, list[int]]] = [(_human(s), [s]) for s in sizes]
    if gradient_sizes:
        total = sum(gradient_sizes)
        label = f"model gradients ({len(gradient_sizes)} tensors packed, {_human(total)})"
        cases.append((label, [total]))
    results = []

    def filled(count: int) -> Any:
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.fill([count], 1.0 + float(ctx.replica_id_in_sync_group))
        )

    for label, parts in cases:
        buffers = [filled(max(1, p // 4)) for p in parts]
        _block(reduce(buffers))
        durations = []
        for _ in range(repeats):
            start = time.perf_counter()
            _block(reduce(buffers))
            durations.append(time.perf_counter() - start)
        seconds = metrics.median(durations)
        size = sum(max(1, p // 4) * 4 for p in parts)
        bandwidth = metrics.algbw(size, seconds)
        results.append(
            CollectiveResult(
                label,
                size,
                replicas,
                seconds,
                bandwidth,
                metrics.busbw(bandwidth, replicas),
                implementation,
            )
        )
        if on_step:
            on_step()
    return results


def _block(value: Any) -> None:
    """Waits for every tensor in ``value`` (eager results may still be computing)."""
    import tensorflow as tf

    for tensor in tf.nest.flatten(value, expand_composites=True):
        if hasattr(tensor, "numpy"):
            tensor.numpy()
