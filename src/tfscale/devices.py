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

from tfscale.errors import DeviceConfigError, explain
from tfscale.virtual_devices import ENV_VAR, check_request, env_request

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


def _nvml_memory_bytes(index: int) -> int | None:
    """Total memory of GPU ``index`` from NVML, or None where NVML is absent."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing, no driver, or no such GPU: memory unknown.
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
        memory = _nvml_memory_bytes(index)
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


def use_virtual_devices(n: int, kind: str = "CPU", memory_limit_mb: int | None = None) -> list[str]:
    """Splits the first physical device of ``kind`` into ``n`` logical devices.

    Must run before TensorFlow's runtime starts (before any op, dataset or model is built).
    Calling it again with the same ``n`` and ``kind`` is harmless.

    Args:
        n: Number of logical devices, at least 1.
        kind: ``"CPU"`` or ``"GPU"``.
        memory_limit_mb: Memory of each logical GPU in MiB. For a GPU it defaults to
            90% of the card's memory (from NVML) divided by ``n``; ignored for a CPU.

    Returns:
        Names of the logical devices, e.g. ``["/device:CPU:0", "/device:CPU:1"]``.

    Raises:
        DeviceConfigError: ``n`` < 1, an unknown or absent kind, no GPU memory limit can
            be derived, or the runtime has already started with another configuration.
    """
    check_request(n, kind, memory_limit_mb)
    physical = tf.config.list_physical_devices(kind)
    if not physical:
        present = sorted({d.device_type for d in tf.config.list_physical_devices()})
        raise DeviceConfigError(
            explain(
                f"No physical {kind} is visible to TensorFlow, so it cannot be split.",
                received=f"kind={kind!r}",
                allowed=f"a kind TensorFlow sees: {', '.join(present) or 'none'}",
                fix='use kind="CPU", or run `tfscale doctor` to see why no GPU is visible.',
            )
        )
    target = physical[0]
    names = [f"/device:{kind}:{i}" for i in range(n)]
    existing = tf.config.get_logical_device_configuration(target)
    if existing is not None and len(existing) == n:
        return names
    configs: list[tf.config.LogicalDeviceConfiguration]
    if kind == "GPU":
        limit = memory_limit_mb
        if limit is None:
            total = _nvml_memory_bytes(0)
            if total is None:
                raise DeviceConfigError(
                    explain(
                        "A logical GPU needs a memory limit and the GPU's memory is unknown.",
                        received="memory_limit_mb=None",
                        allowed="an int number of MiB per logical GPU",
                        fix=f"tfscale.use_virtual_devices({n}, 'GPU', memory_limit_mb=4096)",
                    )
                )
            limit = int(total * 0.9 / n / (1024 * 1024))
        configs = [tf.config.LogicalDeviceConfiguration(memory_limit=limit) for _ in range(n)]
    else:
        configs = [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
    try:
        tf.config.set_logical_device_configuration(target, configs)
    except RuntimeError as error:
        have = len(existing) if existing else 1
        raise DeviceConfigError(
            explain(
                "TensorFlow's runtime has already started, so its devices are fixed "
                f"({have} logical {kind} device(s)); virtual devices must be set before.",
                received=f"use_virtual_devices({n}, {kind!r}) after start-up",
                allowed="a call before any TensorFlow op, dataset or model is created",
                fix=f"call it first thing in the program, or set {ENV_VAR}={n} in the "
                "environment before starting Python.",
            )
        ) from error
    return names


def apply_env_virtual_devices() -> list[str] | None:
    """Applies ``TFSCALE_VIRTUAL_DEVICES=N`` (and optional ``TFSCALE_VIRTUAL_DEVICE_KIND``).

    Returns:
        The logical device names, or None when the variable is unset or empty.

    Raises:
        DeviceConfigError: The variable is not an integer from 1 to 64, or see
            :func:`use_virtual_devices`.
    """
    request = env_request()
    if request is None:
        return None
    return use_virtual_devices(*request)
