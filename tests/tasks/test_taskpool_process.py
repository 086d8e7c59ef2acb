"""TaskPool with the process backend: pinned worker processes, crashes and timeouts.

This module imports no TensorFlow at its top: its task functions are pickled by reference,
so each worker process imports this module, and it should start in a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tfscale.errors import TaskError
from tfscale.tasks import TaskPool, current_device
from tfscale.testing import child_pids

pytestmark = [pytest.mark.tf, pytest.mark.multiprocess]


def _where(x: int) -> tuple[int, str | None, str | None, int, bool]:
    return (
        x * x,
        current_device(),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        os.getpid(),
        "tensorflow" in sys.modules,
    )


def _exit_hard() -> None:
    os._exit(3)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _raise(x: int) -> None:
    raise KeyError(f"missing {x}")


def test_crash_kill_raise_and_hang_each_fail_only_their_own_future(
    cpu_devices: list[str],
) -> None:
    devices = cpu_devices[:2]
    before = child_pids()
    with TaskPool(devices, backend="process", timeout=3.0) as pool:
        workers = child_pids() - before
        assert len(workers) == 2
        first = [pool.submit(_where, i) for i in range(10)]
        exited = pool.submit(_exit_hard)
        killed = pool.submit(_kill_self)
        raising = pool.submit(_raise, 7)
        hanging = pool.submit(time.sleep, 60)
        closure = pool.submit(lambda a, b: a + b, 2, 3)  # pickled by value
        later = [pool.submit(_where, i) for i in range(10, 20)]
        results = [f.result(60) for f in first + later]
        assert closure.result(60) == 5
        for future, pattern in [
            (exited, "exited with code 3"),
            (killed, "killed by SIGKILL"),
            (hanging, "timed out after 3 s"),
        ]:
            with pytest.raises(TaskError, match=pattern) as info:
                future.result(60)
            assert f"task {future.index} " in str(info.value)
            assert "on /device:CPU:" in str(info.value)
        with pytest.raises(TaskError, match="KeyError: 'missing 7'") as raised:
            raising.result(60)
        assert isinstance(raised.value.__cause__, KeyError)
        assert "Traceback in the worker" in str(raised.value.__cause__.__cause__)
        stats = pool.stats()
    assert [r[0] for r in results] == [i * i for i in range(20)]
    assert {r[1] for r in results} <= set(devices)
    assert {r[2] for r in results} == {"-1"}  # a CPU-device worker sees no GPU
    assert not any(r[4] for r in results)  # no task needed TensorFlow, none imported it
    assert len({r[3] for r in results}) >= 3  # crashed workers were replaced
    assert stats.failed == 4 and stats.tasks == 21
    assert child_pids() - before == set()  # every worker process has ended


def test_process_map_equals_the_loop(cpu_devices: list[str]) -> None:
    items = list(range(50))
    squares = [x * x for x in items]
    with TaskPool(cpu_devices[:2], backend="process") as pool:
        assert [r[0] for r in pool.map(_where, items, chunksize=5)] == squares
        assert [r[0] for r in pool.map(_where, items)] == squares


def _tensorflow_in_worker(x: float) -> tuple[float, str | None, str, str | None]:
    import tensorflow as tf

    value = tf.constant(x) * 2.0
    return float(value), current_device(), value.device, os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_tensorflow_task_runs_under_the_worker_device(cpu_devices: list[str]) -> None:
    # One worker: TensorFlow starts once in it (several seconds), the first task pays for it.
    with TaskPool([cpu_devices[3]], backend="process") as pool:
        results = [
            f.result(120) for f in [pool.submit(_tensorflow_in_worker, v) for v in (1.0, 2.5)]
        ]
    for (value, device, tensor_device, visible), x in zip(results, (1.0, 2.5), strict=True):
        assert value == 2.0 * x and device == cpu_devices[3] and visible == "-1"
        assert tensor_device.endswith("device:CPU:0")  # the worker's only CPU device


def test_a_tasks_timeout_does_not_count_its_workers_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_devices: list[str]
) -> None:
    """Every worker takes 2 s to start (a sitecustomize on its path sleeps), longer than the
    pool's 1-s timeout: its tasks still run, the first one and the one after a crash, whose
    worker starts again (that start once made a task queued behind a crash time out under
    load). A task that itself runs past the timeout still times out."""
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(2.0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers' PYTHONPATH is this sys.path
    with TaskPool(cpu_devices[:1], backend="process", timeout=1.0) as pool:
        assert pool.submit(_where, 3).result(60)[0] == 9
        crashed = pool.submit(_exit_hard)
        after = pool.submit(_where, 4)
        hanging = pool.submit(time.sleep, 60)
        with pytest.raises(TaskError, match="exited with code 3"):
            crashed.result(60)
        assert after.result(60)[0] == 16
        with pytest.raises(TaskError, match="timed out after 1 s"):
            hanging.result(60)
