"""TaskPool with the process backend: pinned worker processes, crashes and timeouts.

This module imports no TensorFlow at its top: its task functions are pickled by reference,
so each worker process imports this module, and it should start in a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import sys
import time

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
