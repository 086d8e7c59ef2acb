"""Callbacks ``tfscale.fit`` adds to the user's: a stop on a non-finite loss; who is chief."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfscale.errors import NonFiniteLossError, explain

__all__ = [
    "ExactSteps",
    "NonFiniteGuard",
    "guarded",
    "halt_released",
    "is_chief",
    "watches_batches",
]


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True on the one worker that prints and writes (always true on a single machine)."""
    return bool(strategy.extended.should_checkpoint)


class NonFiniteGuard(keras.callbacks.Callback):  # type: ignore[misc]
    """Stops training with :class:`NonFiniteLossError` at the first non-finite loss or
    gradient (the optimizer's count of skipped updates went up).

    The update whose gradient was not finite was skipped on every replica (the distributed
    update tests the reduced gradient), and with ``halt_on_nonfinite`` every later one too,
    so the model stays as it was before it, however late this guard notices. So it reads
    little: the loss and the count at most once every ``every_seconds`` of training (a batch
    end in between touches no tensor, so no step waits for it), and at each epoch's end.
    Per-batch reads made a fit end seconds late: Keras runs ``async_safe`` callbacks off the
    training thread and waits for every queued one at the epoch's end (#26). The bad update's
    number and batch are exact whenever it is noticed: halted, ``optimizer.iterations`` stops
    at the update before it. A non-finite loss whose gradient was finite (a term without
    gradient) is no reason to skip: those updates are applied, and the error says so.
    A prepared model's ``fit`` (so ``tfscale.fit`` too) adds it unless the user passed
    ``keras.callbacks.TerminateOnNaN``, which stops quietly (:func:`guarded`).

    Args:
        update: The model optimizer's ``DistributedUpdate`` (None: the loss alone is read).
        every_seconds: Least time between two reads during an epoch.
    """

    async_safe = True

    def __init__(self, update: Any = None, *, every_seconds: float = 1.0) -> None:
        super().__init__()
        self._update = update
        self._every = every_seconds
        self._seen = 0
        self._next_read = 0.0
        self._epoch = 0
        self._epoch_start = 0  # optimizer.iterations when the epoch began
        self._last_batch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._next_read = 0.0
        if self._update is not None:
            self._seen = int(self._update.skipped.numpy())
            self._update.halted.assign(0)
            self._update.halt_on_nonfinite.assign(1)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch
        self._last_batch = 0
        if self._update is not None:
            self._epoch_start = int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._last_batch = batch
        now = time.monotonic()
        if now < self._next_read:
            return
        self._next_read = now + self._every
        self._check(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._check(self._last_batch, logs)  # the epoch's loss: non-finite if any batch's was

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._update is not None:
            self._update.halt_on_nonfinite.assign(0)
            self._update.halted.assign(0)

    def _check(self, batch: int, logs: dict[str, Any] | None) -> None:
        loss = (logs or {}).get("loss")
        value = float("nan") if loss is None else float(np.asarray(loss))
        skipped = self._seen if self._update is None else int(self._update.skipped.numpy())
        if (loss is None or math.isfinite(value)) and skipped == self._seen:
            return
        applied = int(self.model.optimizer.iterations.numpy())
        if self._update is not None and skipped == self._seen:
            # Only the reported loss is non-finite (e.g. an added loss with no gradient):
            # the gradients were finite, so the updates went on until this guard saw it.
            what = (
                f"The training loss became NaN or infinite by batch {batch} of epoch "
                f"{self._epoch}, but its gradient was finite: the update was applied, and "
                f"training stopped after optimizer update {applied}."
            )
        else:
            where = ""
            if self._update is not None:
                steps = max(1, int(self._update.accumulation_steps))
                bad = (applied - self._epoch_start) * steps + steps - 1
                where = f" (batch {bad} of epoch {self._epoch})"
            what = (
                f"The {'training loss' if not math.isfinite(value) else 'gradient'} became "
                f"NaN or infinite at optimizer update {applied + 1}{where}; that update was "
                "not applied and training stopped."
            )
        raise NonFiniteLossError(
            explain(
                what,
                received=f"loss={value}",
                fix="lower the learning rate, pass global_clipnorm=1.0, use "
                'mixed_precision="bf16" instead of "fp16", and check the data for NaN '
                "or infinite values (tf.debugging.check_numerics). To stop without an "
                "error, pass callbacks=[keras.callbacks.TerminateOnNaN()].",
            )
        )


def guarded(callbacks: Any, model: Any, update: Any) -> Any:
    """``model.fit``'s ``callbacks`` with a :class:`NonFiniteGuard` added, unless the user
    asked to stop otherwise (``keras.callbacks.TerminateOnNaN``) or one is there already.

    Under a ``LossScaleOptimizer`` skipping an overflow is the normal course (the scale
    adapts): only the loss is watched. A ``CallbackList`` is left as it is.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    listed = list(callbacks or [])
    if any(isinstance(c, (keras.callbacks.TerminateOnNaN, NonFiniteGuard)) for c in listed):
        return callbacks
    loss_scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    return [*listed, NonFiniteGuard(None if loss_scaled else update)]


@contextlib.contextmanager
def halt_released(update: Any) -> Iterator[None]:
    """Keras skips ``on_train_end`` when ``fit`` raises: a later ``fit`` must not stay halted
    (:class:`NonFiniteGuard`)."""
    try:
        yield
    finally:
        update.halt_on_nonfinite.assign(0)
        update.halted.assign(0)


class ExactSteps(keras.callbacks.Callback):  # type: ignore[misc]
    """Makes an epoch run exactly ``steps_per_epoch`` steps with ``steps_per_execution > 1``.

    Keras's train function always runs whole executions, so 5 steps per epoch at 3 steps
    per execution train 6 batches (Keras 3.15, ``model.fit`` on one device too). Before each
    call this tells tfscale's train function how many steps the epoch has left.
    """

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        function = self.model.train_function
        steps = self.params.get("steps")
        if function is None or not hasattr(function, "limit"):
            return
        function.limit = (
            None if not steps else max(1, min(function.steps_per_execution, steps - batch))
        )


# The hooks Keras calls once per train function call (steps_per_execution batches).
_BATCH_HOOKS = (
    "on_batch_begin",
    "on_batch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
)


def watches_batches(callback: Any) -> bool:
    """Whether ``callback`` sees how many steps run per call: it overrides one of
    ``keras.callbacks.Callback``'s batch hooks (Keras calls them once per call of the train
    function, with the call's last batch). tfscale's :class:`ExactSteps` and
    :class:`NonFiniteGuard` work with any number of steps per call; a ``CallbackList`` is
    taken as watching (its callbacks are not looked into)."""
    if isinstance(callback, (ExactSteps, NonFiniteGuard)):
        return False
    if isinstance(callback, keras.callbacks.CallbackList):
        return True
    base = keras.callbacks.Callback
    return any(getattr(type(callback), hook) is not getattr(base, hook) for hook in _BATCH_HOOKS)
