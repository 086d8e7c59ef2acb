"""``tfscale.profile``: sweep, collectives, advice, verification and report in one call.

This is what ``tfscale bench`` runs. It measures the workload at each replica count, splits
each step into input wait, compute and exposed communication, benchmarks the all-reduce,
turns the breakdown of the largest configuration into advice with predicted effects and,
with ``verify=True``, applies the top applicable advice and measures what it really buys.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from tfscale.errors import ProfileError, explain
from tfscale.profiling import metrics
from tfscale.profiling.advice import Advice, Facts, advise
from tfscale.profiling.agree import agree_points
from tfscale.profiling.collectives import DEFAULT_SIZES, benchmark_allreduce
from tfscale.profiling.facts import facts_for, gather_environment
from tfscale.profiling.harness import MeasuredStep, Workload, resolve_workload, strategy_for
from tfscale.profiling.report import Report, write_report
from tfscale.profiling.steptime import robust_means, time_interleaved
from tfscale.profiling.sweep import (
    devices_for,
    ensure_devices,
    planned_steps,
    run_sweep,
)

__all__ = ["measure_as_worker", "profile", "verify_advice"]


def profile(
    model: str | Callable[[], Any] = "mlp",
    *,
    replicas: Sequence[int] = (1, 2, 4),
    batch_per_replica: int = 64,
    accumulation: Sequence[int] = (1,),
    steps: int = 20,
    warmup: int = 3,
    out: str | None = None,
    verify: bool = False,
    dataset_fn: Callable[[Any], Any] | None = None,
    strong: bool = True,
    trace_steps: int = 3,
    collectives: bool = True,
    jit_compile: bool = False,
    probes: bool = True,
    progress: bool = True,
    workers: int = 1,
    timeout_s: float = 900.0,
    project: Sequence[int] = (),
    interconnect: str = "ethernet-25g",
    intra: str | None = None,
    gpus_per_node: int = 1,
) -> Report:
    """Measures how a workload scales over replicas and says what to change.

    Args:
        model: ``"mlp"`` or ``"cnn"`` (embedded, on the digits data), ``"module:function"``
            or a callable returning a Keras classifier (measured on random data of its shape).
        replicas: Replica counts to measure (logical CPU devices where there is no GPU).
        batch_per_replica: Per-replica batch of weak scaling; the strong-scaling global batch
            is ``batch_per_replica * max(replicas)``.
        accumulation: Accumulation counts measured in weak scaling.
        steps: Measured steps per configuration (warm-up excluded).
        warmup: Unmeasured steps per configuration.
        out: Directory for report.json, report.md and report.html (None: no files).
        verify: Apply the top applicable advice, re-measure, record predicted vs measured.
        dataset_fn: Transformation of the batched ``tf.data.Dataset`` (e.g. preprocessing).
        strong: Also measure strong scaling.
        trace_steps: Steps captured with the TensorFlow profiler per weak configuration.
        collectives: Benchmark the all-reduce at the largest replica count.
        jit_compile: Compile the per-replica step with XLA.
        probes: Measure the step at 2x batch and 2x accumulation (no all-reduce) at the
            largest replica count, for the advice's predictions (proportional without).
        progress: Show a progress bar.
        workers: With 2 or more, measure across that many worker processes on this host
            (``MultiWorkerMirroredStrategy`` over gRPC on 127.0.0.1, one replica per
            worker, as on several machines) instead of over local devices; ``replicas``
            and ``strong`` are then ignored. ``model`` must be importable by the workers
            (``"mlp"``, ``"cnn"``, ``"module:function"`` or a module-level function) and
            ``dataset_fn`` is not supported.
        timeout_s: With ``workers``, seconds before the workers are stopped.
        project: Replica counts to project to with the α-β model
            (:mod:`tfscale.profiling.projection`) from the measured local step and gradient
            bytes; added as points of mode ``"projected"`` with their assumptions.
        interconnect: The link between nodes of the projection (a preset name).
        intra: The link inside a node, with ``gpus_per_node > 1``.
        gpus_per_node: Replicas per node of the projection.

    Returns:
        The report (also written to ``out`` when given).

    Raises:
        ProfileError: Devices cannot be set up, or the model cannot be measured.
    """
    links = None
    if project:
        from tfscale.profiling.projection import check_links
        from tfscale.profiling.projection import interconnect as preset

        links = (preset(interconnect), preset(intra) if intra else None)
        check_links(gpus_per_node, links[1])  # known before measuring: refuse now
    check_settings(
        replicas=replicas,
        batch_per_replica=batch_per_replica,
        accumulation=accumulation,
        steps=steps,
        warmup=warmup,
        trace_steps=trace_steps,
        workers=workers,
        timeout_s=timeout_s,
        project=project,
        gpus_per_node=gpus_per_node,
    )
    settings: dict[str, Any] = {
        "batch_per_replica": batch_per_replica,
        "accumulation": list(accumulation),
        "steps": steps,
        "warmup": warmup,
        "verify": verify,
        "trace_steps": trace_steps,
        "collectives": collectives,
        "jit_compile": jit_compile,
        "probes": probes,
    }
    if workers > 1:
        # The workers run measure_as_worker() below, each as one task of a local cluster.
        from tfscale.profiling.workers import profile_workers

        report = profile_workers(
            model,
            workers,
            timeout_s=timeout_s,
            out=None,
            progress=progress,
            settings=settings,
            dataset_fn=dataset_fn,
        )
    else:
        report = _measure(
            model,
            replicas=replicas,
            strong=strong,
            dataset_fn=dataset_fn,
            progress=progress,
            cluster=False,
            **settings,
        )
    if links:
        report = with_projection(report, project, *links, per_node=gpus_per_node)
    if out:
        write_report(report, out)
    return report


def with_projection(
    report: Report,
    replicas: Sequence[int],
    inter: Any,
    intra: Any = None,
    *,
    per_node: int = 1,
) -> Report:
    """``report`` with projected points (mode ``"projected"``) and the α-β fit of its
    measured all-reduces.

    The local step is the measured one of the fewest replicas in weak scaling, without its
    communication; the bytes are the model's float32 gradients.
    """
    import dataclasses

    from tfscale.profiling.projection import assumptions, fit_alpha_beta, project
    from tfscale.profiling.steptime import Breakdown
    from tfscale.profiling.sweep import SweepPoint
    from tfscale.training.allreduce import choose_bucket_bytes

    weak = [p for p in report.points if p.mode == "weak" and p.accumulation == 1]
    base = min(weak or report.points, key=lambda p: p.replicas)
    local = base.breakdown.step_s - base.breakdown.communication_s
    gradient_bytes = float(report.settings.get("gradient_bytes", 0))
    compression = 1.0
    rows = project(
        local_step_s=local,
        gradient_bytes=gradient_bytes,
        batch_per_replica=base.batch_per_replica,
        replicas=replicas,
        inter=inter,
        intra=intra,
        per_node=per_node,
        compression=compression,
    )
    single = base.batch_per_replica / local
    points = [
        SweepPoint(
            "projected",
            row.replicas,
            base.batch_per_replica,
            1,
            Breakdown(
                row.step_s,
                0.0,
                local,
                row.allreduce_s,
                row.replicas * base.batch_per_replica,
                method="alpha-beta",
            ),
            speedup=row.examples_per_s / single,
            efficiency=row.efficiency,
        )
        for row in rows
    ]
    settings = dict(report.settings)
    settings["projection"] = assumptions(
        local_step_s=local,
        gradient_bytes=gradient_bytes,
        inter=inter,
        intra=intra,
        per_node=per_node,
        compression=compression,
    )
    notes = [
        *report.notes,
        f"Projected rows (mode 'projected') are not measurements: the measured local step "
        f"({local * 1e3:.2f} ms at {base.batch_per_replica}/replica) plus an α-β "
        f"{settings['projection']['model']} of {gradient_bytes / 2**20:.1f} MiB of gradients "
        f"over {inter.name}"
        + (f" between nodes of {per_node} on {intra.name}" if intra is not None else "")
        + " at nominal line rates, not overlapped; docs/profiling.md compares the model "
        "with published runs.",
    ]
    sized = [(c.size_bytes, c.seconds) for c in report.collectives if c.replicas > 1]
    if len({size for size, _ in sized}) >= 2:
        alpha, beta = fit_alpha_beta([s for s, _ in sized], [t for _, t in sized])
        bucket = choose_bucket_bytes(int(gradient_bytes), alpha, beta)
        settings["alpha_beta"] = {
            "alpha_s": alpha,
            "beta_s_per_byte": beta,
            "bandwidth_bytes_per_s": 1 / beta if beta else None,
            "recommended_bucket_bytes": bucket,
        }
        notes.append(
            f"This machine's all-reduce, fitted: α = {alpha * 1e6:.0f} µs, "
            f"{(1 / beta if beta else float('inf')) / 1e9:.2f} GB/s; "
            + (
                f"bucket_bytes={bucket} is the α-β optimum for these gradients."
                if bucket
                else "one packed all-reduce is cheaper than buckets for these gradients."
            )
        )
    return dataclasses.replace(
        report, points=[*report.points, *points], settings=settings, notes=notes
    )


def check_settings(
    *,
    replicas: Sequence[int],
    batch_per_replica: int,
    accumulation: Sequence[int],
    steps: int,
    warmup: int,
    trace_steps: int,
    workers: int,
    timeout_s: float,
    project: Sequence[int] = (),
    gpus_per_node: int = 1,
) -> None:
    """Refuses, before any device is set up, a setting the sweep cannot measure.

    The replica count against the devices is checked where they are known
    (:func:`~tfscale.profiling.sweep.check_replicas`); the worker count here, against this
    host's cores or GPUs (each worker one process and one replica).

    Raises:
        ProfileError: Naming the setting, what was received and what is allowed.
    """

    def refuse(what: str, received: object, allowed: str, fix: str) -> NoReturn:
        raise ProfileError(explain(what, received=received, allowed=allowed, fix=fix))

    for name, value, least in (
        ("steps", steps, 1),
        ("batch_per_replica", batch_per_replica, 1),
        ("warmup", warmup, 0),
        ("trace_steps", trace_steps, 0),
        ("workers", workers, 1),
        ("gpus_per_node", gpus_per_node, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            refuse(
                f"{name} must be a whole number >= {least}"
                + (
                    ": with no measured step there is nothing to report."
                    if name == "steps"
                    else "."
                ),
                value,
                f"{least} or more",
                f"--{name.replace('_', '-')} {max(least, 20 if name == 'steps' else least)}",
            )
    for name, counts in (("replicas", replicas), ("accumulation", accumulation)):
        if not list(counts) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts
        ):
            refuse(f"{name} must be counts >= 1.", list(counts), "e.g. 1,2,4", f"--{name} 1,2")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in project):
        refuse(
            "--project must be replica counts >= 1.",
            list(project),
            "e.g. 8,64,512",
            "--project 8,64,512",
        )
    if timeout_s <= 0:
        refuse("timeout_s must be positive.", timeout_s, "seconds > 0", "timeout_s=900")
    if workers > 1:
        from tfscale.launch.gpus import visible_gpus
        from tfscale.profiling.sweep import replica_limit

        gpus = len(visible_gpus(dict(os.environ)))
        physical = gpus or len(os.sched_getaffinity(0)) or 1
        limit = replica_limit("GPU" if gpus else "CPU", physical)
        if workers > limit:
            unit = "GPU(s)" if gpus else "CPU core(s)"
            refuse(
                f"{workers} worker processes cannot be measured on {physical} {unit} of this "
                "host: each is a TensorFlow process with one replica, and this many would "
                "measure contention, not communication.",
                workers,
                f"2 to {limit} here",
                f"--workers {min(limit, 2)}, or the launcher across machines",
            )


def measure_as_worker(model: str, **settings: Any) -> Report:
    """One worker's part of ``profile(workers=N)``: the same measurement, as a task of the
    cluster its ``TF_CONFIG`` describes (one ``MultiWorkerMirroredStrategy`` over every
    worker; the timings agreed across workers before advice). Run by
    ``tfscale.profiling.worker`` in each worker process.
    """
    return _measure(
        model,
        replicas=(1,),
        strong=False,
        dataset_fn=None,
        progress=False,
        cluster=True,
        **settings,
    )


def _measure(
    model: str | Callable[[], Any],
    *,
    replicas: Sequence[int],
    batch_per_replica: int,
    accumulation: Sequence[int],
    steps: int,
    warmup: int,
    verify: bool,
    dataset_fn: Callable[[Any], Any] | None,
    strong: bool,
    trace_steps: int,
    collectives: bool,
    jit_compile: bool,
    probes: bool,
    progress: bool,
    cluster: bool,
) -> Report:
    """The measurement behind :func:`profile` (local devices) and :func:`measure_as_worker`."""
    counts = sorted(set(replicas))
    if cluster:
        # Every worker process measures the cluster's replicas together (one strategy per
        # process, built before the runtime starts); there is one configuration to sweep.
        counts = [int(strategy_for(()).num_replicas_in_sync)]
        strong = False
    kind, physical = ensure_devices(counts[-1], cluster=cluster)
    workload = resolve_workload(model, dataset_fn)
    devices = devices_for(kind)
    total = planned_steps(counts, accumulation, steps, warmup, strong, probes)
    with _progress(progress, total) as (tick, say):
        unit = "GPUs" if kind == "GPU" else "cores"
        say(
            f"Measuring {workload.name} on {kind} ({physical} {unit}): replicas "
            f"{','.join(map(str, counts))}, batch {batch_per_replica}/replica, {steps} steps each"
        )
        points = run_sweep(
            workload,
            counts,
            batch_per_replica,
            accumulation=accumulation,
            steps=steps,
            warmup=warmup,
            strong=strong,
            trace_steps=trace_steps,
            jit_compile=jit_compile,
            probes=probes,
            tick=tick,
            cluster=cluster,
            on_point=lambda p: say(
                f"  {p.mode} scaling, {p.replicas} replica(s), batch {p.batch_per_replica}/replica"
                f", accumulation {p.accumulation}: {p.examples_per_s:,.0f} examples/s "
                f"(step {1000 * p.breakdown.step_s:.2f} ms)"
            ),
        )
        if cluster:
            points = agree_points(points, strategy_for(()))
        results = []
        if collectives and counts[-1] > 1:
            tick("all-reduce bandwidth", 0)
            results = benchmark_allreduce(
                strategy_for(devices[: counts[-1]]), DEFAULT_SIZES, _gradient_sizes(workload)
            )
        report = Report(
            workload=workload.name,
            device_kind=kind,
            physical_devices=physical,
            settings={
                "replicas": counts,
                "batch_per_replica": batch_per_replica,
                "accumulation": list(accumulation),
                "steps": steps,
                "warmup": warmup,
                "jit_compile": jit_compile,
                "gradient_bytes": sum(_gradient_sizes(workload)),
            },
            points=points,
            collectives=results,
            notes=_NOTES,
        )
        # The same facts as tfscale profile's (profiling/facts.py), gathered here, where
        # the step was measured.
        environment = gather_environment(jit_compile=jit_compile, multi_worker=cluster)
        facts = facts_for(report, environment)
        advice = advise(facts)
        verification = None
        if verify:
            tick("verifying the top advice", 0)
            verification = verify_advice(
                workload,
                devices,
                facts,
                advice,
                steps=steps,
                warmup=warmup,
                jit_compile=jit_compile,
            )
    return Report(**{**report.__dict__, "advice": advice, "verification": verification})


_NOTES = [
    "Wall-clock method: input = time blocked fetching the update's batches beyond the fixed cost "
    "of a fetch whose batch is ready (that cost counts as host overhead, in compute); "
    "exposed communication = step "
    "execution minus the same step without the gradient all-reduce at the same per-replica "
    "batch (timed in alternating chunks); compute = the rest, host overhead included.",
    "Trace method (last column): a TensorFlow profiler capture of a few steps; overlaps removed "
    "with a sweep (compute > communication > input); 'other' is time with no op running "
    "(Python dispatch, profiler overhead).",
    "Measured steps are tfscale.fit's own update (tfscale.Trainer with the model's optimizer) "
    "on the strategy choose_strategy() builds for the devices.",
]


def _gradient_sizes(workload: Workload) -> list[int]:
    import numpy as np

    return [int(np.prod(v.shape)) * 4 for v in workload.build().trainable_variables]


def verify_advice(
    workload: Workload,
    devices: Sequence[str],
    facts: Facts,
    advice: Sequence[Advice],
    *,
    steps: int,
    warmup: int,
    jit_compile: bool = False,
) -> dict[str, Any] | None:
    """Applies the first advice that can be applied automatically and measures its effect.

    The configuration as measured and the changed one are timed in alternating chunks in this
    process, so both see the same machine load.

    Returns:
        ``{"key", "change", "predicted_speedup", "measured_speedup", ...}``, or None when no
        advice can be applied automatically.
    """
    applicable = [a for a in advice if a.change]
    if not applicable:
        return None
    chosen = applicable[0]
    skipped = [a.key for a in advice[: advice.index(chosen)]]
    base: dict[str, Any] = {
        "replicas": facts.replicas,
        "batch_per_replica": facts.batch_per_replica,
        "accumulation": facts.accumulation,
        "jit_compile": jit_compile,
        "gradient_compression": facts.gradient_compression,
    }
    changed = {**base, **chosen.change}
    with contextlib.ExitStack() as opened:
        steps_ = [
            opened.enter_context(
                MeasuredStep(
                    workload,
                    devices[: config["replicas"]],
                    config["batch_per_replica"],
                    accumulation=config["accumulation"],
                    jit_compile=bool(config["jit_compile"]),
                    gradient_compression=config["gradient_compression"],
                )
            )
            for config in (base, changed)
        ]
        before, after = time_interleaved(
            [(s.with_reduce, s.examples_per_step) for s in steps_],
            steps=max(steps, 10),
            warmup=warmup,
        )
    rates = [metrics.throughput(t.examples_per_step, sum(robust_means(t))) for t in (before, after)]
    measured = metrics.speedup(rates[1], rates[0])
    return {
        "key": chosen.key,
        "change": chosen.change,
        "measured": {"baseline": base, "changed": changed},
        "skipped_not_automatic": skipped,
        "predicted_speedup": chosen.predicted_speedup,
        "measured_speedup": measured,
        "baseline_examples_per_s": rates[0],
        "changed_examples_per_s": rates[1],
        "relative_error": abs(measured - chosen.predicted_speedup) / chosen.predicted_speedup,
    }


@contextlib.contextmanager
def _progress(
    enabled: bool, total: int
) -> Iterator[tuple[Callable[[str, int], None], Callable[[str], None]]]:
    """A rich progress bar on stderr; yields ``tick(description, advance)`` and ``say(line)``
    (a line kept above the bar, shown as each configuration is measured, also where stderr
    is not a terminal and the bar is not drawn)."""
    if not enabled:
        yield (lambda description, advance: None), (lambda line: None)
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task("starting", total=total)

        def tick(description: str, advance: int) -> None:
            bar.update(task, description=description, advance=advance)

        def say(line: str) -> None:
            bar.console.print(line, soft_wrap=True, markup=False)

        yield tick, say
