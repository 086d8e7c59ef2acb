"""``CUDA_VISIBLE_DEVICES`` read one way, as CUDA reads it, by the doctor, launch and TaskPool.

One table: each row is a value of the variable on a (faked) 4-GPU machine and the GPUs CUDA
shows for it, as ``CUDA_VISIBLE_DEVICES`` entries in CUDA's order. Each consumer is asked
about the same row: the doctor's check, the launcher's GPU list (which GPUs workers get) and
the TaskPool's pinning of a worker process to its k-th GPU.
"""

from __future__ import annotations

import pytest

from doctor import fakes  # tests/doctor (pytest puts tests/ on sys.path)
from tfscale.devices.visible import parse_visible_devices
from tfscale.doctor import checks
from tfscale.errors import DeviceConfigError
from tfscale.launch.gpus import assign_gpus, visible_gpus
from tfscale.tasks.placement import child_environment

_MACHINE = fakes.four_gpus()
_GPUS = _MACHINE.driver_gpus
# The same four GPUs as `nvidia-smi -L` lists them (the launcher's source).
_SMI = "\n".join(f"GPU {g.index}: NVIDIA H100 80GB HBM3 (UUID: {g.uuid})" for g in _GPUS)
_UUID_2 = _GPUS[2].uuid[:12]  # a unique prefix of GPU 2's UUID

# (CUDA_VISIBLE_DEVICES, the entries CUDA uses; None: unset, every GPU)
_TABLE: list[tuple[str | None, tuple[str, ...] | None]] = [
    (None, None),
    ("", ()),  # set but empty hides every GPU
    ("-1", ()),
    ("abc", ()),  # not an index or UUID: CUDA stops at it
    ("0;1", ()),  # one entry "0;1", not two: CUDA stops at it
    ("1,abc,2", ("1",)),  # stops at the first bad entry
    ("0,7,1", ("0",)),  # GPU 7 does not exist: stops there
    (" 2, 0 ", ("2", "0")),  # CUDA's order, spaces ignored
    (_UUID_2, (_UUID_2,)),  # a UUID prefix
    (f"{_UUID_2},3", (_UUID_2, "3")),
    ("GPU-ffff", ()),  # a UUID no GPU has
    ("1,1", ("1",)),  # a GPU listed twice counts once
]


@pytest.mark.parametrize(("raw", "cuda_shows"), _TABLE)
def test_doctor_launch_and_taskpool_read_cuda_visible_devices_alike(
    raw: str | None, cuda_shows: tuple[str, ...] | None
) -> None:
    env = {} if raw is None else {"CUDA_VISIBLE_DEVICES": raw}
    every = tuple(str(g.index) for g in _GPUS)
    expected = every if cuda_shows is None else cuda_shows

    # The doctor: how many GPUs its check says CUDA shows.
    reading = parse_visible_devices(raw, _GPUS)
    assert reading.ids == cuda_shows
    shown = len(_GPUS) if reading.indices is None else len(reading.indices)
    assert shown == len(expected)
    result = checks.check_cuda_visible_devices(fakes.visible_devices(raw, len(expected)))
    if raw is None or not reading.problems:
        assert result.status == "ok" and (
            raw is None or f"shows {len(expected)} of 4" in result.message
        )
    else:
        assert result.status in ("fail", "warn"), result

    # The launcher: the GPUs its workers are given, one each.
    assert visible_gpus(env, lambda: _SMI) == expected
    assert assign_gpus(expected, 1) == ([",".join(expected)] if expected else [None])

    # The TaskPool: a worker process for this process's k-th GPU sees exactly that GPU.
    for k, gpu in enumerate(expected):
        pinned = child_environment(f"/device:GPU:{k}", env)
        assert pinned["CUDA_VISIBLE_DEVICES"] == gpu
    # A value whose very form hides every GPU: TensorFlow sees none, and asking a worker for
    # one is an error, not GPU 0. (An unknown UUID needs the driver's list to be told: the
    # pool's parent then sees no GPU and never asks for one.)
    if not expected and raw is not None and "GPU-" not in raw:
        with pytest.raises(DeviceConfigError, match="not among the GPUs"):
            child_environment("/device:GPU:0", env)


def test_minus_one_makes_every_launch_worker_a_cpu_worker() -> None:
    # `CUDA_VISIBLE_DEVICES=-1 tfscale launch -n 2` used to fail with "2 workers cannot each
    # have their own GPU: 1 visible"; no GPU is visible, so there is nothing to hand out and
    # the workers inherit -1 (tests/launch/test_jobs.py trains such a job).
    assert assign_gpus(visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, lambda: _SMI), 2) == [
        None,
        None,
    ]


def test_without_driver_tools_entries_are_checked_for_form_only() -> None:
    # No nvidia-smi: an index past the last GPU cannot be told, the rest reads the same.
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,7,abc,1"}, lambda: "") == ("0", "7")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, lambda: "") == ()
    assert visible_gpus({}, lambda: "") == ()
