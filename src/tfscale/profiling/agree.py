"""The cluster's one set of timings: each worker's measurements replaced by their mean.

Used by the workers of ``tfscale bench --workers N`` (``profiling/bench.py``) before advice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tfscale.profiling.sweep import SweepPoint

__all__ = ["agree_points"]


def agree_points(points: Sequence[SweepPoint], strategy: Any) -> list[SweepPoint]:
    """Replaces each worker's timings by their mean over the cluster's workers.

    Every worker times the same synchronous steps, but each with its own clock and noise;
    advice and ``--verify`` must then build the same configurations on every worker (their
    variables are created with collective broadcasts, which fail or hang when workers
    diverge), so they all judge the same numbers: the cluster mean, identical bytes on
    every worker after one all-reduce.
    """
    import numpy as np
    import tensorflow as tf

    fields = ("step_s", "input_s", "compute_s", "communication_s")
    keys = [sorted(point.breakdown.extra) for point in points]
    values = [
        [getattr(point.breakdown, name) for name in fields]
        + [point.breakdown.extra[key] for key in extra]
        for point, extra in zip(points, keys, strict=True)
    ]
    flat = np.asarray([v for row in values for v in row], dtype=np.float64)
    per_replica = strategy.run(lambda: tf.constant(flat))
    mean = strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None).numpy()
    agreed, offset = [], 0
    for point, extra in zip(points, keys, strict=True):
        row = [float(v) for v in mean[offset : offset + len(fields) + len(extra)]]
        offset += len(row)
        step_s, input_s, compute_s, communication_s = row[: len(fields)]
        breakdown = dataclasses.replace(
            point.breakdown,
            step_s=step_s,
            input_s=input_s,
            compute_s=compute_s,
            communication_s=communication_s,
            extra=dict(zip(extra, row[len(fields) :], strict=True)),
        )
        agreed.append(dataclasses.replace(point, breakdown=breakdown))
    return agreed
