"""Watching the strategies a user's script builds and runs, from outside the script.

``doctor --script`` records them; the workers ``tfscale launch`` starts check them. Both wrap
``tf.distribute.Strategy.__init__`` and ``run`` where TensorFlow defines them, once per
process, and leave out the default (no-op) strategy TensorFlow makes per thread on demand.
:func:`watch_fits` sees every ``keras.Model.fit`` call the same way (``doctor --script``,
``tfscale profile`` and the launcher's workers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tfscale.interop import registry
from tfscale.interop.internals import DEFAULT_STRATEGY_CLASS

__all__ = ["call_by_name", "watch_fits", "watch_strategies"]

Built = Callable[[Any], None]
Ran = Callable[[Any, Any], None]


def _defining_class(cls: type, attribute: str) -> type:
    return next(c for c in cls.__mro__ if attribute in vars(c))


def watch_strategies(built: Built | None = None, ran: Ran | None = None) -> None:
    """Calls ``built(strategy)`` after each strategy is constructed and ``ran(strategy,
    outputs)`` after each ``strategy.run``.

    A callback may raise (``SystemExit`` ends the script there); an exception inside
    ``ran`` other than that is the callback's to handle: the step's outputs come first.
    """
    import tensorflow as tf

    def watch_init(original_init: Callable[..., None]) -> Callable[..., None]:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            if built is not None and type(self).__name__ != DEFAULT_STRATEGY_CLASS:
                built(self)

        return init

    def watch_run(original_run: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
            outputs = original_run(self, fn, *args, **kwargs)
            if ran is not None:
                ran(self, outputs)
            return outputs

        return run

    if built is not None:
        owner = _defining_class(tf.distribute.Strategy, "__init__")
        registry.install("script-watch", owner, "__init__", watch_init)
    if ran is not None:
        owner = _defining_class(tf.distribute.Strategy, "run")
        registry.install("script-watch", owner, "run", watch_run)


Called = Callable[[Any, dict[str, Any]], None]


def call_by_name(
    function: Callable[..., Any],
    model: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    change: Callable[[dict[str, Any]], None],
) -> Any:
    """``function(model, *args, **kwargs)`` after ``change(arguments)``, which sees the call's
    arguments by name and may replace them (empty when the call does not bind: ``function``
    then reports the bad call itself). ``watch_fits`` and a prepared model's ``fit`` both
    go through it."""
    import inspect

    try:
        bound = inspect.signature(function).bind(model, *args, **kwargs)
    except TypeError:
        change({})
        return function(model, *args, **kwargs)
    change(bound.arguments)
    return function(*bound.args, **bound.kwargs)


def watch_fits(called: Called) -> Callable[[], None]:
    """Calls ``called(model, arguments)`` before each ``keras.Model.fit``, with the call's
    arguments by name (``x``, ``validation_data``, ...; empty for a call Keras will reject
    itself). ``fit`` then runs with them, so ``called`` may change them (``tfscale
    profile`` adds a callback) or raise (the launcher's worker ends a script that trains
    alone with ``SystemExit``). A prepared model's ``fit`` reaches it with its inputs as
    tfscale hands them to Keras.

    Returns:
        The undo: puts back the ``fit`` this replaced.
    """
    import keras

    def watch(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def fit(model: Any, *args: Any, **kwargs: Any) -> Any:
            return call_by_name(original, model, args, kwargs, lambda named: called(model, named))

        return fit

    owner = _defining_class(keras.Model, "fit")
    return registry.install("script-watch", owner, "fit", watch)
