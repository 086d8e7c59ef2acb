"""The one step measurement of ``tfscale bench`` and ``tfscale profile``: per-step records
in, a :class:`Breakdown` (input wait, compute, exposed communication) out.

Per step two durations are taken on the host: the time blocked fetching the batch (input
wait) and the time the step takes (execution), as :class:`StepTimes`. :func:`breakdown` turns
them into the step's split, with the same statistics for both commands (means over the
fastest 90% of steps), and is where the method is chosen:

- ``wall-clock`` with a reference (``tfscale bench``, which controls the model): exposed
  communication is the part of the execution that disappears when the same step runs at the
  same per-replica batch *without* the cross-replica gradient all-reduce,
  ``exec(with reduce) - exec(without)``; the two variants are timed in alternating chunks
  over the same iterator (:func:`time_interleaved`), so a noisy neighbour on a shared machine
  slows both alike instead of biasing their difference;
- ``trace`` without one (``tfscale profile``, which can only observe the user's program):
  the shares of a profiler trace window split the wall-clock step;
- ``wall-clock`` / ``step-time`` with neither: input is the fetch where it was timed apart
  (``step-time``: it was not), the rest compute, and no communication is reported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tfscale.profiling.metrics import shares

__all__ = [
    "Breakdown",
    "StepTimes",
    "breakdown",
    "from_record",
    "robust_means",
    "time_interleaved",
    "to_record",
]


@dataclass(frozen=True)
class StepTimes:
    """Host-side durations of measured steps (warm-up already excluded).

    Attributes:
        wait_s: Seconds blocked fetching each step's batch.
        exec_s: Seconds each step function took to run.
        examples_per_step: Examples one step consumes (global batch x accumulation).
        fetch_timed: Whether the fetch was timed apart from the step (False: ``wait_s`` is 0
            and ``exec_s`` holds the whole step, as under ``model.fit``, whose compiled step
            fetches its own batch).
    """

    wait_s: tuple[float, ...]
    exec_s: tuple[float, ...]
    examples_per_step: int
    fetch_timed: bool = True

    def __post_init__(self) -> None:
        if len(self.wait_s) != len(self.exec_s):
            raise ValueError("wait_s and exec_s must have one entry per step")


def robust_means(times: StepTimes, keep: float = 0.9) -> tuple[float, float]:
    """Mean input wait and mean execution over the steps whose total is in the fastest ``keep``.

    Dropping the slowest tenth removes steps stalled by another process on a shared machine
    while keeping the additive meaning of a mean (wait + exec = step).
    """
    if not times.wait_s:
        return 0.0, 0.0
    wait = np.asarray(times.wait_s)
    execution = np.asarray(times.exec_s)
    total = wait + execution
    limit = np.quantile(total, keep) if len(total) > 2 else np.inf
    kept = total <= limit
    return float(wait[kept].mean()), float(execution[kept].mean())


@dataclass(frozen=True)
class Breakdown:
    """Where one step's time goes, in seconds per step.

    Attributes:
        step_s: Wall-clock seconds per step (input + compute + communication).
        input_s: Blocked waiting for the next batch.
        compute_s: Execution without the exposed communication (includes host overhead).
        communication_s: Exposed (not hidden) cross-replica gradient reduction.
        examples_per_step: Examples one step consumes.
        method: ``"wall-clock"``, ``"trace"`` or ``"step-time"`` (see :func:`breakdown`).
    """

    step_s: float
    input_s: float
    compute_s: float
    communication_s: float
    examples_per_step: int
    method: str = "wall-clock"
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def examples_per_s(self) -> float:
        """Throughput implied by the step time."""
        return self.examples_per_step / self.step_s if self.step_s > 0 else 0.0

    @property
    def shares(self) -> dict[str, float]:
        """Fractions of the step: ``input``, ``compute``, ``communication``."""
        return shares(
            {
                "input": self.input_s,
                "compute": self.compute_s,
                "communication": self.communication_s,
            }
        )


def breakdown(
    with_reduce: StepTimes,
    without_reduce: StepTimes | None = None,
    fetch_floor: float = 0.0,
    contiguous: StepTimes | None = None,
    trace_shares: Mapping[str, float] | None = None,
) -> Breakdown:
    """The breakdown of a step from its records: the one measurement of bench and profile.

    The step time is always the wall-clock mean (fetch + execution over the fastest 90% of
    steps). How it is split depends on what was measured, best first: a reference without
    the all-reduce (exposed communication by difference; a trace is then not needed), else a
    trace window's shares (``"other"``, time with no op running, counts as compute), else the
    timings alone (no communication can be seen).

    Args:
        with_reduce: The real step (with the gradient all-reduce).
        without_reduce: The same step, same per-replica batch, all-reduce removed (only
            ``tfscale bench`` can run it); None where there is none.
        fetch_floor: Seconds a fetch costs when the batch is already there (host overhead of
            the fetch call); only waiting beyond it is input, the rest counts as compute.
        contiguous: The real step timed in one uninterrupted run, whose fetch times are used
            for the input wait: while interleaved runs take turns, each one's pipeline keeps
            producing in the background, which would hide part of a slow pipeline's wait.
        trace_shares: Fractions of the traced steps per class (``input``, ``compute``,
            ``communication``, ``other``), where a trace window was captured.

    Returns:
        The breakdown; exposed communication is clamped at 0 (noise can make it negative).
    """
    fetch, execution = robust_means(with_reduce)
    step = fetch + execution
    examples = with_reduce.examples_per_step
    if without_reduce is None and trace_shares:
        share = trace_shares
        return Breakdown(
            step_s=step,
            input_s=step * share.get("input", 0.0),
            compute_s=step * (share.get("compute", 0.0) + share.get("other", 0.0)),
            communication_s=step * share.get("communication", 0.0),
            examples_per_step=examples,
            method="trace",
        )
    if contiguous is not None and contiguous.wait_s:
        fetch = robust_means(contiguous)[0]
    wait = max(0.0, fetch - fetch_floor)
    communication = 0.0
    if without_reduce is not None and without_reduce.exec_s:
        _, execution_alone = robust_means(without_reduce)
        communication = max(0.0, execution - execution_alone)
    return Breakdown(
        step_s=fetch + execution,
        input_s=wait,
        compute_s=fetch - wait + execution - communication,
        communication_s=communication,
        examples_per_step=examples,
        method="wall-clock" if with_reduce.fetch_timed else "step-time",
        extra={"fetch_floor_s": fetch_floor},
    )


def to_record(result: Breakdown) -> dict[str, Any]:
    """A breakdown as the plain data ``tfscale profile``'s processes exchange (JSON)."""
    return {
        "mean_step_s": result.step_s,
        "input_s": result.input_s,
        "compute_s": result.compute_s,
        "communication_s": result.communication_s,
        "method": result.method,
    }


