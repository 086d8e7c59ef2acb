"""Which worker holds a multi-worker job back, and why: pure decisions over per-worker steps.

In a synchronous job every worker's step ends with the same gradient all-reduce, which
finishes only when the last worker has joined it. So each worker's step is its own work
(input wait, compute, the transfer itself) plus the time it waits in the collective for the
others, and every worker's step lasts as long as the slowest worker's own work::

    worker 0: |in|--compute--|...... wait ......|transfer|
    worker 1: |------ input (slow disk) -------|compute|transfer|

The wait is measured as the time a worker spends in the collective beyond the least any
worker spends there (the transfer takes about the same time for all):

- with a trace (the default window of ``tfscale profile``), the collective is the trace's
  exposed communication of each worker;
- without one (wall-clock), it is the whole step call (compute + communication), assuming
  the workers have the same compute (same model, same per-worker batch). A worker with
  slower compute is then invisible: its call and the others' last equally long; the trace
  separates them.

The straggler is the worker whose own work (step minus wait) is largest, where it leads the
median of the others' by more than :data:`STRAGGLER_SHARE` of the step (and
:data:`NOISE_FLOOR_S`); its cause is the part of its own work (input or compute) by which it
exceeds the others' mean the most.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tfscale.profiling.advice import Advice

__all__ = ["NOISE_FLOOR_S", "STRAGGLER_SHARE", "Straggler", "WorkerRow", "WorkerStep", "judge"]

#: A worker holds the job back when its own work leads the others' by this share of the step.
#: A balanced 2-worker job on the shared 2-core machine (profiler on) showed leads up to 20%.
STRAGGLER_SHARE = 0.3
#: ... and by more than this (run-to-run noise of a step on a busy 2-core machine: ~0.5 ms).
NOISE_FLOOR_S = 0.001


@dataclass(frozen=True)
class WorkerStep:
    """One worker's measured step (medians over its measured steps), in seconds.

    Attributes:
        worker: The worker's index.
        step_s: Step time.
        input_s: Waiting for its batch.
        compute_s: Compute (wall-clock: the whole step call).
        communication_s: Time in the collective (trace); 0 under wall-clock.
        method: ``"trace"`` or ``"wall-clock"`` (or ``"step-time"``).
    """

    worker: int
    step_s: float
    input_s: float
    compute_s: float
    communication_s: float
    method: str = "wall-clock"


@dataclass(frozen=True)
class WorkerRow:
    """One worker's step split into its own work and the wait for the others.

    Attributes:
        worker: The worker's index.
        step_s: Step time.
        input_s: Waiting for its batch.
        compute_s: Compute, wait excluded.
        communication_s: The collective's own time, wait excluded.
        wait_s: Waiting in the collective for the other workers.
    """

    worker: int
    step_s: float
    input_s: float
    compute_s: float
    communication_s: float
    wait_s: float

    @property
    def own_s(self) -> float:
        """The worker's own work: its step without the wait for the others."""
        return self.step_s - self.wait_s


@dataclass(frozen=True)
class Straggler:
    """The worker every collective waits for.

    Attributes:
        worker: Its index.
        cause: ``"input-bound"`` or ``"compute-bound"``.
        lead_s: Seconds per step by which its own work exceeds the median of the others'.
        advice: What to do, with the predicted effect.
    """

    worker: int
    cause: str
    lead_s: float
    advice: Advice


def _collective(step: WorkerStep) -> float:
    if step.method == "trace":
        return step.communication_s
    return step.compute_s + step.communication_s


def rows(steps: Sequence[WorkerStep]) -> list[WorkerRow]:
    """Each worker's step with its wait in the collective separated (see the module)."""
    least = min((_collective(s) for s in steps), default=0.0)
    out = []
    for s in sorted(steps, key=lambda s: s.worker):
        wait = max(0.0, _collective(s) - least)
        if s.method == "trace":
            compute, communication = s.compute_s, s.communication_s - wait
        else:
            compute, communication = s.compute_s - wait, s.communication_s
        out.append(WorkerRow(s.worker, s.step_s, s.input_s, compute, communication, wait))
    return out


def judge(steps: Sequence[WorkerStep]) -> tuple[list[WorkerRow], Straggler | None]:
    """The per-worker rows and the straggler, if one worker holds the others back.

    Returns:
        ``(rows, straggler)``; ``straggler`` is None for one worker or a balanced job.
    """
    table = rows(steps)
    if len(table) < 2:
        return table, None
    slowest = max(table, key=lambda r: r.own_s)
    others = [r for r in table if r is not slowest]
    lead = slowest.own_s - statistics.median(r.own_s for r in others)
    step = statistics.fmean(r.step_s for r in table)
    if lead <= max(STRAGGLER_SHARE * step, NOISE_FLOOR_S):
        return table, None
    excess = {
        "input-bound": slowest.input_s - statistics.fmean(r.input_s for r in others),
        "compute-bound": slowest.compute_s - statistics.fmean(r.compute_s for r in others),
    }
    cause = max(excess, key=lambda k: excess[k])
    return table, Straggler(slowest.worker, cause, lead, _advice(slowest, others, cause, lead))


def _advice(slowest: WorkerRow, others: list[WorkerRow], cause: str, lead: float) -> Advice:
    ms = 1e3
    waited = statistics.fmean(r.wait_s for r in others) * ms
    speedup = slowest.step_s / (slowest.step_s - lead) if slowest.step_s > lead else 1.0
    name = f"Worker {slowest.worker}"
    if cause == "input-bound":
        mine, theirs = slowest.input_s * ms, statistics.fmean(r.input_s for r in others) * ms
        what = (
            f"{name} is the straggler, input-bound: it waits {mine:.1f} ms per step for its "
            f"batch (the others {theirs:.1f} ms), and the others wait {waited:.1f} ms per "
            f"step for it in the all-reduce. Look at worker {slowest.worker}'s input: its "
            "disk or file system, other load on its host's CPUs, its shard of the data; "
            "parallelise and overlap its pipeline (dataset.map(fn, num_parallel_calls="
            "tf.data.AUTOTUNE), .cache(), .prefetch(tf.data.AUTOTUNE))"
        )
    else:
        mine, theirs = slowest.compute_s * ms, statistics.fmean(r.compute_s for r in others) * ms
        what = (
            f"{name} is the straggler, compute-bound: it computes {mine:.1f} ms per step "
            f"(the others {theirs:.1f} ms), and the others wait {waited:.1f} ms per step "
            f"for it in the all-reduce. Check worker {slowest.worker}'s device: a throttled "
            "or slower GPU (nvidia-smi -q -d PERFORMANCE,CLOCK), other processes on it, a "
            "noisy neighbour on its host; or give it a smaller share of the batch"
        )
    text = (
        f"{what}: predicted {speedup:.2f}x examples/s if it kept pace with the others "
        "(upper bound: its lead removed from every step)."
    )
    severity = "high" if lead > 0.5 * slowest.step_s else "medium"
    return Advice("straggler", severity, text, speedup)
