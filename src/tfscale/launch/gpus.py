"""Which GPUs each local worker gets, decided without TensorFlow.

Two MultiWorkerMirrored workers must not share a GPU: NCCL refuses two ranks on one device,
and each process would reserve memory on every GPU it sees. So each worker gets its own
block of the GPUs this machine shows through its own ``CUDA_VISIBLE_DEVICES``::

    4 GPUs, -n 2:  worker 0 -> CUDA_VISIBLE_DEVICES=0,1   worker 1 -> CUDA_VISIBLE_DEVICES=2,3

The GPUs this machine shows are those of ``CUDA_VISIBLE_DEVICES`` read as CUDA reads it
(:mod:`tfscale.devices.visible`, the doctor's reading): ``-1``, ``abc``, ``0;1`` or an empty
value show none, so the workers train on CPUs; unset, every GPU ``nvidia-smi -L`` lists.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tfscale.devices.visible import read_visible_devices
from tfscale.errors import LaunchError, explain
from tfscale.processes import run

__all__ = ["assign_gpus", "parse_gpu_list", "visible_gpus"]

_GPU_LINE = re.compile(r"^GPU (\d+):.*?(?:\(UUID: ([^)]+)\))?\s*$")


@dataclass(frozen=True)
class _ListedGpu:
    index: int
    uuid: str


def _nvidia_smi_list() -> str:
    done = run(["nvidia-smi", "-L"], timeout=20)
    return done.stdout if done.returncode == 0 and done.stdout else ""  # no tools: no GPUs


def parse_gpu_list(text: str) -> list[_ListedGpu]:
    """The GPUs of ``nvidia-smi -L`` output (``GPU 0: NVIDIA H100 (UUID: GPU-...)``)."""
    found = []
    for line in text.splitlines():
        match = _GPU_LINE.match(line.strip())
        if match:
            found.append(_ListedGpu(int(match.group(1)), match.group(2) or ""))
    return found


def visible_gpus(
    env: Mapping[str, str], list_gpus: Callable[[], str] = _nvidia_smi_list
) -> tuple[str, ...]:
    """The GPU ids workers may use: the GPUs CUDA would show this process.

    Args:
        env: The launcher's environment.
        list_gpus: Returns ``nvidia-smi -L`` output (a fake in tests); empty when there is
            no driver tool, and then ``CUDA_VISIBLE_DEVICES`` entries are checked for form only.

    Returns:
        GPU ids as ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs), in CUDA's order; empty
        when there are none.
    """
    listed = parse_gpu_list(list_gpus())
    visible = read_visible_devices(env, listed, driver_known=bool(listed))
    if visible.ids is None:
        return tuple(str(gpu.index) for gpu in listed)
    return visible.ids


def assign_gpus(
    gpus: Sequence[str], workers: int, per_worker: int | None = None
) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` for each worker, or None to leave a worker's environment alone.

    Args:
        gpus: From :func:`visible_gpus`.
        workers: Processes that train (MultiWorkerMirrored workers, or the ps job's workers).
        per_worker: GPUs per worker; None splits ``gpus`` evenly; 0 runs workers on CPU.

    Returns:
        One value per worker: a comma-separated id list, ``""`` (no GPU) or None (no GPUs on
        this machine, nothing to decide).

    Raises:
        LaunchError: Fewer GPUs than asked for, or fewer GPUs than workers.
    """
    if per_worker == 0:
        return ["" if gpus else None] * workers
    if not gpus:
        if per_worker:
            raise LaunchError(
                explain(
                    f"--gpus-per-worker {per_worker} asks for GPUs, but none are visible.",
                    received="no GPU in CUDA_VISIBLE_DEVICES / nvidia-smi -L",
                    allowed="--gpus-per-worker 0 or none on a machine without GPUs",
                    fix="run on a machine with GPUs, or drop --gpus-per-worker.",
                )
            )
        return [None] * workers
    share = len(gpus) // workers if per_worker is None else per_worker
    if share < 1 or share * workers > len(gpus):
        raise LaunchError(
            explain(
                f"{workers} workers cannot each have their own GPU: {len(gpus)} visible"
                + (f", {per_worker} asked per worker." if per_worker else "."),
                received=f"GPUs {', '.join(gpus)}; -n {workers}",
                allowed=f"-n <= {len(gpus)} (NCCL runs one worker per GPU)",
                fix=f"use -n {len(gpus)} or fewer (with --devices-per-worker K to split each "
                "GPU into K logical devices), or --gpus-per-worker 0 to train on CPUs.",
            )
        )
    return [",".join(gpus[i * share : (i + 1) * share]) for i in range(workers)]