def from_record(record: Mapping[str, Any], examples_per_step: int) -> Breakdown:
    """The breakdown that :func:`to_record` wrote."""
    return Breakdown(
        step_s=float(record["mean_step_s"]),
        input_s=float(record["input_s"]),
        compute_s=float(record["compute_s"]),
        communication_s=float(record["communication_s"]),
        examples_per_step=examples_per_step,
        method=str(record["method"]),
    )


def time_interleaved(
    runs: Sequence[tuple[Callable[[], tuple[float, float]], int]],
    *,
    steps: int,
    warmup: int = 2,
    chunk: int = 3,
    on_step: Callable[[], None] | None = None,
) -> list[StepTimes]:
    """Times several steps, alternating between them in chunks of ``chunk`` steps.

    Args:
        runs: ``(timed_step, examples_per_step)``; ``timed_step()`` runs one step and
            returns ``(seconds blocked fetching its input, seconds executing it)``.
        steps: Measured steps per run.
        warmup: Unmeasured steps per run first (tracing, allocation, autotuning).
        chunk: Consecutive steps of one run before switching to the next.
        on_step: Called after every step (measured or not), e.g. to advance a progress bar.

    Returns:
        One :class:`StepTimes` per run, in the order of ``runs``.
    """
    for timed_step, _ in runs:
        for _ in range(warmup):
            timed_step()
            if on_step:
                on_step()
    waits: list[list[float]] = [[] for _ in runs]
    execs: list[list[float]] = [[] for _ in runs]
    while any(len(w) < steps for w in waits):
        for index, (timed_step, _) in enumerate(runs):
            for _ in range(min(chunk, steps - len(waits[index]))):
                wait, execution = timed_step()
                waits[index].append(wait)
                execs[index].append(execution)
                if on_step:
                    on_step()
    return [
        StepTimes(tuple(w), tuple(e), n) for w, e, (_, n) in zip(waits, execs, runs, strict=True)
    ]
