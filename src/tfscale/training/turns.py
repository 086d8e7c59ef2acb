"""Work over one strategy's devices takes turns across threads.

TensorFlow cannot read two distributed inputs over the same devices at once: two threads,
each iterating its own ``strategy.experimental_distribute_dataset`` of one
MirroredStrategy, got each other's batches (3 of 49 repeats: the second device's share of
every batch came from the other thread's dataset, the first device's was right) or hung in
``MultiDeviceIterator`` ``get_next`` (1 of 49), with TensorFlow alone; over disjoint
devices (a strategy per thread), 0 of 100. With each thread's iterator made once and
read on, 200 of 200 repeats read right: it is while one is made that the other's reads go
astray. No upstream issue found; the wait is inside TensorFlow's runtime, in the remote
calls by which each device's ``GeneratorDataset`` reads its shard
(``MultiDeviceIteratorGetNextFromShard``; tensorflow/tensorflow#62523, TensorFlow's local
rendezvous, was suspected and is not confirmed). Two fits sharing a MirroredStrategy in two
threads hung or trained to other weights in 2 of 108 repeats (py-spy and gdb: both train
functions in ``ProcessFunctionLibraryRuntime::RunSync``, the shard reads waiting on their
buffers), and two custom loops the same way, with tfscale or without (a hang or other
weights within 40 repeats; ``tests/training/test_threads.py``). So each strategy object has
one turn
(:func:`turn`, re-entrant), which costs the threads nothing they could have had: both need
all of the strategy's devices.

- A fit holds its strategy's turn from start to end (``prepare.Prepared.keras_fit``).
- While a custom loop prepared by ``tfscale.prepare_loop`` lives, the loop's steps and its
  input take turns call by call (:func:`take_turns`, the registry's ``device-turns``):
  making an iterator of a distributed dataset, reading it eagerly (``next(iterator)``,
  ``for batch in dist_dataset``), and each call of a ``tf.function`` whose trace reads one
  (the multi-worker tutorial's ``train_step(iterator)``) hold the strategy's turn for that
  call. Two loops in two threads interleave step by step and each trains as alone; a fit
  waits for the call in progress, and a loop for a running fit. Each thread of a
  ``TaskPool`` running loops one after the other is never held up.

Not covered: loops in a process where no prepared loop lives (nothing is installed then),
an iterator's destruction (wherever the garbage collector runs it, on any thread), and a
step called as a ``ConcreteFunction`` (``get_concrete_function``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tfscale.interop import internals, registry

__all__ = ["take_turns", "turn"]

_TURNS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_TURNS_LOCK = threading.Lock()


def turn(strategy: tf.distribute.Strategy) -> threading.RLock:
    """The turn of ``strategy``'s devices: the lock a fit under it holds while it runs, and
    a prepared loop's input and steps for each call (see the module doc)."""
    with _TURNS_LOCK:
        lock = _TURNS.get(strategy)
        if lock is None:
            lock = _TURNS[strategy] = threading.RLock()
        return lock


class _Call:
    """One eager call of a ``tf.function`` in this thread: the turns it holds."""

    def __init__(self, function: Any) -> None:
        self.function = function
        self.held: list[threading.RLock] = []

    def hold(self, lock: threading.RLock) -> None:
        if lock not in self.held:
            lock.acquire()
            self.held.append(lock)

    def release(self) -> None:
        for lock in reversed(self.held):
            lock.release()
        self.held.clear()


_PARAMETER_SERVER = tf.distribute.experimental.ParameterServerStrategy
_LOCAL = threading.local()
# The tf.functions whose trace read a distributed input, with its strategy.
_READERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _calls() -> list[_Call]:
    calls: list[_Call] | None = getattr(_LOCAL, "calls", None)
    if calls is None:
        calls = _LOCAL.calls = []
    return calls


def _input_layer(original: Callable[..., Any]) -> Callable[..., Any]:
    """A distributed dataset's ``__iter__`` or iterator's ``get_next``: eagerly, under its
    strategy's turn; in a trace, the ``tf.function`` being called becomes a reader."""

    def under_turn(self: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = internals.distributed_input_strategy(self)
        if strategy is None or isinstance(strategy, _PARAMETER_SERVER):
            # A parameter server's workers read their own inputs on their own devices.
            return original(self, *args, **kwargs)
        if tf.inside_function():
            calls = _calls()
            if calls:  # the outermost eager call runs what this trace reads
                _READERS[calls[0].function] = strategy
                # Its first call (this trace, then the run) holds the turn from here on.
                calls[0].hold(turn(strategy))
            return original(self, *args, **kwargs)
        with turn(strategy):
            return original(self, *args, **kwargs)

    return under_turn


def _call_layer(original: Callable[..., Any]) -> Callable[..., Any]:
    """``tf.function``'s ``__call__``: a reader of a distributed input runs under its turn."""

    def call(function: Any, *args: Any, **kwargs: Any) -> Any:
        if tf.inside_function():  # traced into an outer call, which holds what it needs
            return original(function, *args, **kwargs)
        frame = _Call(function)
        calls = _calls()
        calls.append(frame)
        try:
            strategy = _READERS.get(function)
            if strategy is not None:
                frame.hold(turn(strategy))
            return original(function, *args, **kwargs)
        finally:
            calls.pop()
            frame.release()

    return call


def take_turns() -> Callable[[], None]:
    """Makes distributed inputs and the ``tf.function`` calls that read them take their
    strategy's turn (the module doc), until the returned release is called.

    Held by each prepared custom loop while it lives (``loop.register_loop``).
    """
    releases = [
        registry.install("device-turns", owner, attribute, _input_layer)
        for owner, attribute in internals.distributed_input_methods()
    ]
    releases.append(
        registry.install("device-turns", internals.tf_function_class(), "__call__", _call_layer)
    )

    def release() -> None:
        for each in releases:
            each()

    return release
