"""What a request for logical devices may ask, and what ``TFSCALE_VIRTUAL_DEVICES`` asks.

TensorFlow-free, so that ``import tfscale`` checks the variable at once and configures the
devices only when TensorFlow is imported (``runtime/tf_import.py``); ``devices/logical.py``
applies them.
"""

from __future__ import annotations

import os

from tfscale.errors import DeviceConfigError, explain

__all__ = [
    "ENV_KIND_VAR",
    "ENV_VAR",
    "KINDS",
    "MAX_VIRTUAL_DEVICES",
    "check_request",
    "env_request",
]

ENV_VAR = "TFSCALE_VIRTUAL_DEVICES"
ENV_KIND_VAR = "TFSCALE_VIRTUAL_DEVICE_KIND"
KINDS = ("CPU", "GPU")

# Logical devices share their physical device's cores (or memory): past a few per core they
# only add per-replica overhead, and hundreds make a two-step fit run for minutes.
MAX_VIRTUAL_DEVICES = 64


def check_request(n: object, kind: object, memory_limit_mb: object) -> None:
    """Refuses a request ``use_virtual_devices`` cannot or should not honour.

    Raises:
        DeviceConfigError: ``n`` is not an int in 1..64, an unknown kind, or a bad memory
            limit.
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_VIRTUAL_DEVICES:
        raise DeviceConfigError(
            explain(
                f"The number of virtual devices must be an integer from 1 to "
                f"{MAX_VIRTUAL_DEVICES}.",
                received=f"n={n!r}",
                allowed=f"an int in 1..{MAX_VIRTUAL_DEVICES} (this machine has "
                f"{os.cpu_count()} CPU cores; 2-8 logical devices are what tests and demos use)",
                fix=f"tfscale.use_virtual_devices(2) (or {ENV_VAR}=2) splits the CPU into 2 "
                "logical devices.",
            )
        )
    if kind not in KINDS:
        raise DeviceConfigError(
            explain(
                "Unknown device kind for virtual devices.",
                received=kind,
                allowed=" or ".join(KINDS),
            )
        )
    if memory_limit_mb is not None and (
        isinstance(memory_limit_mb, bool)
        or not isinstance(memory_limit_mb, int)
        or memory_limit_mb < 1
    ):
        raise DeviceConfigError(
            explain(
                "memory_limit_mb must be a positive integer number of MiB.",
                received=memory_limit_mb,
                allowed="None (CPU) or an int >= 1",
            )
        )


def env_request() -> tuple[int, str] | None:
    """``(n, kind)`` from ``TFSCALE_VIRTUAL_DEVICES`` (and ``TFSCALE_VIRTUAL_DEVICE_KIND``),
    checked; None when unset or empty.

    Raises:
        DeviceConfigError: A value that is not an integer from 1 to 64, or an unknown kind.
    """
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise DeviceConfigError(
            explain(
                f"{ENV_VAR} must be an integer from 1 to {MAX_VIRTUAL_DEVICES}.",
                received=f"{ENV_VAR}={raw!r}",
                allowed=f"an integer in 1..{MAX_VIRTUAL_DEVICES}",
                fix=f"export {ENV_VAR}=2",
            )
        ) from None
    kind = os.environ.get(ENV_KIND_VAR, "CPU").strip().upper() or "CPU"
    check_request(n, kind, None)
    return n, kind
