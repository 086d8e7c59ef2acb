"""Elastic jobs that train: ``tfscale launch -n 3 --min-workers 2 --max-restarts 1`` whose
worker 2 is SIGKILLed in epoch 2 on every start with 3 workers ends on 2 workers with the
weights of the uninterrupted 3-worker run, for shuffled arrays, a tf.data pipeline and a
dataset_fn (tests/launch/data/elastic_train.py), and for a custom training loop with
tfscale.prepare_loop and tf.train.CheckpointManager (tests/launch/data/elastic_loop.py).

The jobs start together in one module fixture (as test_jobs.py's): the uninterrupted
reference (the three inputs one after the other in one 3-worker job), one elastic job
per input (for arrays 2 attempts of 3 workers, for the others 1, then 2 workers), and
the custom loop's uninterrupted reference and elastic job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tfscale.testing import groups_alive, relative_difference

# One worker runs this module (make test: --dist loadgroup), so its module fixture runs once.
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.xdist_group("launch-elastic-jobs"),
]

_ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = str(Path(__file__).parent / "data" / "elastic_train.py")
_LOOP = str(Path(__file__).parent / "data" / "elastic_loop.py")
_KINDS = ("arrays", "tfdata", "dataset_fn")
_TIMEOUT = 900.0
# 10 updates per epoch (480 examples, global batch 48), checkpoints every 4 updates and at
# epoch ends: worker 2 dies at update 26 (epoch 2), every 3-worker attempt resumes from 24
# (epoch 2, batch 4), and so does the 2-worker attempt: mid-epoch, at the exact batch.
_KILL_AFTER, _RESUMED_AT = 26, 24
# Arrays restart once (--max-restarts 1: 2 starts of 3 workers, both resuming, before the
# drop); the other inputs and the custom loop test the resume on 2 workers, which does not
# depend on how many starts came before, with the drop at the first failure (0). Each start
# is 3 TensorFlow processes: the suite's time is their start-up (tests/README.md).
_RESTARTS = {"arrays": 1, "tfdata": 0, "dataset_fn": 0, "loop": 0}


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


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Job]]:
    root = tmp_path_factory.mktemp("elastic")
    started = {
        "reference": _start(
            root / "reference",
            ["-n", "3", _SCRIPT, "--data", ",".join(_KINDS), "--out", str(root / "reference/w")],
        )
    }
    for kind in _KINDS:
        folder = root / kind
        started[kind] = _start(
            folder,
            ["-n", "3", "--min-workers", "2", "--max-restarts", str(_RESTARTS[kind]), _SCRIPT,
             "--data", kind, "--out", str(folder / "w"), "--checkpoint-dir", str(folder / "ck"),
             "--kill-after", str(_KILL_AFTER), "--record", str(folder)],
        )  # fmt: skip
    # The custom loop: checkpoints every 4 steps, worker 2 dies after step 26 (epoch 2 of 4).
    started["loop_reference"] = _start(
        root / "loop_reference", ["-n", "3", _LOOP, "--out", str(root / "loop_reference/w.npz")]
    )
    folder = root / "loop"
    started["loop"] = _start(
        folder,
        ["-n", "3", "--min-workers", "2", "--max-restarts", str(_RESTARTS["loop"]), _LOOP,
         "--out", str(folder / "w.npz"), "--checkpoint-dir", str(folder / "ck"),
         "--kill-after", str(_KILL_AFTER), "--record", str(folder)],
    )  # fmt: skip
    deadline = time.time() + _TIMEOUT
    try:
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
    yield started


def _check_dropped_worker_2(reference: _Job, job: _Job, restarts: int) -> None:
    """Both jobs exited 0; ``job`` lost worker 2 on ``restarts + 1`` starts, resumed, finished
    on 2: every start's task pids were reported and none is left."""
    assert reference.process.returncode == 0, reference.stderr[-3000:]
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


@pytest.mark.parametrize("kind", _KINDS)
def test_job_losing_worker_2_finishes_on_2_with_the_uninterrupted_weights(
    jobs: dict[str, _Job], kind: str
) -> None:
    reference, job = jobs["reference"], jobs[kind]
    _check_dropped_worker_2(reference, job, _RESTARTS[kind])
    assert f"[worker 0] {kind} on 2 workers: done" in job.stdout
    difference = relative_difference(
        job.weights(f"w-{kind}.npz"), reference.weights(f"w-{kind}.npz")
    )
    print(f"{kind}: relative difference to the uninterrupted 3-worker run {difference:.2e}")
    assert difference <= 1e-5, difference


def test_custom_loop_losing_worker_2_finishes_on_2_with_the_uninterrupted_weights(
    jobs: dict[str, _Job],
) -> None:
    """tfscale.prepare_loop, CheckpointManager every 4 steps, resume by skipping batches."""
    reference, job = jobs["loop_reference"], jobs["loop"]
    _check_dropped_worker_2(reference, job, _RESTARTS["loop"])
    assert f"[worker 0] loop on 2 workers from step {_RESUMED_AT}: done" in job.stdout
    difference = relative_difference(job.weights("w.npz"), reference.weights("w.npz"))
    print(f"custom loop: relative difference to the uninterrupted 3-worker run {difference:.2e}")
    assert difference <= 1e-5, difference
