"""Scaling sweep: the workload at each replica count, in weak and strong scaling.

One process holds ``max(replicas)`` logical devices and each replica count uses the first N of
them. Logical CPU devices of one process share the host's thread pools whatever their number,
so a subset of 2 out of 4 runs like a process with 2 (and physical GPUs are independent), and
TensorFlow starts once instead of once per replica count.

- weak scaling: the per-replica batch is fixed, the global batch grows with N;
- strong scaling: the global batch is fixed at ``batch_per_replica * max(replicas)`` and split
  over N (the largest count is the same run as in weak scaling, measured once).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tfscale.errors import ProfileError, explain
from tfscale.profiling import metrics
from tfscale.profiling.harness import MeasuredStep, Workload
from tfscale.profiling.steptime import Breakdown, breakdown, robust_means, time_interleaved
from tfscale.profiling.timeline import capture_steps

__all__ = ["SweepPoint", "devices_for", "ensure_devices", "measure_point", "run_sweep"]

Tick = Callable[[str, int], None]


@dataclass(frozen=True)
class SweepPoint:
    """One measured configuration.

    Attributes:
        mode: ``"weak"`` or ``"strong"``.
        replicas: Number of replicas.
        batch_per_replica: Examples per replica per micro-batch.
        accumulation: Micro-batches accumulated per update.
        breakdown: Its step's breakdown (:func:`~tfscale.profiling.steptime.breakdown`).
        speedup: Throughput over the smallest replica count's (same mode).
        efficiency: Scaling efficiency against the smallest replica count (same mode).
        trace: Shares per class from a profiler trace of a few steps, where captured.
        memory: The memory plan of its step and the allocator's measured peak
            (:func:`tfscale.training.memory.report.memory_record`), where measured.
    """

    mode: str
    replicas: int
    batch_per_replica: int
    accumulation: int
    breakdown: Breakdown
    speedup: float = 1.0
    efficiency: float = 1.0
    trace: dict[str, float] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)

    @property
    def global_batch(self) -> int:
        """Examples per micro-batch over all replicas."""
        return self.batch_per_replica * self.replicas

    @property
    def examples_per_s(self) -> float:
        """Measured training throughput."""
        return self.breakdown.examples_per_s


def replica_limit(kind: str, physical: int) -> int:
    """The most replicas a sweep measures on ``physical`` GPUs or cores.

    Beyond the physical devices, replicas are logical devices sharing them: a few show how
    the step splits (the default sweep 1,2,4 on a 2-core machine), many measure only
    contention, and a large count makes every configuration run for minutes. The limit is
    the larger of 4 and the physical count, and at most 64, tfscale's cap on logical devices
    (:data:`~tfscale.devices.virtual.MAX_VIRTUAL_DEVICES`).
    """
    from tfscale.devices.virtual import MAX_VIRTUAL_DEVICES

    return min(MAX_VIRTUAL_DEVICES, max(4, physical))


def check_replicas(count: int, kind: str, physical: int) -> None:
    """Refuses a replica count the machine cannot measure (see :func:`replica_limit`).

    Raises:
        ProfileError: ``count`` is above the limit.
    """
    limit = replica_limit(kind, physical)
    if count > limit:
        unit = "GPU(s)" if kind == "GPU" else "CPU core(s)"
        raise ProfileError(
            explain(
                f"{count} replicas cannot be measured on {physical} {unit}: beyond the "
                "physical devices, replicas are logical devices sharing them, and this many "
                "would measure contention (for minutes), not scaling.",
                received=f"replicas up to {count}",
                allowed=f"1 to {limit} on this machine",
                fix=f"--replicas 1,2,{limit} here, or run on a machine with more devices "
                "(or across processes: --workers N).",
            )
        )


def ensure_devices(count: int, *, cluster: bool = False) -> tuple[str, int]:
    """Makes at least ``count`` devices of the best kind exist, before TensorFlow starts if needed.

    GPUs are used when there are any (one GPU is split into logical GPUs when more replicas
    are asked than exist); otherwise the CPU is split into ``count`` logical devices. A
    cluster worker (``cluster=True``) measures with the devices it has.

    Returns:
        ``(kind, physical device count)``.

    Raises:
        ProfileError: The runtime already started with fewer devices.
    """
    import tensorflow as tf

    from tfscale.devices.discovery import use_virtual_devices
    from tfscale.errors import DeviceConfigError

    gpus = tf.config.list_physical_devices("GPU")
    kind = "GPU" if gpus else "CPU"
    physical = len(gpus) if gpus else (len(os.sched_getaffinity(0)) or 1)
    if not cluster:
        check_replicas(count, kind, physical)
    if cluster:
        # A cluster worker measures over the whole cluster (harness.strategy_for) with the
        # devices it has; the replica count is the cluster's, not a local split.
        return kind, physical
    target = (gpus or tf.config.list_physical_devices("CPU"))[0]
    # Read the configuration, not the device list: listing devices would start the runtime.
    configured = tf.config.get_logical_device_configuration(target)
    have = len(configured) if configured else (len(gpus) if gpus else 1)
    if have < count and (kind == "CPU" or len(gpus) == 1):
        try:
            use_virtual_devices(count, kind)
        except DeviceConfigError as error:
            raise ProfileError(
                explain(
                    f"The sweep needs {count} {kind} devices and this process's TensorFlow "
                    "runtime has already started with fewer.",
                    received=f"{have} logical {kind} device(s)",
                    allowed=f"at least {count}",
                    fix=f"set TFSCALE_VIRTUAL_DEVICES={count} before starting Python, or run "
                    "`tfscale bench`, which sets them itself.",
                )
            ) from error
    if len(devices_for(kind)) < count:
        raise ProfileError(
            explain(
                f"Only {len(devices_for(kind))} {kind} devices exist; {count} replicas were asked.",
                received=count,
                allowed=f"replica counts up to {len(devices_for(kind))}",
            )
        )
    return kind, physical


def devices_for(kind: str) -> list[str]:
    """Names of the logical devices of ``kind`` (starts the runtime)."""
    import tensorflow as tf

    return [d.name for d in tf.config.list_logical_devices(kind)]


def measure_point(
    workload: Workload,
    devices: Sequence[str],
    batch_per_replica: int,
    *,
    accumulation: int = 1,
    jit_compile: bool = False,
    steps: int,
    warmup: int,
    trace_steps: int = 0,
    probe: bool = False,
    on_step: Callable[[], None] | None = None,
    memory: dict[str, Any] | None = None,
) -> tuple[Breakdown, dict[str, float]]:
    """Measures one configuration: its step with and without the all-reduce, interleaved.

    With ``probe``, the step without all-reduce also runs at twice the per-replica batch and
    with twice the accumulation, so that the advice's cost models (local seconds per update
    against the batch, and against the micro-batches per update) are measured at this
    replica count; the results go into ``Breakdown.extra`` as ``local_s_at_2x_batch`` and
    ``local_s_at_2x_accumulation``.

    With ``memory`` (a dict), the step's memory plan is made before it runs and the
    allocator's peak read over ``warmup`` further steps after the warm-up, before anything
    else of this configuration exists (:func:`tfscale.training.memory.report.measure_memory`); the
    dict is filled with both.

    Returns:
        The wall-clock breakdown, and the trace shares (empty unless ``trace_steps``).
    """
    with contextlib.ExitStack() as opened:
        step = opened.enter_context(
            MeasuredStep(
                workload,
                devices,
                batch_per_replica,
                accumulation=accumulation,
                jit_compile=jit_compile,
            )
        )
        if memory is not None:
            from tfscale.training.memory.report import measure_memory

            memory.update(measure_memory(step, devices, steps=max(2, warmup)))
        runs = [(step.with_reduce, step.examples_per_step)]
        if step.without_reduce is not None:
            runs.append((step.without_reduce, step.examples_per_step))
        probes = {
            "local_s_at_2x_batch": (2 * batch_per_replica, accumulation),
            "local_s_at_2x_accumulation": (batch_per_replica, 2 * accumulation),
        }
        for batch, k in probes.values() if probe else ():
            other = opened.enter_context(
                MeasuredStep(workload, devices, batch, accumulation=k, jit_compile=jit_compile)
            )
            runs.append((other.without_reduce or other.with_reduce, other.examples_per_step))
        times = time_interleaved(runs, steps=steps, warmup=warmup, on_step=on_step)
        # Input wait from an uninterrupted run; its first steps drain what the pipeline
        # buffered while the other runs had their turns.
        drain = max(3, steps // 3)
        (contiguous,) = time_interleaved(
            [(step.with_reduce, step.examples_per_step)],
            steps=steps,
            warmup=drain,
            on_step=on_step,
        )
        result = breakdown(
            times[0],
            times[1] if step.without_reduce is not None else None,
            step.fetch_floor(),
            contiguous,
        )
        if probe:
            for name, probe_times in zip(probes, times[-len(probes) :], strict=True):
                result.extra[name] = sum(robust_means(probe_times))
        trace: dict[str, float] = {}
        if trace_steps:
            with tempfile.TemporaryDirectory(prefix="tfscale-trace-") as logdir:
                trace = capture_steps(step.with_reduce, trace_steps, logdir)
    return result, trace


def run_sweep(
    workload: Workload,
    replicas: Sequence[int],
    batch_per_replica: int,
    *,
    accumulation: Sequence[int] = (1,),
    steps: int = 20,
    warmup: int = 3,
    strong: bool = True,
    trace_steps: int = 3,
    jit_compile: bool = False,
    probes: bool = True,
    tick: Tick | None = None,
    cluster: bool = False,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    """Measures weak scaling (for each accumulation) and strong scaling over ``replicas``.

    Args:
        workload: What to train.
        replicas: Replica counts, e.g. ``(1, 2, 4)``.
        batch_per_replica: Per-replica micro-batch in weak scaling.
        accumulation: Accumulation counts; weak scaling is measured for each.
        steps: Measured steps per configuration (and again without the all-reduce).
        warmup: Unmeasured steps first.
        strong: Also measure strong scaling (global batch ``batch_per_replica * max``).
        trace_steps: Steps captured with the profiler per weak configuration (0: none).
        jit_compile: Compile the per-replica step with XLA.
        probes: Measure the advice's cost probes at the largest replica count.
        tick: ``tick(description, steps_done)`` progress callback.
        on_point: Called with each configuration as soon as it is measured.
        cluster: Measure as one worker of a ``bench --workers`` cluster (devices as they are).

    Returns:
        Weak points (per accumulation, ascending replicas), then strong points.
    """
    counts = sorted(set(replicas))
    if not counts or counts[0] < 1:
        raise ProfileError(explain("Replica counts must be positive.", received=list(replicas)))
    kind, _ = ensure_devices(counts[-1], cluster=cluster)
    devices = devices_for(kind)
    points: list[SweepPoint] = []

    def measure(
        mode: str, n: int, batch: int, k: int, trace: int, probe: bool = False
    ) -> SweepPoint:
        def on_step() -> None:
            if tick:
                tick(f"{mode} scaling, {n} replica(s), batch {batch}/replica, accumulation {k}", 1)

        memory: dict[str, Any] = {}
        result, shares = measure_point(
            workload,
            devices[:n],
            batch,
            accumulation=k,
            jit_compile=jit_compile,
            steps=steps,
            warmup=warmup,
            trace_steps=trace,
            probe=probe,
            on_step=on_step,
            memory=memory,
        )
        point = SweepPoint(mode, n, batch, k, result, trace=shares, memory=memory)
        if on_point:
            on_point(point)
        return point

    for k in accumulation:
        weak = [
            measure("weak", n, batch_per_replica, k, trace_steps, probe=probes and n == counts[-1])
            for n in counts
        ]
        points.extend(_with_scaling(weak))
    if strong and len(counts) > 1:
        global_batch = batch_per_replica * counts[-1]
        first_k = accumulation[0]
        strong_points = [
            measure("strong", n, global_batch // n, first_k, 0)
            for n in counts[:-1]
            if global_batch % n == 0
        ]
        largest = next(p for p in points if p.replicas == counts[-1] and p.accumulation == first_k)
        strong_points.append(
            SweepPoint(
                "strong",
                largest.replicas,
                largest.batch_per_replica,
                first_k,
                largest.breakdown,
                trace=largest.trace,
                memory=largest.memory,
            )
        )
        points.extend(_with_scaling(strong_points))
    return points


def _with_scaling(points: list[SweepPoint]) -> list[SweepPoint]:
    """Fills speedup and efficiency against the smallest replica count of ``points``."""
    base = min(points, key=lambda p: p.replicas)
    out = []
    for point in points:
        out.append(
            SweepPoint(
                point.mode,
                point.replicas,
                point.batch_per_replica,
                point.accumulation,
                point.breakdown,
                metrics.speedup(point.examples_per_s, base.examples_per_s),
                metrics.scaling_efficiency(
                    point.examples_per_s, base.examples_per_s, point.replicas, base.replicas
                ),
                point.trace,
                point.memory,
            )
        )
    return out


def planned_steps(
    replicas: Sequence[int],
    accumulation: Sequence[int],
    steps: int,
    warmup: int,
    strong: bool,
    probes: bool = True,
) -> int:
    """Number of steps :func:`run_sweep` will run (for a progress bar's total)."""
    counts = sorted(set(replicas))
    drain = max(3, steps // 3)
    per_point = {n: (steps + warmup) * (2 if n > 1 else 1) + steps + drain for n in counts}
    total = (sum(per_point.values()) + 2 * (steps + warmup) * probes) * len(accumulation)
    if strong and len(counts) > 1:
        total += sum(per_point[n] for n in counts[:-1])
    return total
