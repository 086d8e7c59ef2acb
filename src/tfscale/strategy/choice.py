"""``choose_strategy``: gather facts, decide, build, and fall back to one device if needed."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from tfscale.cluster import ClusterConfig, cluster_from_env
from tfscale.errors import StrategyError, TfscaleWarning, explain
from tfscale.strategy.build import (
    START_TIMEOUT_ENV,
    build_strategy,
    enable_memory_growth,
    first_line,
    forget_failed_cluster,
    remedy,
    start_timeout_s,
)
from tfscale.strategy.facts import StrategyFacts, gather_facts
from tfscale.strategy.rules import Decision, decide

__all__ = ["StrategyChoice", "choose_strategy"]


@dataclass(frozen=True)
class StrategyChoice:
    """A built strategy and why it was chosen.

    Attributes:
        strategy: The ``tf.distribute.Strategy``; build models inside ``strategy.scope()``.
        kind: ``"OneDevice"``, ``"Mirrored"``, ``"MultiWorkerMirrored"`` or
            ``"ParameterServer"``.
        devices: This process's devices.
        num_replicas: ``strategy.num_replicas_in_sync``.
        cross_device_ops: Short name of the all-reduce, or None for one device.
        reasons: Each rule's verdict, then the fallback if there was one.
        fallback_error: The exception that building the chosen strategy raised, if it fell
            back to one device; else None.
        cluster: The multi-worker cluster, or None.
    """

    strategy: Any
    kind: str
    devices: tuple[str, ...]
    num_replicas: int
    cross_device_ops: str | None
    reasons: tuple[str, ...]
    fallback_error: BaseException | None = None
    cluster: ClusterConfig | None = field(default=None, repr=False)

    def explain(self) -> str:
        """The choice and its reasons, one per line, for logs and bug reports."""
        ops = f", {self.cross_device_ops}" if self.cross_device_ops else ""
        devices = ", ".join(self.devices)
        head = f"{self.kind}Strategy with {self.num_replicas} replica(s) on {devices}{ops}"
        return "\n".join([head, *(f"  - {r}" for r in self.reasons)])


def _fallback(error: Exception, decision: Decision, facts: StrategyFacts) -> StrategyChoice:
    """OneDeviceStrategy on the best local device after building ``decision`` failed."""
    if decision.kind == "MultiWorkerMirrored":
        forget_failed_cluster()
    # The first device the decision used (GPU:0 when it used GPUs), else the best one seen.
    device = (decision.devices or facts.gpus or facts.cpus or ("/device:CPU:0",))[0]
    why = (
        f"Building {decision.kind}Strategy failed ({first_line(error)}); fell back to "
        f"OneDeviceStrategy on {device}.{remedy(error)} Pass strict=True to raise instead."
    )
    strategy = tf.distribute.OneDeviceStrategy(device)
    warnings.warn(why, TfscaleWarning, stacklevel=3)
    return StrategyChoice(
        strategy=strategy,
        kind="OneDevice",
        devices=(device,),
        num_replicas=1,
        cross_device_ops=None,
        reasons=(*decision.reasons, why),
        fallback_error=error,
    )


#: "1" makes every choose_strategy() strict (set in the workers tfscale launch starts).
STRICT_ENV = "TFSCALE_STRICT_STRATEGY"


def choose_strategy(
    devices: Sequence[str] | None = None,
    *,
    strict: bool = False,
    memory_growth: bool = True,
) -> StrategyChoice:
    """Chooses and builds the strategy that uses every device, and says why.

    See :func:`decide` for the rules and ``docs/strategy.md`` for examples.

    Args:
        devices: Restrict replicas to these device names, e.g. ``["GPU:0", "GPU:1"]``
            (None: every device).
        strict: Raise :class:`tfscale.StrategyError` when building the chosen strategy
            fails, instead of falling back to one device with a warning. Always on in the
            workers ``tfscale launch`` starts (``TFSCALE_STRICT_STRATEGY=1``): a worker that
            falls back trains alone.
        memory_growth: Turn on GPU memory growth first (needs a runtime not yet started).

    In a cluster, construction waits for every worker to start, at most
    ``TFSCALE_WORKER_START_TIMEOUT`` seconds (default 300); then it fails (and falls back,
    unless ``strict=True``). Under a launcher, prefer ``strict=True``: a worker that falls
    back trains alone.

    Returns:
        The built strategy with its kind, devices, replica count, all-reduce and reasons.

    Raises:
        ClusterConfigError: ``TF_CONFIG`` is malformed.
        DeviceConfigError: ``devices`` names a device TensorFlow does not see.
        StrategyError: Building failed and ``strict=True``, the fallback failed too, or
            ``TFSCALE_WORKER_START_TIMEOUT`` is not a positive number.
    """
    strict = strict or os.environ.get(STRICT_ENV) == "1"
    # A malformed TF_CONFIG is the user's to fix, never a fallback: raise before touching GPUs.
    cluster_from_env()
    growth = enable_memory_growth(memory_growth)
    facts = gather_facts()
    decision = decide(facts, devices)
    timeout = start_timeout_s()
    waits: tuple[str, ...] = ()
    if decision.kind == "MultiWorkerMirrored":
        waits = (
            f"Every worker gets {timeout:g} s to start ({START_TIMEOUT_ENV}); then building "
            "fails instead of waiting forever.",
        )
    decision = dataclasses.replace(decision, reasons=(*growth, *decision.reasons, *waits))
    try:
        strategy = build_strategy(decision, start_timeout=timeout)
    except Exception as error:
        if strict:
            if decision.kind == "MultiWorkerMirrored":
                forget_failed_cluster()
            raise StrategyError(
                explain(
                    f"Building {decision.kind}Strategy failed: {first_line(error)}",
                    received=f"devices={list(decision.devices)}, "
                    f"cross_device_ops={decision.cross_device_ops}",
                    allowed="a strategy TensorFlow can build here",
                    fix=(remedy(error).strip() or "see the chained error.")
                    + " strict=False falls back to one device.",
                )
            ) from error
        try:
            return _fallback(error, decision, facts)
        except Exception as second:
            raise StrategyError(
                f"Building {decision.kind}Strategy failed ({first_line(error)}) and so did "
                f"the one-device fallback ({first_line(second)})."
            ) from error
    return StrategyChoice(
        strategy=strategy,
        kind=decision.kind,
        devices=decision.devices,
        num_replicas=int(strategy.num_replicas_in_sync),
        cross_device_ops=decision.cross_device_ops,
        reasons=decision.reasons,
        cluster=decision.cluster,
    )
