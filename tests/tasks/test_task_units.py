"""Pure parts of the task pool: chunk sizes, statistics, placement and child environments."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from tfscale.errors import DeviceConfigError
from tfscale.tasks.chunking import (
    ChunkItemError,
    choose_chunksize,
    probe_budget,
    run_chunk,
    run_probe,
)
from tfscale.tasks.placement import (
    child_environment,
    default_devices,
    local_device,
    normalize,
    resolve_devices,
)
from tfscale.tasks.stats import Interval, plot_timeline, summarize


def test_chunksize_keeps_overhead_under_five_percent_and_every_worker_busy() -> None:
    # 100 us overhead, 1 us of work: 2000 items per chunk keep overhead at 5%.
    assert choose_chunksize(100e-6, 1e-6, 100_000) == 2000
    # Large work (10 s = 100,000 overheads): 5,000 chunks of 2 ms, many per worker.
    assert choose_chunksize(100e-6, 1e-8, 10**9) == 200_000
    # Work much longer than overhead: one item per task.
    assert choose_chunksize(100e-6, 0.01, 1000) == 1
    assert choose_chunksize(100e-6, 0.0, 0) == 1
    assert probe_budget(100e-6) == pytest.approx(2e-3)


def test_chunksize_for_small_total_work_keeps_the_overhead_target() -> None:
    # 1000 items x 10 ns = 10 us of work, under one 100 us hand-off: one chunk, not 16.
    assert choose_chunksize(100e-6, 1e-8, 1000) == 1000
    # 100,000 x 50 ns = 5 ms = 50 overheads: chunks of 2 ms (40,000 items), 3 chunks, fewer
    # than workers (the old rule made 16: 1.6 ms of hand-offs on 5 ms of work).
    assert choose_chunksize(100e-6, 50e-9, 100_000) == 40_000
    # 32 ms = 320 overheads = 4 workers x 4 chunks x 20: 16 chunks of 2 ms.
    assert choose_chunksize(100e-6, 1e-6, 32_000) == 2000
    assert choose_chunksize(100e-6, 1e-6, 1000) == 1000


class _Counter:
    """A task that counts its calls and a clock that reads that count as seconds."""

    def __init__(self) -> None:
        self.calls = 0

    def task(self, x: int) -> int:
        self.calls += 1
        return x * 10

    def clock(self) -> float:
        return float(self.calls)


def test_run_probe_runs_until_its_budget_in_doubling_batches() -> None:
    counter = _Counter()
    # Batches 1, 1, 2: 4 s >= 3 s budget; 6 items left (6 s) would be a whole chunk: stop.
    assert run_probe(counter.task, list(range(10)), False, 3.0, counter.clock) == [
        0,
        10,
        20,
        30,
    ]
    # Only 1 item (1 s) left after the budget: shorter than a budget, so the probe runs it.
    counter = _Counter()
    assert run_probe(counter.task, list(range(5)), False, 3.0, counter.clock) == [
        0,
        10,
        20,
        30,
        40,
    ]
    # A zero budget runs exactly one item; an empty share none; star unpacks.
    assert run_probe(abs, [-1, -2, -3], False, 0.0) == [1]
    assert run_probe(abs, [], False, 1.0) == []
    assert run_probe(lambda a, b: a - b, [(5, 1), (7, 2)], True, 60.0) == [4, 5]
    with pytest.raises(ChunkItemError) as info:
        run_probe(lambda x: 1 / x, [1, 2, 4, 0, 5], False, 60.0)
    assert info.value.offset == 3 and isinstance(info.value.error, ZeroDivisionError)
    assert info.value.done == [1.0, 0.5, 0.25]


def test_run_chunk_in_order_and_names_the_failed_item() -> None:
    assert run_chunk(lambda a, b: a - b, [(5, 1), (7, 2)], star=True) == [4, 5]
    with pytest.raises(ChunkItemError) as info:
        run_chunk(lambda x: 1 / x, [4, 2, 0, 2])
    assert info.value.offset == 2 and isinstance(info.value.error, ZeroDivisionError)
    # The results before it travel with the error, pickled too (the process backend's way).
    assert info.value.done == [0.25, 0.5]
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.offset, again.done, type(again.error)) == (2, [0.25, 0.5], ZeroDivisionError)


def test_summarize_busy_time_counts_makespan_utilisation(tmp_path: Path) -> None:
    intervals = [
        Interval("/device:GPU:0", 0, 0, 10.0, 12.0),
        Interval("/device:GPU:0", 0, 1, 12.0, 14.0, ok=False),
        Interval("/device:GPU:1", 0, 2, 10.0, 11.0),
    ]
    stats = summarize(intervals, ["/device:GPU:0", "/device:GPU:1", "/device:GPU:2"])
    assert stats.makespan_s == 4.0
    gpu0, gpu1, gpu2 = stats.devices
    assert (gpu0.tasks, gpu0.failed, gpu0.busy_s, gpu0.utilisation) == (1, 1, 4.0, 1.0)
    assert (gpu1.tasks, gpu1.busy_s, gpu1.utilisation) == (1, 1.0, 0.25)
    assert (gpu2.tasks, gpu2.busy_s) == (0, 0.0)
    assert stats.tasks == 2 and stats.failed == 1
    assert stats.utilisation == pytest.approx(5.0 / 12.0)
    assert "/device:GPU:2" in stats.table()
    path = tmp_path / "gantt.png"
    plot_timeline(stats, str(path))
    assert path.stat().st_size > 1000


def test_normalize_and_resolve_devices() -> None:
    assert normalize("gpu:1") == "/device:GPU:1"
    assert normalize("/job:localhost/replica:0/task:0/device:CPU:2") == "/device:CPU:2"
    with pytest.raises(DeviceConfigError, match="device name"):
        normalize("cuda0")
    logical = ["/device:CPU:0", "/device:GPU:0", "/device:GPU:1"]
    assert default_devices(logical) == ["/device:GPU:0", "/device:GPU:1"]
    assert default_devices(["/device:CPU:0", "/device:CPU:1"]) == ["/device:CPU:0", "/device:CPU:1"]
    assert resolve_devices(["GPU:1"], logical) == ["/device:GPU:1"]
    with pytest.raises(DeviceConfigError, match="not present: /device:GPU:7"):
        resolve_devices(["GPU:7"], logical)
    with pytest.raises(DeviceConfigError, match="twice"):
        resolve_devices(["GPU:1", "/device:GPU:1"], logical)


def test_child_environment_pins_one_gpu_or_hides_them() -> None:
    parent = {"PATH": "/bin", "TFSCALE_VIRTUAL_DEVICES": "4", "TF_CONFIG": "{}"}
    env = child_environment("/device:GPU:2", parent)
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["PATH"] == "/bin"
    assert "TFSCALE_VIRTUAL_DEVICES" not in env and "TF_CONFIG" not in env
    # The parent's own CUDA_VISIBLE_DEVICES list is honoured: its GPU 1 is physical GPU 6.
    pinned = child_environment("GPU:1", {"CUDA_VISIBLE_DEVICES": "4,6"})
    assert pinned["CUDA_VISIBLE_DEVICES"] == "6"
    assert child_environment("/device:CPU:3", parent)["CUDA_VISIBLE_DEVICES"] == "-1"
    assert local_device("/device:GPU:3") == "/device:GPU:0"
    assert local_device("/device:CPU:3") == "/device:CPU:0"
