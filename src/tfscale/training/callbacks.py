"""Keras callbacks for tfscale's loop: History always, a progress bar on the chief only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

__all__ = ["is_chief", "make_callbacks", "wants_batch_logs", "wants_timings"]


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True on the one worker that prints and writes (always true on a single machine)."""
    return bool(strategy.extended.should_checkpoint)


def wants_timings(callbacks: Sequence[Any]) -> bool:
    """Whether a callback asks for per-step timings (``tfscale_wants_timings = True``).

    A callback that sets this attribute receives ``fetch_seconds`` and ``step_seconds``
    in the logs of ``on_train_batch_end`` (see :class:`tfscale.training.Trainer`).
    """
    return any(getattr(c, "tfscale_wants_timings", False) for c in callbacks)


def wants_batch_logs(callbacks: Sequence[Any]) -> bool:
    """Whether a callback reads the logs of each batch (overrides a batch-end hook).

    When none does (no progress bar, only History and epoch-level callbacks), the train
    function leaves the per-call loss and metric results out; Keras's base ``Callback``
    ignores them.
    """
    base = keras.callbacks.Callback
    for callback in callbacks:
        for name in ("on_train_batch_end", "on_batch_end"):
            # A method of a subclass, or a function set on the instance (LambdaCallback).
            hook = getattr(callback, name, None)
            if getattr(hook, "__func__", hook) is not getattr(base, name):
                return True
    return False


def make_callbacks(
    callbacks: Sequence[Any] | None,
    *,
    model: Any,
    strategy: tf.distribute.Strategy,
    verbose: int | str,
    epochs: int,
    steps: int | None,
) -> keras.callbacks.CallbackList:
    """A Keras ``CallbackList`` with History and, on the chief, a progress bar.

    Args:
        callbacks: The user's callbacks.
        model: The model the callbacks see.
        strategy: Decides who is chief.
        verbose: ``"auto"`` (1), 0 (silent), 1 (bar) or 2 (one line per epoch).
        epochs: Total epochs.
        steps: Optimizer updates per epoch, where known.
    """
    level = 1 if verbose == "auto" else int(verbose)
    if not is_chief(strategy):
        level = 0
    return keras.callbacks.CallbackList(
        list(callbacks or []),
        add_history=True,
        add_progbar=level != 0,
        model=model,
        verbose=level,
        epochs=epochs,
        steps=steps,
    )
