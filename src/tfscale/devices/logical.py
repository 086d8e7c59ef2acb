"""Logical devices: splitting a physical CPU or GPU before TensorFlow's runtime starts.

The import hook (``tf_import.py``) calls :func:`apply_env_virtual_devices` the moment
TensorFlow has finished importing, and that moment may come while any tfscale module is
itself importing TensorFlow (``tfscale.devices.discovery``, ``tfscale.strategy``, ...). So
this module imports TensorFlow only inside its functions and imports no tfscale module that
imports it: the hook never re-enters a module that is half imported, whichever module the first
``import tensorflow`` came from. ``tfscale.devices.discovery`` re-exports its public names.
"""

from __future__ import annotations

from tfscale.devices.virtual import ENV_VAR, check_request, env_request
from tfscale.errors import DeviceConfigError, explain

__all__ = ["apply_env_virtual_devices", "nvml_memory_bytes", "use_virtual_devices"]


def nvml_memory_bytes(index: int) -> int | None:
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
    import tensorflow as tf

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
            total = nvml_memory_bytes(0)
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
