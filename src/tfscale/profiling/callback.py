"""``tfscale.ProfileCallback``: per-step timing (and an optional trace window) for ``model.fit``.

Keras runs ``next(iterator)`` inside its compiled train function, so under ``model.fit`` a
callback cannot see the input wait on its own; it times each step from
``on_train_batch_begin`` to ``on_train_batch_end``. Under ``tfscale.fit`` it asks for the
train function's own timings (``tfscale_wants_timings``) and gets, per call, the seconds
blocked fetching the batches and the seconds of the steps. When asked, it also captures a TensorFlow
profiler trace of a few steps whose events are classified by :mod:`tfscale.profiling.timeline`
(input, compute, exposed communication).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import keras

from tfscale.profiling.metrics import shares
from tfscale.profiling.steptime import Breakdown, StepTimes, breakdown, to_record
from tfscale.profiling.timeline import (
    STEP_MARKER,
    find_xplane,
    read_xplane,
    trace_breakdown,
    traced,
)

__all__ = ["EpochClock", "ProfileCallback"]


class EpochClock(keras.callbacks.Callback):  # type: ignore[misc]
    """Wall seconds of each epoch as callbacks see it (``times``; the first includes tracing)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.times.append(time.perf_counter() - self._start)


class ProfileCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Times every training step of ``model.fit`` and optionally traces a window of steps.

    Example:
        ```python
        callback = tfscale.ProfileCallback(batch_size=64, trace_steps=(5, 10))
        model.fit(dataset, epochs=2, callbacks=[callback])
        print(callback.summary())
        ```

    Args:
        batch_size: Global batch of one step, for examples/s (None: steps/s only).
        warmup: Steps excluded from the statistics (tracing, autotuning).
        trace_steps: ``(first, stop)`` global step numbers to capture with the profiler
            (``stop`` excluded), or None for no trace.
        logdir: Where the profiler writes; a temporary directory by default.
    """

    tfscale_wants_timings = True  # tfscale.fit then times each call of its train function

    def __init__(
        self,
        batch_size: int | None = None,
        warmup: int = 2,
        trace_steps: tuple[int, int] | None = None,
        logdir: str | None = None,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.warmup = warmup
        # An empty window (0,0, or FIRST alone) is no trace at all.
        self.trace_steps = trace_steps if traced(trace_steps) else None
        self.logdir = logdir
        self.step_s: list[float] = []
        self.fetch_s: list[float] = []
        self.gap_s: list[float] = []
        self.trace_shares: dict[str, float] = {}
        self._step = 0
        self._begin = 0.0
        self._last_end: float | None = None
        self._tracing = False
        self._trace_context: Any = None
        self._tempdir: tempfile.TemporaryDirectory[str] | None = None
        self.memory: dict[str, Any] = {}
        self._memory_watch: tuple[Any, list[str], list[int]] | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self._memory_watch = None
        if self.batch_size:
            from tfscale.training.memory.report import planned_for

            self._memory_watch = planned_for(self.model, self.batch_size // self.replicas)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self._step == self.warmup and self._memory_watch is not None:
            from tfscale.training.memory.measure import reset_peaks

            plan, devices, _ = self._memory_watch
            self._memory_watch = (plan, devices, reset_peaks(devices))
        if self.trace_steps and self._step == self.trace_steps[0] and not self._tracing:
            self._start_trace()
        if self._tracing:
            import tensorflow as tf

            self._trace_context = tf.profiler.experimental.Trace(
                STEP_MARKER, step_num=self._step, _r=1
            )
            self._trace_context.__enter__()
        self._begin = time.perf_counter()
        if self._last_end is not None and self._step > self.warmup:
            self.gap_s.append(self._begin - self._last_end)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        end = time.perf_counter()
        if self._trace_context is not None:
            self._trace_context.__exit__(None, None, None)
            self._trace_context = None
        if self._step >= self.warmup:
            timing = self._timing(end)
            if timing is not None:  # the fetch timed apart from the step
                self.fetch_s.append(timing[0])
                self.step_s.append(timing[0] + timing[1])
            else:
                self.step_s.append(end - self._begin)
        self._last_end = end
        self._step += 1
        if self._tracing and self.trace_steps and self._step >= self.trace_steps[1]:
            self._stop_trace()

    def _timing(self, end: float) -> tuple[float, float] | None:
        """``(seconds fetching, seconds stepping)`` of the step that just ended, where the
        fetch was timed apart (``tfscale.fit``'s train function), else None."""
        timings = getattr(getattr(self.model, "train_function", None), "timings", None)
        if timings:
            timing = timings.pop()
            return timing.fetch_seconds, timing.step_seconds
        return None

    def on_train_end(self, logs: Any = None) -> None:
        if self._tracing:
            self._stop_trace()
        watch, self._memory_watch = self._memory_watch, None
        if watch is not None:
            from tfscale.training.memory.measure import read_peaks
            from tfscale.training.memory.report import memory_record

            plan, devices, starts = watch
            measured = read_peaks(devices, starts) if starts else []
            self.memory = memory_record(plan, measured)

    def _start_trace(self) -> None:
        import tensorflow as tf

        if self.logdir is None:
            self._tempdir = tempfile.TemporaryDirectory(prefix="tfscale-trace-")
            self.logdir = self._tempdir.name
        tf.profiler.experimental.start(self.logdir)
        self._tracing = True

    def _stop_trace(self) -> None:
        import tensorflow as tf

        tf.profiler.experimental.stop()
        self._tracing = False
        paths = find_xplane(self.logdir or "")
        if paths:
            totals, _ = trace_breakdown(read_xplane(paths[0]), STEP_MARKER)
            self.trace_shares = shares(totals)
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None

    @property
    def replicas(self) -> int:
        """Replicas of the model's strategy (1 without one)."""
        strategy = getattr(self.model, "distribute_strategy", None)
        return int(getattr(strategy, "num_replicas_in_sync", 1) or 1)

    def step_times(self) -> StepTimes:
        """The measured steps as :class:`StepTimes` (the fetch apart where it was timed,
        else 0 and ``fetch_timed`` False), the record ``tfscale bench`` measures too."""
        timed = bool(self.fetch_s) and len(self.fetch_s) == len(self.step_s)
        fetch = self.fetch_s if timed else [0.0] * len(self.step_s)
        execution = tuple(s - f for s, f in zip(self.step_s, fetch, strict=True))
        return StepTimes(tuple(fetch), execution, self.batch_size or 0, fetch_timed=timed)

    def breakdown(self) -> Breakdown:
        """The step breakdown, by ``tfscale bench``'s measurement (:func:`steptime.breakdown`:
        means over the fastest 90% of steps), split by the trace's shares where one was
        captured, else by the timings.

        Under ``tfscale.fit`` the input wait is the train function's fetch time (wall-clock);
        under ``model.fit`` without a trace the whole step counts as compute (input and
        communication cannot be separated from outside Keras's compiled step), and
        ``method`` says so (``step-time``).
        """
        return breakdown(self.step_times(), trace_shares=self.trace_shares)

    def summary(self) -> dict[str, Any]:
        """Per-step statistics as plain data (what ``tfscale profile`` writes into its report)."""
        b = self.breakdown()
        return {
            **to_record(b),
            "steps_measured": len(self.step_s),
            "mean_gap_between_steps_s": statistics.fmean(self.gap_s) if self.gap_s else 0.0,
            "steps_per_s": 1.0 / b.step_s if b.step_s > 0 else 0.0,
            "examples_per_s": b.examples_per_s if self.batch_size else None,
            "batch_size": self.batch_size,
            "replicas": self.replicas,
            "trace_shares": self.trace_shares,
            "step_s": list(self.step_s),
            "jit_compile": bool(getattr(self.model, "jit_compile", False) is True),
            "memory": self.memory,
        }
