"""Callbacks ``tfscale.fit`` adds to the user's: a stop on a non-finite loss; who is chief."""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfscale.errors import NonFiniteLossError, explain

__all__ = ["ExactSteps", "NonFiniteGuard", "is_chief"]


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True on the one worker that prints and writes (always true on a single machine)."""
    return bool(strategy.extended.should_checkpoint)


class NonFiniteGuard(keras.callbacks.Callback):  # type: ignore[misc]
    """Stops training with :class:`NonFiniteLossError` at the first non-finite loss or
    gradient (the optimizer's count of skipped updates went up).

    The update whose gradient was not finite was skipped on every replica (the distributed
    update tests the reduced gradient), and with ``halt_on_nonfinite`` every later one too,
    so the model stays as it was before it. That lets this guard run off the training thread
    (``async_safe``: Keras then does not wait for each step's logs, which would cost about a
    millisecond a step on small models); its error reaches ``fit`` a few steps later, with the
    number of the bad update. A non-finite loss whose gradient was finite (a term without
    gradient) is no reason to skip: those updates are applied, and the error says so.
    ``tfscale.fit`` adds it unless the user passed
    ``keras.callbacks.TerminateOnNaN``, which stops quietly.

    Args:
        update: The model optimizer's ``DistributedUpdate`` (None: the loss alone is read).
    """

    async_safe = True

    def __init__(self, update: Any = None) -> None:
        super().__init__()
        self._update = update
        self._seen = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self._update is not None:
            self._seen = int(self._update.skipped.numpy())
            self._update.halted.assign(0)
            self._update.halt_on_nonfinite.assign(1)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._update is not None:
            self._update.halt_on_nonfinite.assign(0)
            self._update.halted.assign(0)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
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
                f"The training loss became NaN or infinite at batch {batch} of this epoch, "
                f"but its gradient was finite: the update was applied, and training stopped "
                f"after optimizer update {applied}."
            )
        else:
            what = (
                f"The {'training loss' if not math.isfinite(value) else 'gradient'} became "
                f"NaN or infinite at optimizer update {applied + 1} (batch {batch} of this "
                "epoch); that update was not applied and training stopped."
            )
        raise NonFiniteLossError(
            explain(
                what,
                received=f"loss={value}",
                fix="lower the learning rate, pass clipnorm=1.0, use "
                'mixed_precision="bf16" instead of "fp16", and check the data for NaN '
                "or infinite values (tf.debugging.check_numerics). To stop without an "
                "error, pass callbacks=[keras.callbacks.TerminateOnNaN()].",
            )
        )


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
