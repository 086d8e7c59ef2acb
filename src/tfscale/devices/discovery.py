"""Device discovery and virtual (logical) devices.

TensorFlow fixes its device list when its runtime starts, once per process. Splitting one
physical CPU into N logical devices lets MirroredStrategy run N replicas on a machine
without GPUs (Keras's own multi-device tests do the same); splitting one GPU lets several
replicas or tasks share it with a memory limit each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import tensorflow as tf

from tfscale.devices.logical import (
    apply_env_virtual_devices,
    nvml_memory_bytes,
    use_virtual_devices,
)

__all__ = [
    "DeviceInfo",
    "apply_env_virtual_devices",
    "discover_devices",
    "logical_device_names",
    "use_virtual_devices",
]


@dataclass(frozen=True)
class DeviceInfo:
    """One device as TensorFlow sees it.

    Attributes:
        name: Fully qualified name, e.g. ``/physical_device:GPU:0`` or ``/device:CPU:1``.
        kind: ``"CPU"``, ``"GPU"`` or ``"TPU"``.
        physical: True for a physical device, False for a logical one.
        memory_bytes: Memory available to the device where known (a logical GPU's limit,
            a physical GPU's total from NVML, the host's RAM for a CPU), else None.
        description: Model name or compute capability where TensorFlow reports it.
    """

    name: str
    kind: str
    physical: bool
    memory_bytes: int | None = None
    description: str = ""


def _host_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _physical_info(device: tf.config.PhysicalDevice, index: int) -> DeviceInfo:
    kind = device.device_type
    memory: int | None = None
    description = ""
    if kind == "GPU":
        details = tf.config.experimental.get_device_details(device)
        capability = details.get("compute_capability")
        description = str(details.get("device_name", ""))
        if capability:
            description = f"{description} (compute capability {capability[0]}.{capability[1]})"
        memory = nvml_memory_bytes(index)
    elif kind == "CPU":
        memory = _host_memory_bytes()
        description = f"{os.cpu_count()} cores"
    return DeviceInfo(device.name, kind, True, memory, description.strip())


def discover_devices() -> list[DeviceInfo]:
    """Lists the physical and then the logical devices TensorFlow can use.

    Listing logical devices starts TensorFlow's runtime: configure virtual devices first.

    Returns:
        Physical devices (``physical=True``) followed by logical ones, each with kind and
        memory where known.
    """
    infos: list[DeviceInfo] = []
    counts: dict[str, int] = {}
    for device in tf.config.list_physical_devices():
        index = counts.get(device.device_type, 0)
        counts[device.device_type] = index + 1
        infos.append(_physical_info(device, index))
    for logical in tf.config.list_logical_devices():
        memory: int | None = None
        if logical.device_type == "GPU":
            memory = _logical_gpu_limit(logical.name)
        infos.append(DeviceInfo(logical.name, logical.device_type, False, memory))
    return infos


def _logical_gpu_limit(name: str) -> int | None:
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    configs = tf.config.get_logical_device_configuration(gpus[0]) or []
    index = int(name.rsplit(":", 1)[-1])
    if index < len(configs) and configs[index].memory_limit:
        return int(configs[index].memory_limit) * 1024 * 1024
    return None


def logical_device_names(kind: str = "CPU") -> list[str]:
    """Names of the logical devices of ``kind`` (starts the runtime)."""
    return [d.name for d in tf.config.list_logical_devices(kind)]
