"""How CUDA reads ``CUDA_VISIBLE_DEVICES``: the one reading the doctor, the launcher and the
TaskPool share. Pure and TensorFlow-free.

CUDA takes a comma-separated list of GPU indices or ``GPU-``/``MIG-`` UUIDs (a unique
prefix is enough) and stops at the first entry it cannot use: ``0,7,1`` on a 4-GPU machine
shows GPU 0 only; ``abc``, ``0;1`` (one entry, neither index nor UUID), ``-1`` and an empty
value show none. The NVIDIA driver (NVML, nvidia-smi) ignores the variable, which is why the
doctor can compare the two.

    raw        4 GPUs known       driver unknown      CUDA shows
    unset      every GPU          every GPU           every GPU
    "2,0"      ids 2,0            ids 2,0             GPU 2 then GPU 0
    "0,7,1"    ids 0 (7: no GPU)  ids 0,7,1           GPU 0
    "-1", ""   none               none                none
    "GPU-3ab"  ids GPU-3ab        ids GPU-3ab         the GPU whose UUID starts so
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ENV_VAR", "GpuId", "VisibleDevices", "parse_visible_devices", "read_visible_devices"]

ENV_VAR = "CUDA_VISIBLE_DEVICES"
_INDEX = re.compile(r"^-?\d+$")
_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Fa-f][0-9A-Fa-f/-]*$")


class GpuId(Protocol):
    """What the reading needs to know of a GPU the driver lists (``DriverGpu`` has it)."""

    @property
    def index(self) -> int:
        """The driver's index (``nvidia-smi`` order)."""
        ...

    @property
    def uuid(self) -> str:
        """``GPU-...`` identifier."""
        ...


@dataclass(frozen=True)
class VisibleDevices:
    """What CUDA would make of ``CUDA_VISIBLE_DEVICES``.

    Attributes:
        ids: The entries CUDA uses, in its order (``"2"``, ``"GPU-3ab"``): the value to give a
            child process for each visible GPU; None when the variable is unset (every GPU).
            Without the driver's GPU list, every entry of valid form up to the first invalid
            one (an index past the last GPU or an unknown UUID cannot be told).
        indices: Driver indices of the GPUs CUDA would show, in CUDA's order; None when every
            GPU is shown (the variable is unset) or the driver's GPUs are unknown.
        problems: ``(status, text)`` pairs, status ``"fail"`` or ``"warn"``.
    """

    ids: tuple[str, ...] | None
    indices: tuple[int, ...] | None
    problems: tuple[tuple[str, str], ...]


def read_visible_devices(
    env: Mapping[str, str], gpus: Sequence[GpuId] = (), *, driver_known: bool = False
) -> VisibleDevices:
    """:func:`parse_visible_devices` of ``env``'s ``CUDA_VISIBLE_DEVICES``."""
    return parse_visible_devices(env.get(ENV_VAR), gpus, driver_known=driver_known)


def parse_visible_devices(
    raw: str | None, gpus: Sequence[GpuId], *, driver_known: bool = True
) -> VisibleDevices:
    """Reads ``CUDA_VISIBLE_DEVICES`` the way CUDA does and lists what is wrong with it.

    Args:
        raw: The variable's value, None when unset.
        gpus: The GPUs the driver sees.
        driver_known: False when the driver could not be read; entries are then checked
            for form only.

    Returns:
        The GPUs CUDA would show and the problems found.
    """
    if raw is None:
        return VisibleDevices(None, None, ())
    if not raw.strip():
        return VisibleDevices((), (), (("fail", "is set but empty, which hides every GPU"),))
    ids: list[str] = []
    shown: list[int] = []
    problems: list[tuple[str, str]] = []
    entries = raw.split(",")
    for position, entry in enumerate(entries):
        token = entry.strip()
        after = " and every entry after it" if position < len(entries) - 1 else ""
        found: int | None = None
        if _INDEX.match(token):
            index = int(token)
            if index < 0:
                if not ids:
                    problems.append(("fail", f"starts with {token}, which hides every GPU"))
                break
            if driver_known and index >= len(gpus):
                problems.append(
                    (
                        "fail",
                        f"names GPU {index} but the driver sees {_count(gpus)}; "
                        f"CUDA ignores it{after}",
                    )
                )
                break
            found, token = index, str(index)
        elif _UUID.match(token):
            found = _by_uuid(token, gpus) if driver_known else None
            if found is None and driver_known:
                if not token.startswith("MIG-"):
                    problems.append(
                        ("fail", f"names {token}, which no GPU has; CUDA ignores it{after}")
                    )
                    break
                problems.append(("warn", f"names MIG instance {token}, which is not verified"))
        else:
            problems.append(
                (
                    "fail",
                    f"entry {entry!r} is neither a GPU index nor a GPU-/MIG- UUID; "
                    f"CUDA ignores it{after}",
                )
            )
            break
        if (found is not None and found in shown) or token in ids:
            problems.append(("warn", f"lists GPU {token if found is None else found} twice"))
            continue
        ids.append(token)
        if found is not None:
            shown.append(found)
    return VisibleDevices(tuple(ids), tuple(shown) if driver_known else None, tuple(problems))


def _count(gpus: Sequence[GpuId]) -> str:
    if not gpus:
        return "no GPU"
    return f"{len(gpus)} (indices 0-{len(gpus) - 1})"


def _by_uuid(token: str, gpus: Sequence[GpuId]) -> int | None:
    matches = [g.index for g in gpus if g.uuid.lower().startswith(token.lower())]
    return matches[0] if len(matches) == 1 else None
