"""TaskPool with the thread backend on the session's 4 logical CPU devices."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.errors import DeviceConfigError, TaskError
from tfscale.tasks import Node, TaskPool, current_device

pytestmark = pytest.mark.tf


@tf.function
def _layer(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    return tf.nn.relu(tf.matmul(x, w))


def test_map_equals_the_loop_for_a_tensorflow_function_and_uses_every_device(
    cpu_devices: list[str],
) -> None:
    rng = np.random.default_rng(0)
    weights = tf.constant(rng.standard_normal((64, 32)), tf.float32)
    items = [rng.standard_normal((16, 64)).astype(np.float32) for _ in range(32)]
    seen: list[str | None] = []

    def f(x: np.ndarray) -> np.ndarray:
        seen.append(current_device())
        time.sleep(0.005)  # long enough that every worker wakes up for some items
        return _layer(tf.constant(x), weights).numpy()

    expected = [f(x) for x in items]
    assert seen == [None] * len(items)  # outside a pool task there is no device
    seen.clear()
    with tfscale.TaskPool() as pool:
        assert pool.devices == cpu_devices
        results = list(pool.map(f, items))
        stats = pool.stats()
    assert len(results) == len(expected)
    for got, want in zip(results, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert set(seen) == set(cpu_devices)
    assert [d.device for d in stats.devices] == cpu_devices
    assert all(d.tasks > 0 for d in stats.devices), stats.table()
    assert stats.failed == 0 and 0 < stats.utilisation <= 1


def test_tensors_are_placed_on_the_worker_device(cpu_devices: list[str]) -> None:
    def where() -> tuple[str | None, str]:
        time.sleep(0.01)
        return current_device(), tf.constant(1.0).device

    with TaskPool(cpu_devices[1:3]) as pool:
        pairs = [f.result(30) for f in [pool.submit(where) for _ in range(8)]]
    for device, tensor_device in pairs:
        assert device in cpu_devices[1:3]
        assert tensor_device.endswith(device.replace("/device:", "device:"))


def test_balance_pull_scheduling_is_within_ten_percent_of_the_lower_bound() -> None:
    rng = np.random.default_rng(7)
    durations = rng.lognormal(mean=np.log(0.005), sigma=0.8, size=200)
    with TaskPool() as pool:
        # Given as one batch, so longest-first sees every task (see docs/tasks.md).
        nodes = {
            str(i): Node(time.sleep, (float(d),), cost=float(d)) for i, d in enumerate(durations)
        }
        futures = list(pool.submit_graph(nodes).values())
        for future in futures:
            future.result(60)
        stats = pool.stats()
    # The bound is taken on the measured task times (sleep overshoots on a busy machine), so
    # the ratio is the scheduler's: idle gaps and a late long task are what push it up.
    measured = [i.end - i.start for i in stats.timeline]
    lower_bound = max(sum(measured) / 4, max(measured))
    assert stats.tasks == 200
    assert stats.makespan_s <= 1.10 * lower_bound, (stats.makespan_s, lower_bound, stats.table())


def test_a_raising_task_and_a_hanging_task_fail_alone(cpu_devices: list[str]) -> None:
    release = threading.Event()

    def hang() -> str:
        release.wait(30)
        return "late"

    def boom(x: int) -> int:
        raise ValueError(f"bad item {x}")

    try:
        with TaskPool(timeout=1.0) as pool:
            normal = [pool.submit(lambda x: x * x, i) for i in range(20)]
            raising = pool.submit(boom, 3)
            stuck = pool.submit(hang)
            more = [pool.submit(lambda x: -x, i) for i in range(20)]
            assert [f.result(30) for f in normal] == [i * i for i in range(20)]
            assert [f.result(30) for f in more] == [-i for i in range(20)]
            with pytest.raises(TaskError) as raised:
                raising.result(30)
            with pytest.raises(TaskError) as timed_out:
                stuck.result(30)
            # The pool still works after abandoning a worker.
            assert pool.submit(lambda: 5).result(30) == 5
            stats = pool.stats()
    finally:
        release.set()
    message = str(raised.value)
    assert f"task {raising.index} (test_a_raising_task" in message and "boom" in message
    assert "failed on /device:CPU:" in message and "ValueError: bad item 3" in message
    assert isinstance(raised.value.__cause__, ValueError)
    assert f"task {stuck.index}" in str(timed_out.value)
    assert "timed out after 1 s on /device:CPU:" in str(timed_out.value)
    assert stats.failed == 2 and stats.tasks == 41
    deadline = time.monotonic() + 10
    while any(t.name.startswith("tfscale-task") for t in threading.enumerate()):
        if time.monotonic() > deadline:
            pytest.fail("the abandoned worker did not exit within 10 s")
        time.sleep(0.05)


def test_retries_run_a_failed_task_again_on_another_device() -> None:
    failed_on: list[str | None] = []
    lock = threading.Lock()

    def flaky() -> str | None:
        with lock:
            if not failed_on:
                failed_on.append(current_device())
                raise RuntimeError("transient")
        return current_device()

    with TaskPool(retries=1) as pool:
        device = pool.submit(flaky).result(30)
        stats = pool.stats()
    assert device is not None and device != failed_on[0]
    assert (stats.tasks, stats.failed) == (1, 1)

    with TaskPool(retries=2) as pool, pytest.raises(TaskError, match=r"attempt 3 of 3"):
        pool.submit(lambda: 1 / 0).result(30)


def test_diamond_graph_runs_in_order_with_inputs_passed() -> None:
    log: list[str] = []

    def step(name: str, *inputs: Any) -> str:
        log.append(name)
        time.sleep(0.01)
        return f"{name}({','.join(inputs)})"

    with TaskPool() as pool:
        top = pool.submit(step, "a")
        left = pool.submit(step, "b", deps=[top])
        right = pool.submit(step, "c", deps=[top])
        bottom = pool.submit(step, "d", deps=[left, right])
        assert bottom.result(30) == "d(b(a()),c(a()))"
        graph = pool.submit_graph(
            {
                "d": Node(step, ("d",), deps=("b", "c")),
                "b": Node(step, ("b",), deps=("a",)),
                "c": Node(step, ("c",), deps=("a",)),
                "a": Node(step, ("a",)),
            }
        )
        assert graph["d"].result(30) == "d(b(a()),c(a()))"
    for half in (log[:4], log[4:]):
        assert half[0] == "a" and half[3] == "d" and set(half[1:3]) == {"b", "c"}


def test_cycle_is_rejected_and_failed_dependency_never_hangs() -> None:
    with TaskPool() as pool:
        with pytest.raises(TaskError, match="cycle") as info:
            pool.submit_graph(
                {
                    "x": Node(lambda v: v, deps=("y",)),
                    "y": Node(lambda v: v, deps=("x",)),
                    "z": Node(lambda: 1),
                }
            )
        assert "'x'" in str(info.value) and "'y'" in str(info.value)
        broken = pool.submit(lambda: 1 / 0)
        child = pool.submit(lambda v: v, deps=[broken])
        grandchild = pool.submit(lambda v: v, deps=[child])
        with pytest.raises(TaskError, match="did not run: its dependency") as failed:
            grandchild.result(30)
        assert isinstance(failed.value.__cause__, TaskError)
        late = pool.submit(lambda v: v, deps=[broken])
        with pytest.raises(TaskError, match="did not run"):
            late.result(30)


def test_map_chunking_keeps_order_and_names_the_failed_item() -> None:
    items = list(range(1000))
    with TaskPool() as pool:
        for chunksize in ("auto", 1, 7, 1000):
            assert list(pool.map(lambda x: 3 * x + 1, items, chunksize=chunksize)) == [
                3 * x + 1 for x in items
            ]
        assert list(pool.map(lambda a, b: a * b, [1, 2, 3], [4, 5, 6])) == [4, 10, 18]
        assert list(pool.map(abs, [])) == []
        stats = pool.stats()
        # "auto" on tiny items grouped them: far fewer tasks than items.
        assert stats.tasks < 1000 + 1000 + 143 + 1 + 100
        results = pool.map(lambda x: 1 // (x - 500), items, chunksize=64)
        with pytest.raises(TaskError, match=r"map item 500 \(test_map_chunking") as info:
            list(results)
        assert isinstance(info.value.__cause__, ZeroDivisionError)
        with pytest.raises(TaskError, match="chunksize"):
            pool.map(abs, items, chunksize=0)


def _slow_square(x: int) -> int:
    # Items of ~2 ms: longer than a probe's budget, so each worker's probe stops early and
    # the rest of its share goes out in chunks.
    time.sleep(0.002)
    if x == 37:
        raise KeyError(x)
    return x * x


def test_map_auto_probes_then_chunks_in_order_and_names_the_failed_item() -> None:
    with TaskPool() as pool:
        assert list(pool.map(_slow_square, range(37))) == [x * x for x in range(37)]
        assert list(pool.map(lambda a, b: a * b, range(9), range(9))) == [x * x for x in range(9)]
        results = pool.map(_slow_square, range(50))
        assert [next(results) for _ in range(37)] == [x * x for x in range(37)]
        with pytest.raises(TaskError, match=r"map item 37 \(_slow_square\)") as info:
            next(results)
        assert isinstance(info.value.__cause__, KeyError)
        # A failing item inside a probe (item 500 starts the third of four shares).
        failing = pool.map(lambda x: 1 // (x - 500), range(1000))
        with pytest.raises(TaskError, match=r"map item 500 "):
            list(failing)


def test_map_hands_out_a_failed_chunks_items_before_the_failed_one() -> None:
    """Item 7 fails inside the chunk of items 5-9: items 0-6 come out, then the error, as
    Executor.map gives them (the chunk's results before it were lost: the iterator raised at
    item 5)."""

    def square(x: int) -> int:
        if x == 7:
            raise KeyError(x)
        return x * x

    with TaskPool() as pool:
        results = pool.map(square, range(12), chunksize=5)
        assert [next(results) for _ in range(7)] == [x * x for x in range(7)]
        with pytest.raises(TaskError, match=r"map item 7 ") as info:
            next(results)
        assert isinstance(info.value.__cause__, KeyError)


def test_as_completed_shutdown_cancel_and_bad_arguments() -> None:
    gate, started = threading.Event(), threading.Event()

    def blocker() -> bool:
        started.set()
        return gate.wait(30)

    pool = TaskPool(["/device:CPU:0"], progress=True)
    first = pool.submit(blocker)
    queued = [pool.submit(lambda i=i: i) for i in range(5)]
    assert started.wait(30)
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    pool.shutdown(wait=True)
    assert first.result(30) is True
    assert all(f.cancelled() for f in queued)
    with pytest.raises(TaskError, match="shut down"):
        pool.submit(abs, 1)

    with TaskPool() as pool:
        futures = [pool.submit(time.sleep, 0.001 * (5 - i)) for i in range(5)]
        done = list(pool.as_completed(timeout=30))
        assert set(done) == set(futures)
        slow = threading.Event()
        waiting = pool.map(lambda x: slow.wait(30), [1, 2], timeout=0.2, chunksize=1)
        with pytest.raises(concurrent.futures.TimeoutError):
            list(waiting)
        slow.set()

    # Shut down means gone: no worker, watchdog or progress thread is left.
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tfscale-task")]
    with pytest.raises(TaskError, match="backend"):
        TaskPool(backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(TaskError, match="workers_per_device"):
        TaskPool(workers_per_device=0)
    with pytest.raises(TaskError, match="timeout"):
        TaskPool(timeout=-1)
    with pytest.raises(DeviceConfigError, match="not present"):
        TaskPool(["/device:GPU:0"])


def test_workers_per_device_run_concurrently() -> None:
    barrier = threading.Barrier(4, timeout=20)

    def meet() -> str | None:
        barrier.wait()  # only returns if 4 tasks run at once
        return current_device()

    with TaskPool(["/device:CPU:0", "/device:CPU:1"], workers_per_device=2) as pool:
        devices = [f.result(30) for f in [pool.submit(meet) for _ in range(4)]]
        stats = pool.stats()
    assert sorted(devices) == ["/device:CPU:0"] * 2 + ["/device:CPU:1"] * 2  # type: ignore[type-var]
    assert [d.workers for d in stats.devices] == [2, 2]
