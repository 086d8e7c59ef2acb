"""Which devices a pool's workers run on, and how a worker process is pinned to one.

Which devices a request means is decided by :mod:`tfscale.devices.names` (``devices=None``:
every logical GPU, else every logical CPU device), as for ``choose_strategy`` and
``pipeline``. A worker process for GPU ``k`` sees only that GPU through
``CUDA_VISIBLE_DEVICES`` (so inside it the GPU is ``/device:GPU:0``): the ``k``-th GPU this
process sees, read from its own ``CUDA_VISIBLE_DEVICES`` as CUDA reads it
(:mod:`tfscale.devices.visible`, shared with the doctor and the launcher). A worker process
for a CPU device sees no GPU at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tfscale.devices.names import default_devices, device_kind, normalize_device, select_devices
from tfscale.devices.visible import ENV_VAR, read_visible_devices
from tfscale.errors import DeviceConfigError, explain

__all__ = ["child_environment", "default_devices", "local_device", "normalize", "resolve_devices"]


def normalize(name: str) -> str:
    """``"gpu:1"``, ``"/GPU:1"`` or a fully qualified name -> ``"/device:GPU:1"``.

    Raises:
        DeviceConfigError: The name is not a device name.
    """
    return normalize_device(name)


def resolve_devices(devices: str | Sequence[str] | None, logical: Sequence[str]) -> list[str]:
    """The pool's devices: ``devices`` checked against the ``logical`` ones TensorFlow lists.

    Raises:
        DeviceConfigError: A device is not present, is given twice, or none is left.
    """
    present = [normalize_device(n) for n in logical]
    return select_devices(
        devices,
        present,
        who="TaskPool",
        fix="pass devices=None for every GPU (or every CPU device), or "
        "tfscale.use_virtual_devices(n) first to split the CPU; "
        "use workers_per_device=k for k workers per device.",
    )


def local_device(device: str) -> str:
    """The name of ``device`` inside a worker process pinned to it."""
    return f"/device:{device_kind(device)}:0"


def child_environment(device: str, parent: Mapping[str, str]) -> dict[str, str]:
    """The environment of a worker process pinned to ``device``.

    GPU ``k`` is the ``k``-th GPU this process sees: the ``k``-th GPU of the parent's
    ``CUDA_VISIBLE_DEVICES`` as CUDA reads it, else CUDA device ``k``. A CPU device's worker
    sees no GPU.

    Raises:
        DeviceConfigError: GPU ``k`` is not among the GPUs ``CUDA_VISIBLE_DEVICES`` shows.
    """
    env = dict(parent)
    env.pop("TFSCALE_VIRTUAL_DEVICES", None)  # the child must not split or start TF by itself
    env.pop("TF_CONFIG", None)
    name = normalize_device(device)
    number = int(name.rsplit(":", 1)[1])
    if device_kind(name) != "GPU":
        env[ENV_VAR] = "-1"
        return env
    visible = read_visible_devices(parent).ids
    if visible is None:
        env[ENV_VAR] = str(number)
    elif number < len(visible):
        env[ENV_VAR] = visible[number]
    else:
        raise DeviceConfigError(
            explain(
                f"TaskPool device {name} is not among the GPUs {ENV_VAR} shows.",
                received=f"{ENV_VAR}={parent.get(ENV_VAR)!r} (read as CUDA reads it: "
                f"{', '.join(visible) or 'no GPU'})",
                allowed=f"GPU:0 to GPU:{len(visible) - 1}" if visible else "no GPU device",
                fix="pass devices=None, or fix CUDA_VISIBLE_DEVICES (see `tfscale doctor`).",
            )
        )
    return env
