"""Which devices a plan has rows for, and how much memory each has (TensorFlow runs here)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tfscale.devices.names import device_kind, normalize_device
from tfscale.training.memory.measure import cpu_bfc_enabled

__all__ = ["cpu_bfc_limit", "device_capacities", "plan_devices"]


def plan_devices(model: Any, strategy: Any = None) -> list[str]:
    """The devices holding a replica: the strategy's (the model's, or the one in scope,
    where ``strategy`` is None), each as ``/device:KIND:N``."""
    from tfscale.strategy.current import strategy_in_effect

    strategy = strategy_in_effect(model, strategy)
    extended = getattr(strategy, "extended", None)  # None: the model has no strategy
    devices = list(getattr(extended, "worker_devices", ()) or ())
    if not devices:  # the default strategy: the first device TensorFlow places on
        import tensorflow as tf

        gpus = tf.config.list_logical_devices("GPU")
        devices = [gpus[0].name if gpus else "/device:CPU:0"]
    return [normalize_device(d) for d in devices]


def cpu_bfc_limit() -> int | None:
    """The CPU allocator's limit where ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` sets one (TensorFlow's
    ``process_state.cc`` reads it with ``TF_CPU_ALLOCATOR_USE_BFC=true``)."""
    if not cpu_bfc_enabled():
        return None
    try:
        return int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "")) * 2**20
    except ValueError:
        return None


def device_capacities(devices: Sequence[str]) -> tuple[int | None, ...]:
    """Each device's memory where known (``discover_devices``): a logical GPU's limit, else
    its physical GPU's total; for CPUs, which share one allocator, an equal share of its
    limit (``TF_CPU_BFC_MEM_LIMIT_IN_MB``) or of the host's memory."""
    from tfscale.devices.discovery import discover_devices

    infos = discover_devices()
    physical = {
        (i.kind, index): i.memory_bytes
        for kind in ("CPU", "GPU")
        for index, i in enumerate(d for d in infos if d.physical and d.kind == kind)
    }
    logical = {normalize_device(i.name): i.memory_bytes for i in infos if not i.physical}
    cpus = sum(1 for d in devices if device_kind(d) == "CPU")
    host = cpu_bfc_limit() or physical.get(("CPU", 0))
    capacities: list[int | None] = []
    for device in devices:
        if device_kind(device) == "CPU":
            capacities.append(None if host is None else host // max(1, cpus))
            continue
        index = int(device.rsplit(":", 1)[-1])
        known = logical.get(device)
        capacities.append(known if known is not None else physical.get(("GPU", index)))
    return tuple(capacities)
