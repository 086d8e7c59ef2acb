"""Elastic jobs that train: ``tfscale launch -n 3 --min-workers 2 --max-restarts 1`` whose
worker 2 is SIGKILLed in epoch 2 on every start with 3 workers ends on 2 workers with the
weights of the uninterrupted run, for shuffled arrays, a tf.data pipeline and a dataset_fn
(tests/launch/data/elastic_train.py), and for a custom training loop with
tfscale.prepare_loop and tf.train.CheckpointManager (tests/launch/data/elastic_loop.py).

The jobs start together in one module fixture (as test_jobs.py's): one elastic job per input
and the custom loop's, each 2 starts of 3 workers (a single restart before the drop), then 2
workers. ``make test`` runs the arrays job; the others are ``full`` (``make test-full``,
tests/README.md), and the fixture starts only the jobs of the tests the session runs. While
they run, the fixture trains the uninterrupted references in the test process: the scripts'
own ``train`` under MirroredStrategy over 3 logical CPUs, which reads the same global batches
as 3 workers (the 3-worker job gave these weights within 1.1e-6, and 3 worker processes more
would cost 3 TensorFlow start-ups for each script).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tfscale.testing import groups_alive, mirrored_on_cpus, relative_difference

from .selected import selected_param, selected_tests

# One worker runs this module (make test: --dist loadgroup), so its module fixture runs once.
pytestmark = [
    pytest.mark.tf,
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.xdist_group("launch-elastic-jobs"),
]

_ROOT = Path(__file__).resolve().parents[2]
_DATA = Path(__file__).parent / "data"
_SCRIPT = str(_DATA / "elastic_train.py")
_LOOP = str(_DATA / "elastic_loop.py")
_KINDS = ("arrays", "tfdata", "dataset_fn")
_TIMEOUT = 900.0
# 10 updates per epoch (480 examples, global batch 48), checkpoints every 4 updates and at
# epoch ends: worker 2 dies at update 26 (epoch 2), every 3-worker attempt resumes from 24
# (epoch 2, batch 4), and so does the 2-worker attempt: mid-epoch, at the exact batch.
_KILL_AFTER, _RESUMED_AT = 26, 24
# Every job restarts once (--max-restarts 1: 2 starts of 3 workers, both resuming, before the
# drop). Each start is 3 TensorFlow processes: the suite's time is their start-up, hence one
# job in `make test` and the rest in `make test-full` (tests/README.md).
_RESTARTS = 1
_EQUIVALENT = (
    "tests/launch/test_elastic_jobs.py::"
    "test_job_losing_worker_2_finishes_on_2_with_the_uninterrupted_weights[arrays]"
)


@dataclass
class _Job:
    folder: Path
    process: subprocess.Popen[str]
    stdout: str = ""
    stderr: str = ""

    def weights(self, name: str) -> list[np.ndarray]:
        with np.load(self.folder / name) as data:
            return [data[f"arr_{i}"] for i in range(len(data.files))]

    @property
    def pids(self) -> list[int]:
        """Every task the supervisor reported starting (its pid is its process group)."""
        return [int(p) for p in re.findall(r"\(pid (\d+)\)", self.stderr)]

    def records(self) -> dict[str, dict[str, int]]:
        return {p.stem: json.loads(p.read_text()) for p in self.folder.glob("worker*.json")}


def _start(folder: Path, args: list[str]) -> _Job:
    folder.mkdir()
    env = dict(os.environ, PYTHONPATH=str(_ROOT / "src"))
    for name in ("TF_CONFIG", "TFSCALE_VIRTUAL_DEVICES", "TF_CPP_MIN_LOG_LEVEL"):
        env.pop(name, None)
    command = [sys.executable, "-m", "tfscale.cli.main", "launch", "--timeout", "850"]
    process = subprocess.Popen(
        [*command, "--grace", "2", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return _Job(folder, process)


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, _DATA / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class _Run:
    jobs: dict[str, _Job]
    # The uninterrupted run's weights, per input kind and for "loop".
    references: dict[str, list[np.ndarray]]


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Run]:
    root = tmp_path_factory.mktemp("elastic")
    kinds = [kind for kind in _KINDS if kind in selected_param(request, "kind")]
    loop = any(item.originalname == _LOOP_TEST for item in selected_tests(request))
    started = {}
    for kind in kinds:
        folder = root / kind
        started[kind] = _start(
            folder,
            ["-n", "3", "--min-workers", "2", "--max-restarts", str(_RESTARTS), _SCRIPT,
             "--data", kind, "--out", str(folder / "w"), "--checkpoint-dir", str(folder / "ck"),
             "--kill-after", str(_KILL_AFTER), "--record", str(folder)],
        )  # fmt: skip
    if loop:
        # The custom loop: checkpoints every 4 steps, worker 2 dies after step 26 (epoch 2/4).
        folder = root / "loop"
        started["loop"] = _start(
            folder,
            ["-n", "3", "--min-workers", "2", "--max-restarts", str(_RESTARTS), _LOOP,
             "--out", str(folder / "w.npz"), "--checkpoint-dir", str(folder / "ck"),
             "--kill-after", str(_KILL_AFTER), "--record", str(folder)],
        )  # fmt: skip
    deadline = time.time() + _TIMEOUT
    try:
        mirrored = mirrored_on_cpus(3)
        train = _load("elastic_train")
        references = {kind: train.train(mirrored, kind) for kind in kinds}
        if loop:
            references["loop"] = _load("elastic_loop").train(mirrored)[1]
        for job in started.values():
            try:
                remaining = max(1.0, deadline - time.time())
                job.stdout, job.stderr = job.process.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                os.killpg(job.process.pid, 9)  # the launcher; its tasks die with it
                job.stdout, job.stderr = job.process.communicate()
    finally:
        for job in started.values():
            if job.process.poll() is None:
                os.killpg(job.process.pid, 9)
                job.process.communicate()
    yield _Run(started, references)


def _check_dropped_worker_2(job: _Job, restarts: int) -> None:
    """``job`` exited 0, lost worker 2 on ``restarts + 1`` starts, resumed, finished on 2:
    every start's task pids were reported and none is left."""
    assert job.process.returncode == 0, job.stderr[-3000:]
    starts = restarts + 1
    said = "1 start" if starts == 1 else f"{starts} starts in a row"
    assert job.stderr.strip().splitlines()[-1] == (
        "[tfscale launch] finished on 2 of 3 workers: dropped worker 2 "
        f"(killed by SIGKILL on {said})"
    )
    records = job.records()
    assert sorted(records) == sorted(
        [f"worker{w}-{a}" for w in (0, 1) for a in range(starts + 1)]
        + [f"worker2-{a}" for a in range(starts)]
    )
    assert [records[f"worker0-{a}"]["workers"] for a in range(starts + 1)] == [3] * starts + [2]
    assert [records[f"worker1-{a}"]["start_step"] for a in range(starts + 1)] == [0] + [
        _RESUMED_AT
    ] * starts
    assert len(job.pids) == 3 * starts + 2 and groups_alive(job.pids) == []


