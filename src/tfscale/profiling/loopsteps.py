"""The steps of a custom training loop, found and timed from outside the script.

A custom loop's step is a ``tf.function`` whose body calls ``strategy.run`` (TensorFlow's
distributed-training tutorial, and most multi-GPU answers)::

    @tf.function
    def train_step(batch):
        strategy.run(replica_step, args=(batch,))

    for batch in strategy.experimental_distribute_dataset(dataset):
        train_step(batch)

``strategy.run`` runs in Python only while the function is traced, so the step is found
there: every eager call of a ``tf.function`` is watched (:func:`watch_loop_steps` wraps
``Function.__call__``, reached through :mod:`tfscale.interop.internals`), and a function whose trace
called ``strategy.run`` (``script_watch.watch_strategies``) is a step function from then on;
each of its calls is one step. The time between the end of one step and the start of the next
is the loop fetching its next batch (``for batch in dist_dataset``): it counts as input
wait. Keras's and tfscale's own train functions (``model.fit``, ``tfscale.fit``, which
:class:`ProfileCallback` times) are left out. A function whose calls run several steps
(a ``tf.range`` loop inside) counts as one step per call.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from tfscale.interop import registry
from tfscale.profiling.callback import ProfileCallback
from tfscale.profiling.timeline import STEP_MARKER

__all__ = ["LoopSteps", "global_batch", "watch_loop_steps"]


class LoopSteps(ProfileCallback):
    """:class:`ProfileCallback`'s measurement for the steps of one custom-loop step function.

    Each step is the gap since the previous step ended (input wait: the loop fetching its
    batch) plus the call. Where a trace window was captured, its shares split the whole step
    (its marker opens when the previous step ends, so it holds the fetch).

    Args:
        strategy: The strategy whose ``run`` the step function calls.
        batch_size: Global batch of one step (None: unknown).
        trace_steps: As :class:`ProfileCallback`'s.
        logdir: As :class:`ProfileCallback`'s (None: a temporary folder, not kept).
    """

    def __init__(
        self,
        strategy: Any,
        batch_size: int | None = None,
        trace_steps: tuple[int, int] | None = None,
        logdir: str | None = None,
    ) -> None:
        super().__init__(batch_size=batch_size, trace_steps=trace_steps, logdir=logdir)
        self.strategy = strategy

    @property
    def replicas(self) -> int:
        """Replicas of the strategy the step function runs on."""
        return int(getattr(self.strategy, "num_replicas_in_sync", 1) or 1)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self._trace_context is not None:  # opened at the previous step's end
            self._begin = time.perf_counter()
            return
        super().on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        super().on_train_batch_end(batch, logs)
        if self._tracing:
            # The next step's marker opens now, so that the trace sees its fetch too (under
            # MultiWorkerMirroredStrategy the fetch holds an all-reduce across workers).
            import tensorflow as tf

            self._trace_context = tf.profiler.experimental.Trace(
                STEP_MARKER, step_num=self._step, _r=1
            )
            self._trace_context.__enter__()

    def on_train_end(self, logs: Any = None) -> None:
        if self._trace_context is not None:
            self._trace_context.__exit__(None, None, None)
            self._trace_context = None
        super().on_train_end(logs)

    @property
    def steps_seen(self) -> int:
        """Steps so far, warm-up included."""
        return self._step

    def first_call(self, begin: float) -> None:
        """Counts the call that found the step function (begun at ``begin``), warm-up."""
        self._begin, self._last_end = begin, None
        self.on_train_batch_end(0)

    def _timing(self, end: float) -> tuple[float, float] | None:
        gap = self._begin - self._last_end if self._last_end is not None else 0.0
        return gap, end - self._begin


def global_batch(strategy: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The global batch of a step function's call: the first distributed value among its
    arguments, its local replicas' leading dimensions summed and scaled to every replica
    (the other workers' replicas hold as many); a plain tensor's leading dimension; None
    where the call gets no batch (a distributed iterator the function calls ``next`` on)."""
    import tensorflow as tf

    for value in tf.nest.flatten((args, kwargs), expand_composites=False):
        if isinstance(value, tf.distribute.DistributedValues):
            local = strategy.experimental_local_results(value)
            first = [tf.nest.flatten(v)[0] for v in local]
            dims = [t.shape[0] for t in first if getattr(t, "shape", None) is not None]
            if not dims or any(d is None for d in dims):
                return None
            total = sum(int(d) for d in dims)
            return total * int(strategy.num_replicas_in_sync) // max(len(local), 1)
        if isinstance(value, tf.Tensor) and value.shape.rank:
            dim = value.shape[0]
            return int(dim) if dim is not None else None
    return None


class _Calls(threading.local):
    """The eager step-function calls in progress on this thread (the outermost first) and
    the strategy their trace ran, if any."""

    def __init__(self) -> None:
        self.stack: list[list[Any]] = []


#: Modules whose tf.functions are ``fit``'s train functions (Keras's, tfscale.fit's), which
#: ``fit``'s own callback times: not a custom loop's steps.
_FIT_MODULES = ("keras.", "tfscale.")


def _fit_owned(function: Any) -> bool:
    module = getattr(getattr(function, "python_function", None), "__module__", "") or ""
    return module.startswith(_FIT_MODULES)


def watch_loop_steps(
    make: Callable[[Any, int | None], LoopSteps],
) -> Callable[[], None]:
    """Times every step of every custom loop the process runs from now on.

    Args:
        make: ``make(strategy, global_batch)`` returns the :class:`LoopSteps` of a newly
            found step function (called at its first call that ran ``strategy.run``).

    Returns:
        The undo: puts back ``Function.__call__`` (the strategy watcher stays, doing nothing).
    """
    import tensorflow as tf

    from tfscale.interop.internals import tf_function_class
    from tfscale.interop.script_watch import watch_strategies

    function_class = tf_function_class()
    calls = _Calls()
    steps: weakref.WeakKeyDictionary[Any, LoopSteps] = weakref.WeakKeyDictionary()
    active = [True]

    def ran(strategy: Any, outputs: Any) -> None:
        if active[0] and calls.stack and tf.inside_function():
            calls.stack[0][1] = strategy  # the outermost eager call is the step

    watch_strategies(ran=ran)

    def watch(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(function: Any, *args: Any, **kwargs: Any) -> Any:
            if not active[0] or calls.stack or tf.inside_function() or _fit_owned(function):
                return original(function, *args, **kwargs)  # nested, traced inside, fit's
            timer = steps.get(function)
            if timer is not None:
                timer.on_train_batch_begin(timer.steps_seen)
            frame: list[Any] = [function, None]
            calls.stack.append(frame)
            begin = time.perf_counter()
            try:
                return original(function, *args, **kwargs)
            finally:
                calls.stack.pop()
                if timer is not None:
                    timer.on_train_batch_end(timer.steps_seen)
                elif frame[1] is not None:  # its first trace ran strategy.run: a step function
                    timer = make(frame[1], global_batch(frame[1], args, kwargs))
                    steps[function] = timer
                    timer.first_call(begin)  # the first step (tracing) is warm-up

        return call

    release = registry.install("script-watch", function_class, "__call__", watch)

    def undo() -> None:
        active[0] = False
        release()

    return undo
