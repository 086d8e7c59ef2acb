"""Which strategy a model is meant to run under, when the caller names none.

One order for everything that takes ``strategy=None`` (``tfscale.fit`` / ``prepare`` and
``check_scope``): the strategy given, else the one whose scope is active, else the one the
model was built under (Keras records it). What happens when none of these exists is the
caller's decision: training chooses one over every device, a scope check judges against the
strategy that owns the model's variables.
"""

from __future__ import annotations

from typing import Any

from tfscale.interop import internals

__all__ = ["num_workers", "strategy_in_effect"]


def strategy_in_effect(model: Any, strategy: Any = None) -> Any:
    """The strategy given, else the active scope's, else the model's own; None otherwise."""
    import tensorflow as tf

    if strategy is not None:
        return strategy
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    return internals.model_strategy(model)


def num_workers(strategy: Any) -> int:
    """Worker processes (chief included) the strategy's cluster spans; 1 without a cluster."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec().as_dict()
    return max(1, len(spec.get("worker", [])) + len(spec.get("chief", [])))