@pytest.mark.parametrize(
    "kind",
    [
        kind if kind == "arrays" else pytest.param(kind, marks=pytest.mark.full(_EQUIVALENT))
        for kind in _KINDS
    ],
)
def test_job_losing_worker_2_finishes_on_2_with_the_uninterrupted_weights(
    run: _Run, kind: str
) -> None:
    job = run.jobs[kind]
    _check_dropped_worker_2(job, _RESTARTS)
    assert f"[worker 0] {kind} on 2 workers: done" in job.stdout
    difference = relative_difference(job.weights(f"w-{kind}.npz"), run.references[kind])
    print(f"{kind}: relative difference to the uninterrupted run {difference:.2e}")
    assert difference <= 1e-5, difference


_LOOP_TEST = "test_custom_loop_losing_worker_2_finishes_on_2_with_the_uninterrupted_weights"


@pytest.mark.full(_EQUIVALENT)
def test_custom_loop_losing_worker_2_finishes_on_2_with_the_uninterrupted_weights(
    run: _Run,
) -> None:
    """tfscale.prepare_loop, CheckpointManager every 4 steps, resume by skipping batches."""
    job = run.jobs["loop"]
    _check_dropped_worker_2(job, _RESTARTS)
    assert f"[worker 0] loop on 2 workers from step {_RESUMED_AT}: done" in job.stdout
    difference = relative_difference(job.weights("w.npz"), run.references["loop"])
    print(f"custom loop: relative difference to the uninterrupted run {difference:.2e}")
    assert difference <= 1e-5, difference
