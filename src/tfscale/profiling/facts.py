"""The facts the advice rules judge, gathered one way for ``tfscale bench`` and
``tfscale profile``: a report's measured points (the advised configuration, throughput and
compute per replica count, the batch and accumulation cost models) and the hardware and
settings around them (bfloat16 units, a link between devices or workers, XLA, precision).
"""

from __future__ import annotations

from tfscale.profiling.advice import Facts, fit_batch_cost
from tfscale.profiling.report import Report

__all__ = ["bf16_available", "facts_for"]


def facts_for(
    report: Report,
    *,
    jit_compile: bool = False,
    over_a_link: bool = False,
    bf16: bool | None = None,
    precision: str = "float32",
) -> Facts:
    """The facts the advice rules judge, from a report's measurements: the one way
    ``tfscale bench`` and ``tfscale profile`` give them to :func:`advise`, so that the same
    numbers fire the same rules from either command.

    Args:
        report: The measured points (advice is about :meth:`Report.advised_point`).
        jit_compile: Whether the measured step is compiled with XLA.
        over_a_link: The all-reduce crosses a link (GPUs, worker processes); see
            :class:`Facts`.
        bf16: Whether the hardware has fast bfloat16 units (None: :func:`bf16_available`
            of this process's devices of the report's kind).
        precision: The measured step's precision policy.
    """
    point = report.advised_point()
    by_replicas = {
        p.replicas: p.examples_per_s
        for p in report.points
        if p.mode == point.mode and p.accumulation == point.accumulation
    }
    compute_by_replicas = {
        p.replicas: p.breakdown.compute_s
        for p in report.points
        if p.batch_per_replica == point.batch_per_replica and p.accumulation == point.accumulation
    }
    local = point.breakdown.step_s - point.breakdown.communication_s
    examples = point.batch_per_replica * point.accumulation
    costs = {examples: local}
    if "local_s_at_2x_batch" in point.breakdown.extra:
        costs[2 * examples] = point.breakdown.extra["local_s_at_2x_batch"]
    accumulation_cost = None
    extra = point.breakdown.extra
    if "local_s_at_2x_accumulation" in extra:
        # Slope per micro-batch from 1x (fused) to 2x (accumulating): it also carries the
        # accumulators' fixed cost, so the prediction errs on the cautious side.
        k = point.accumulation
        two = extra["local_s_at_2x_accumulation"]
        slope = max((two - local) / k, 0.0)
        accumulation_cost = (max(two - slope * 2 * k, 0.0), slope)
    return Facts(
        breakdown=point.breakdown,
        replicas=point.replicas,
        batch_per_replica=point.batch_per_replica,
        accumulation=point.accumulation,
        device_kind=report.device_kind,
        physical_devices=report.physical_devices,
        throughput_by_replicas=by_replicas,
        compute_by_replicas=compute_by_replicas,
        batch_cost=fit_batch_cost(costs),
        accumulation_cost=accumulation_cost,
        bf16_available=bf16_available(report.device_kind) if bf16 is None else bf16,
        precision=precision,
        jit_compile=jit_compile,
        over_a_link=over_a_link,
    )


def bf16_available(kind: str) -> bool:
    """Fast bfloat16 matrix units: a GPU of compute capability >= 8.0, or a CPU with AMX."""
    if kind == "GPU":
        import tensorflow as tf

        for gpu in tf.config.list_physical_devices("GPU"):
            capability = tf.config.experimental.get_device_details(gpu).get("compute_capability")
            if capability and capability[0] >= 8:
                return True
        return False
    try:
        with open("/proc/cpuinfo") as handle:
            return "amx_bf16" in handle.read()
    except OSError:
        return False
