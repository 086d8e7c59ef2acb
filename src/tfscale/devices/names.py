"""Device names, and which devices a request means: decided once, without TensorFlow.

Every part of tfscale that takes ``devices=`` (``choose_strategy``, ``TaskPool``,
``place`` / ``pipeline``) reads names and requests here, so they all accept the same names
and mean the same thing by ``None``::

    "gpu:1", "/GPU:1", "/job:localhost/replica:0/task:0/device:GPU:1"  ->  "/device:GPU:1"
    devices=None   ->  every GPU, else every CPU device
    devices=[...]  ->  those devices, in that order: each present, none twice, at least one
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tfscale.errors import DeviceConfigError, TfscaleError, explain

__all__ = ["default_devices", "device_kind", "normalize_device", "select_devices"]

_NAME = re.compile(r"^(?:.*/)?(?:device:)?(cpu|gpu|tpu):(\d+)$", re.IGNORECASE)
_ALLOWED = "names like '/device:GPU:0', 'GPU:1' or 'CPU:0'"


def normalize_device(name: object, *, error: type[TfscaleError] = DeviceConfigError) -> str:
    """The canonical name ``/device:KIND:N`` of a device name in any of TensorFlow's forms.

    Raises:
        DeviceConfigError: (or ``error``) ``name`` is not a device name.
    """
    match = _NAME.match(name.strip()) if isinstance(name, str) else None
    if match is None:
        raise error(
            explain(
                "Not a device name.",
                received=repr(name),
                allowed=_ALLOWED,
                fix="list them with `tfscale devices`.",
            )
        )
    return f"/device:{match.group(1).upper()}:{int(match.group(2))}"


def device_kind(name: str) -> str:
    """``"GPU"``, ``"CPU"`` or ``"TPU"``.

    Raises:
        DeviceConfigError: ``name`` is not a device name.
    """
    return normalize_device(name).split(":")[1]


def default_devices(available: Sequence[str]) -> list[str]:
    """What ``devices=None`` means: every GPU of ``available``, else every CPU device.

    Returns:
        The entries of ``available`` as given (in their order).
    """
    kinds = {name: _canonical(name).split(":")[1] for name in available if _canonical(name)}
    wanted = "GPU" if "GPU" in kinds.values() else "CPU"
    return [name for name in available if kinds.get(name) == wanted]


def _canonical(name: str) -> str:
    """``/device:KIND:N``, or ``""`` for a device of another kind (``XLA_CPU:0``)."""
    match = _NAME.match(name.strip())
    return f"/device:{match.group(1).upper()}:{int(match.group(2))}" if match else ""


def select_devices(
    requested: str | Sequence[str] | None,
    available: Sequence[str],
    *,
    who: str,
    error: type[TfscaleError] = DeviceConfigError,
    fix: str = "pass devices=None for every GPU (else every CPU device), or "
    "tfscale.use_virtual_devices(n) before TensorFlow starts to split the CPU.",
) -> list[str]:
    """The devices a request means: ``requested`` checked against ``available``.

    Args:
        requested: Device names in any form, one name, or None for :func:`default_devices`.
        available: The devices that exist (any form), e.g. TensorFlow's logical devices.
        who: Names the caller in messages, e.g. ``"TaskPool"``.
        error: The exception type to raise.
        fix: The fix suggested when a device is absent.

    Returns:
        The matching entries of ``available`` as given, in the order requested.

    Raises:
        DeviceConfigError: (or ``error``) A name that is not a device name, a device that is
            not available or listed twice, or no device at all.
    """
    if requested is None:
        chosen = default_devices(available)
        if not chosen:
            raise error(explain(f"{who}: no device is available.", received=list(available)))
        return chosen
    if not isinstance(requested, (str, list, tuple)):
        raise error(
            explain(
                f"{who}: devices= takes device names, not a count or another object.",
                received=f"devices={requested!r}",
                allowed="None (every GPU, else every CPU device), a name such as 'GPU:1', "
                "or a list of names",
                fix="devices=['GPU:0', 'GPU:1'], or devices=None",
            )
        )
    names = [requested] if isinstance(requested, str) else list(requested)
    by_name = {_canonical(name): name for name in available if _canonical(name)}
    wanted = [normalize_device(name, error=error) for name in names]
    absent = [name for name in wanted if name not in by_name]
    repeated = sorted({name for name in wanted if wanted.count(name) > 1})
    problem = (
        f"{who}: the device list is empty."
        if not wanted
        else f"{who}: devices not present: {', '.join(absent)}."
        if absent
        else f"{who}: a device is listed twice: {', '.join(repeated)}."
        if repeated
        else None
    )
    if problem is not None:
        raise error(
            explain(
                problem,
                received=names,
                allowed=f"distinct names among {', '.join(by_name) or 'no device'}",
                fix=fix,
            )
        )
    return [by_name[name] for name in wanted]
