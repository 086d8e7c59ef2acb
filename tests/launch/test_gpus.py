"""GPU assignment for local workers (fake nvidia-smi output; no GPU needed)."""

from __future__ import annotations

import json

import pytest

from tfscale.errors import LaunchError
from tfscale.launch.gpus import assign_gpus, visible_gpus
from tfscale.launch.plan import LocalJob, plan_tasks

_SMI_4 = "\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i}abc)" for i in range(4))


@pytest.mark.parametrize(
    ("env", "smi", "expected"),
    [
        ({}, _SMI_4, ("0", "1", "2", "3")),
        ({}, "", ()),
        ({"CUDA_VISIBLE_DEVICES": "3,1"}, _SMI_4, ("3", "1")),
        ({"CUDA_VISIBLE_DEVICES": ""}, _SMI_4, ()),
        ({"CUDA_VISIBLE_DEVICES": "GPU-0abc, GPU-2abc"}, "", ("GPU-0abc", "GPU-2abc")),
    ],
)
def test_visible_gpus(env: dict[str, str], smi: str, expected: tuple[str, ...]) -> None:
    assert visible_gpus(env, lambda: smi) == expected


@pytest.mark.parametrize(
    ("gpus", "workers", "per_worker", "expected"),
    [
        (("0", "1", "2", "3"), 2, None, ["0,1", "2,3"]),
        (("0", "1", "2", "3"), 4, None, ["0", "1", "2", "3"]),
        (("0", "1", "2"), 2, None, ["0", "1"]),  # the odd one stays unused
        (("0", "1", "2", "3"), 2, 1, ["0", "1"]),
        (("0", "1"), 2, 0, ["", ""]),  # CPU workers on a GPU machine
        ((), 3, None, [None, None, None]),  # no GPUs: nothing to decide
        ((), 2, 0, [None, None]),
    ],
)
def test_assign_gpus(
    gpus: tuple[str, ...], workers: int, per_worker: int | None, expected: list[str | None]
) -> None:
    assert assign_gpus(gpus, workers, per_worker) == expected


@pytest.mark.parametrize(
    ("gpus", "workers", "per_worker", "words"),
    [
        (("0",), 2, None, "-n <= 1"),
        (("0", "1", "2"), 2, 2, "2 asked per worker"),
        ((), 2, 1, "none are visible"),
    ],
)
def test_assign_gpus_refuses_sharing(
    gpus: tuple[str, ...], workers: int, per_worker: int | None, words: str
) -> None:
    with pytest.raises(LaunchError, match=words):
        assign_gpus(gpus, workers, per_worker)


def test_plan_gives_each_worker_its_gpus_and_declares_kinds() -> None:
    job = LocalJob(script=("t.py",), workers=2, devices_per_worker=2, python="py")
    tasks = plan_tasks(
        job, [5000, 5001], 1, base_env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, gpus=["0,1", "2,3"]
    )
    assert [t.env["CUDA_VISIBLE_DEVICES"] for t in tasks] == ["0,1", "2,3"]
    assert {t.env["TFSCALE_WORKER_DEVICE_KINDS"] for t in tasks} == {"GPU"}
    assert {t.env["TFSCALE_VIRTUAL_DEVICES"] for t in tasks} == {"2"}
    assert {t.env["TFSCALE_LAUNCH_ATTEMPT"] for t in tasks} == {"1"}
    assert [t.argv for t in tasks] == [("py", "-m", "tfscale.launch.worker", "t.py")] * 2
    assert json.loads(tasks[1].env["TF_CONFIG"]) == {
        "cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:5001"]},
        "task": {"type": "worker", "index": 1},
    }


def test_plan_parameter_server_job_gives_gpus_to_workers_only() -> None:
    job = LocalJob(script=("t.py",), workers=2, ps=1, python="py")
    tasks = plan_tasks(job, [1, 2, 3, 4], 0, base_env={}, gpus=["0", "1"])
    assert [(t.label, t.env["CUDA_VISIBLE_DEVICES"], t.must_finish) for t in tasks] == [
        ("chief 0", "", True),
        ("worker 0", "0", False),
        ("worker 1", "1", False),
        ("ps 0", "", False),
    ]
    assert tasks[1].argv == ("py", "-m", "tfscale.launch.server")
    config = json.loads(tasks[3].env["TF_CONFIG"])
    assert config["cluster"] == {
        "chief": ["127.0.0.1:1"],
        "worker": ["127.0.0.1:2", "127.0.0.1:3"],
        "ps": ["127.0.0.1:4"],
    }
    assert config["task"] == {"type": "ps", "index": 0}


def test_plan_on_a_machine_without_gpus_declares_cpu_workers() -> None:
    job = LocalJob(script=("t.py",), workers=2, python="py")
    tasks = plan_tasks(job, [1, 2], 0, base_env={"TF_CONFIG": "stale"}, gpus=[None, None])
    assert all("CUDA_VISIBLE_DEVICES" not in t.env for t in tasks)
    assert {t.env["TFSCALE_WORKER_DEVICE_KINDS"] for t in tasks} == {"CPU"}
    assert "stale" not in {t.env["TF_CONFIG"] for t in tasks}
