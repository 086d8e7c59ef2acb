"""The options of a prepared model or loop: one object, decided once, passed down.

``prepare``, ``fit`` and ``prepare_loop`` take the same options; each makes one
:class:`Options` and everything below (the step functions, the distributed update) reads it
from there (Lightning Fabric's configuration object, rather than the same options repeated in
every signature). Its own module so that ``prepare.py`` and ``loop.py`` both use it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from tfscale.training.allreduce import Compression
from tfscale.training.precision import Precision, resolve_precision

__all__ = ["Options", "check_switch", "resolve_strategy"]


def check_switch(name: str, value: object, auto: bool = False) -> None:
    """A yes/no option (``remat``, ``sync_batchnorm``, ``jit_compile``): a bool; with
    ``auto``, also None or ``"auto"`` (the model's own ``compile`` setting). Anything else
    was read as yes or no by ``bool()``, silently.

    Raises:
        TrainingError: Another value.
    """
    from tfscale.errors import TrainingError, explain

    if isinstance(value, (bool, np.bool_)):
        return
    if auto and (value is None or (isinstance(value, str) and value == "auto")):
        return
    raise TrainingError(
        explain(
            f"{name} is a yes/no option.",
            received=f"{name}={value!r}",
            allowed="True or False"
            + (", or None / 'auto' (the model's compile setting)" if auto else ""),
            fix=f"{name}=True",
        )
    )


@dataclass(frozen=True)
class Options:
    """tfscale's options for a prepared model.

    Attributes:
        accumulation_steps: Micro-batches (steps) per optimizer update.
        clipnorm: Clip the all-reduced gradient to this global norm, or None (the
            ``global_clipnorm`` of ``prepare`` and ``fit``).
        remat: Recompute activations in the backward pass.
        jit_compile: Compile the model's forward and backward pass with XLA.
        sync_batchnorm: BatchNormalization statistics over all replicas' examples.
        precision: The decided mixed precision.
        bucket_bytes: Bytes per gradient all-reduce bucket; None, one packed all-reduce.
        gradient_compression: ``"bf16"`` / ``"fp16"``: all-reduce dense gradients in it.
        shard_optimizer_state: Keep each optimizer slot once, one shard per replica (ZeRO
            stage 1, ``training/sharding.py``).
    """

    accumulation_steps: int = 1
    clipnorm: float | None = None
    bucket_bytes: int | None = None
    gradient_compression: Compression | None = None
    remat: bool = False
    jit_compile: bool = False
    sync_batchnorm: bool = False
    precision: Precision = field(default_factory=lambda: resolve_precision(None))
    shard_optimizer_state: bool = False


def resolve_strategy(model: Any, strategy: tf.distribute.Strategy | None) -> Any:
    """The strategy to train with: ``strategy_in_effect`` (explicit, the active scope's, the
    model's own), else ``tfscale.choose_strategy()`` over every device.

    Raises:
        TrainingError: ``strategy`` is neither None nor a ``tf.distribute.Strategy`` (a
            ``StrategyChoice`` or a name).
    """
    from tfscale.errors import TrainingError, explain
    from tfscale.strategy import choose_strategy, strategy_in_effect

    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        given = type(strategy).__name__
        fix = (
            "strategy=choice.strategy, where choice = tfscale.choose_strategy()"
            if hasattr(strategy, "strategy")
            else "strategy=tf.distribute.MirroredStrategy(), or leave strategy=None: "
            "tfscale.choose_strategy() decides"
        )
        raise TrainingError(
            explain(
                "strategy= takes a tf.distribute.Strategy.",
                received=f"strategy={strategy!r} ({given})",
                allowed="None, or a tf.distribute.Strategy object",
                fix=fix,
            )
        )

    found = strategy_in_effect(model, strategy)
    return found if found is not None else choose_strategy().strategy
