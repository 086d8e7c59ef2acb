"""The facts the advice rules judge, gathered one way for ``tfscale bench`` and
``tfscale profile``: a report's measured points (the advised configuration, throughput and
compute per replica count, the batch and accumulation cost models) and the hardware and
settings around them (:class:`Environment`: bfloat16 units, a link between devices or
workers, XLA, precision).

``bench`` gathers its environment in the process it measures in; ``profile`` in the child
that runs the user's script, which writes it next to its steps (:meth:`Environment.to_json`)
for the parent to read back. Either way :func:`facts_for` turns report and environment into
the rules' :class:`~tfscale.profiling.advice.Facts`, so the same numbers fire the same rules.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tfscale.profiling.advice import Facts, fit_batch_cost
from tfscale.profiling.report import Report

__all__ = ["Environment", "bf16_available", "facts_for", "gather_environment"]


@dataclass(frozen=True)
class Environment:
    """The hardware and settings around a measured step, as the advice rules need them.

    Attributes:
        device_kind: ``"GPU"`` or ``"CPU"``.
        physical_devices: Physical GPUs, or CPU cores where there is no GPU.
        bf16_available: Fast bfloat16 matrix units (:func:`bf16_available`).
        precision: The Keras precision policy of the measured step (``float32``, ...).
        jit_compile: Whether the measured step is compiled with XLA.
        multi_worker: The step ran in a cluster of worker processes.
    """

    device_kind: str
    physical_devices: int
    bf16_available: bool = False
    precision: str = "float32"
    jit_compile: bool = False
    multi_worker: bool = False

    @property
    def over_a_link(self) -> bool:
        """The all-reduce crosses a link (between GPUs, or worker processes), so its time
        follows its bytes; between CPU devices of one process it is a memory copy."""
        return self.device_kind == "GPU" or self.multi_worker

    def to_json(self) -> dict[str, Any]:
        """Plain data (what ``tfscale profile``'s child writes next to its steps)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Environment:
        """The environment :meth:`to_json` wrote (other keys of ``data`` are ignored)."""
        return cls(
            device_kind=str(data.get("device_kind", "CPU")),
            physical_devices=int(data.get("physical_devices", 1)),
            bf16_available=bool(data.get("bf16_available", False)),
            precision=str(data.get("precision", "float32")),
            jit_compile=bool(data.get("jit_compile", False)),
            multi_worker=bool(data.get("multi_worker", False)),
        )


def gather_environment(
    *, jit_compile: bool = False, multi_worker: bool | None = None
) -> Environment:
    """This process's environment (imports TensorFlow and Keras).

    Args:
        jit_compile: Whether the measured step is compiled with XLA.
        multi_worker: The step runs in a cluster (None: whether this process has one,
            ``cluster_from_env``).
    """
    import keras
    import tensorflow as tf

    from tfscale.cluster import cluster_from_env

    gpus = len(tf.config.list_physical_devices("GPU"))
    kind = "GPU" if gpus else "CPU"
    return Environment(
        device_kind=kind,
        physical_devices=gpus or (len(os.sched_getaffinity(0)) or 1),
        bf16_available=bf16_available(kind),
        precision=str(keras.mixed_precision.global_policy().name),
        jit_compile=jit_compile,
        multi_worker=cluster_from_env() is not None if multi_worker is None else multi_worker,
    )


def facts_for(report: Report, environment: Environment) -> Facts:
    """The facts the advice rules judge: a report's measurements and the environment they
    were taken in. The one way ``tfscale bench`` and ``tfscale profile`` give them to
    :func:`~tfscale.profiling.advice.advise`, so that the same numbers fire the same rules
    from either command.

    Args:
        report: The measured points (advice is about :meth:`Report.advised_point`).
        environment: The hardware and settings of the measured step.
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
        device_kind=environment.device_kind,
        physical_devices=environment.physical_devices,
        throughput_by_replicas=by_replicas,
        compute_by_replicas=compute_by_replicas,
        batch_cost=fit_batch_cost(costs),
        accumulation_cost=accumulation_cost,
        bf16_available=environment.bf16_available,
        precision=environment.precision,
        jit_compile=environment.jit_compile,
        over_a_link=environment.over_a_link,
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
