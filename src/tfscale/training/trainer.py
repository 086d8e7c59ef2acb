"""``Trainer``: step-level control over a prepared model, for profiling and custom drivers.

It runs whole optimizer updates (``accumulation_steps`` micro-batches each) from a
distributed iterator with the same step function ``tfscale.fit`` uses, optionally timing the
fetch of each update's batches apart from the update itself, and optionally without the
gradient all-reduce (each replica then applies its own gradient: the difference in step time
is the exposed communication).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfscale.training.function import StepFunction, StepTiming
from tfscale.training.options import Entry, Options
from tfscale.training.prepare import prepare, prepared
from tfscale.training.shorthand import takes_options

__all__ = ["StepTiming", "Trainer"]


class Trainer:
    """Runs optimizer updates of a compiled model on a strategy, one call per update.

    Attributes:
        timings: :class:`StepTiming` of each update while ``record_timings`` is True.
        record_timings: Fetch each update's batches eagerly and time fetch and update apart.
    """

    @takes_options(Entry.TRAINER)
    def __init__(
        self,
        model: Any,
        strategy: tf.distribute.Strategy | None = None,
        *,
        all_reduce: bool = True,
        sample_batch: Any = None,
        options: Options,
    ) -> None:
        """Prepares ``model`` (as :func:`tfscale.prepare`) and builds its step function.

        Args:
            model: A compiled Keras model (prepared here, in place).
            strategy: The strategy; None as in :func:`tfscale.prepare`.
            all_reduce: False applies each replica's own gradient (profiling only).
            sample_batch: One batch of one replica; builds the model, its metrics and
                optimizer.
        """
        prepare(model, strategy, options=options)
        state = prepared(model)
        assert state is not None
        if sample_batch is not None:
            state.symbolic_build(data_batch=sample_batch)
        self.model = model
        self.strategy = state.strategy
        self.accumulation_steps = state.options.accumulation_steps
        self._state = state
        self._all_reduce = all_reduce
        self._function = self._build()
        self.timings: list[StepTiming] = []

    def _build(self) -> StepFunction:
        self._state.ready()
        return StepFunction(
            self.model, "train", self._state.options, all_reduce=self._all_reduce,
            steps_per_execution=1,
        )  # fmt: skip

    @property
    def record_timings(self) -> bool:
        """Whether updates are timed (fetch apart from the update)."""
        return self._function.record_timings

    @record_timings.setter
    def record_timings(self, value: bool) -> None:
        self._function.record_timings = bool(value)

    def _set_gradient_all_reduce(self, enabled: bool) -> None:
        """Private knob for profiling: the same update with or without the all-reduce."""
        if enabled != self._all_reduce:
            timed = self.record_timings
            self._all_reduce = enabled
            self._function = self._build()
            self.record_timings = timed

    @property
    def all_reduce_traces(self) -> int:
        """Gradient all-reduces traced so far by the model's optimizer."""
        return self._state.update.all_reduce_traces

    def fetch(self, iterator: Any) -> Any:
        """One batch from a distributed iterator, fetched as the timed path fetches it."""
        return self._function.fetch(iterator)

    def train(self, iterator: Any, updates: int = 1) -> tuple[int, bool, Any]:
        """Runs up to ``updates`` optimizer updates from ``iterator``.

        Returns:
            ``(done, exhausted, logs)``: updates run, whether the data ended, the last logs.
        """
        logs: Any = {}
        function = self._function
        for done in range(updates):
            calls = len(function.timings)
            try:
                for _ in range(self.accumulation_steps):  # one step per micro-batch
                    logs = function(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                return done, True, logs
            finally:
                self._merge_timings(calls)
        return updates, False, logs

    def _merge_timings(self, first: int) -> None:
        """One :class:`StepTiming` per update: the sums over its micro-batches' calls."""
        calls = self._function.timings[first:]
        del self._function.timings[first:]
        if calls:
            self.timings.append(
                StepTiming(sum(t.fetch_seconds for t in calls), sum(t.step_seconds for t in calls))
            )
