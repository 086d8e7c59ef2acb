"""The allocator's own peak, read per device (BFC on the CPU, the GPU allocator on GPUs).

``tf.config.experimental.get_memory_info`` reports a device allocator's current and peak
bytes; on the CPU only when ``TF_CPU_ALLOCATOR_USE_BFC=true`` was set before TensorFlow
started (otherwise it raises). Logical CPU devices draw on one allocator, the process's:
reading (or resetting) ``CPU:0`` reads (resets) them all, measured: 4 MiB placed on
``CPU:1`` shows on ``CPU:0`` too. Their measured peak is one number for all of them, to be
compared with the plan summed over them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from tfscale.devices.names import device_kind, normalize_device

__all__ = [
    "MeasuredPeak",
    "allocator_groups",
    "cpu_bfc_enabled",
    "measured_peaks",
    "read_peaks",
    "reset_peaks",
]


@dataclass(frozen=True)
class MeasuredPeak:
    """One allocator's peak during the measured steps.

    Attributes:
        devices: The devices drawing on this allocator (all logical CPUs share one).
        peak_bytes: Its peak since the steps began.
        start_bytes: Bytes it held as they began (weights, optimizer state, input).
    """

    devices: tuple[str, ...]
    peak_bytes: int
    start_bytes: int


def cpu_bfc_enabled() -> bool:
    """Whether the CPU's allocator reports its bytes (``TF_CPU_ALLOCATOR_USE_BFC=true``)."""
    return os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("1", "true")


def allocator_groups(devices: Sequence[str]) -> list[tuple[str, ...]]:
    """``devices`` grouped by the allocator they draw on: every CPU in one group, each GPU
    in its own. CPUs are left out when the CPU allocator does not report its bytes."""
    names = [normalize_device(d) for d in devices]
    cpus = tuple(n for n in names if device_kind(n) == "CPU")
    groups: list[tuple[str, ...]] = [(n,) for n in names if device_kind(n) == "GPU"]
    if cpus and cpu_bfc_enabled():
        groups.insert(0, cpus)
    return groups


def _key(device: str) -> str:
    return normalize_device(device).replace("/device:", "")


def reset_peaks(devices: Sequence[str]) -> list[int]:
    """Resets the peak of each allocator of ``devices`` (:func:`allocator_groups`) and
    returns the bytes each holds now."""
    import tensorflow as tf

    starts = []
    for group in allocator_groups(devices):
        tf.config.experimental.reset_memory_stats(_key(group[0]))
        starts.append(int(tf.config.experimental.get_memory_info(_key(group[0]))["current"]))
    return starts


def read_peaks(devices: Sequence[str], starts: Sequence[int]) -> list[MeasuredPeak]:
    """Each allocator's peak since :func:`reset_peaks` returned ``starts``."""
    import tensorflow as tf

    return [
        MeasuredPeak(
            group, int(tf.config.experimental.get_memory_info(_key(group[0]))["peak"]), start
        )
        for group, start in zip(allocator_groups(devices), starts, strict=True)
    ]


@contextmanager
def measured_peaks(devices: Sequence[str]) -> Iterator[list[MeasuredPeak]]:
    """Resets each allocator's peak on entry and fills the list with the peaks on exit.

    Example::

        with measured_peaks(["/cpu:0", "/cpu:1"]) as peaks:
            run_steps()
        peaks[0].peak_bytes
    """
    starts = reset_peaks(devices)
    peaks: list[MeasuredPeak] = []
    yield peaks
    peaks.extend(read_peaks(devices, starts))
