"""Real multi-process jobs with TensorFlow: MultiWorkerMirrored, a SIGKILLed worker, Keras model.fit
under MultiWorkerMirrored (seed 001), a PS cluster.

The jobs start together in one module fixture (TensorFlow start-up dominates, and the
jobs wait on each other's gRPC most of the time); each test then checks one of them. ``make
test`` runs two jobs: seed 001 with its one added line, and seed 001 unchanged (each seed
script fails the same way, so one stands for the others). The other jobs are ``full``
(``make test-full``, tests/README.md), each naming the ``make test`` test that takes its path,
and the fixture starts only the jobs of the tests the session runs.
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

from tfscale.runtime.chatter import is_chatter
from tfscale.testing import groups_alive, mirrored_on_cpus, relative_difference

from .selected import selected_param, selected_tests

# One worker runs this module (make test: --dist loadgroup), so its module fixture runs once.
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.tf,
    pytest.mark.slow,
    pytest.mark.xdist_group("launch-jobs"),
]

_ROOT = Path(__file__).resolve().parents[2]
_DATA = Path(__file__).parent / "data"
_TIMEOUT = 420.0
# Scripts a user brings unchanged (the seeds', and one written for one machine), and what
# the job's last line must say for each.
_SEEDS = {
    "seed000_mirrored": "its script built MirroredStrategy over this worker's devices only",
    "seed001_keras_fit": "Keras's model.fit fails under MultiWorkerMirroredStrategy",
    "seed003_op_first": "Collective ops must be configured at program startup",
    "fit_alone": "model.fit ran under no distribution strategy",
}
# The seed `make test` runs: each script fails the same way (its workers run once, the job
# stops at the first failure and names it), so one stands for the others there.
_SEED_IN_TEST = "seed001_keras_fit"
_SEED_EQUIVALENT = (
    "tests/launch/test_jobs.py::"
    f"test_unchanged_seed_scripts_never_exit_0_and_the_last_line_says_why[{_SEED_IN_TEST}]"
)


@dataclass
class _Job:
    name: str
    process: subprocess.Popen[str]
    out_dir: Path
    stdout: str = ""
    stderr: str = ""

    @property
    def pids(self) -> list[int]:
        """Every task pid the supervisor reported starting (= their process groups)."""
        return [int(p) for p in re.findall(r"\(pid (\d+)\)", self.stderr)]


def _start(name: str, args: list[str], out_dir: Path, **extra_env: str) -> _Job:
    env = dict(os.environ, PYTHONPATH=str(_ROOT / "src"), **extra_env)
    # As for a user (TensorFlow's defaults): the workers' chatter, oneDNN's notice included,
    # is dropped.
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    env.pop("TF_CONFIG", None)
    env.pop("TFSCALE_VIRTUAL_DEVICES", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "tfscale.cli.main", "launch", "--timeout", "400", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return _Job(name, process, out_dir)


def _finish(job: _Job, deadline: float) -> None:
    try:
        job.stdout, job.stderr = job.process.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(job.process.pid, 9)  # the launcher; its tasks die with it (process layer)
        job.process.communicate()
        raise


# The `make test` tests that take the other jobs' paths (#41): a launched job of 2 workers
# (the seed's, with its line added; tfscale.fit's 2 workers are the parity suite's 2-worker
# group's, launched they are the elastic job's), a SIGKILLed worker's restart from the
# checkpoint (the elastic job's, which restarts once before it drops the worker), a
# ParameterServer cluster's updates (test_coordinator_train_step's in-process cluster).
_KERAS_JOB = (
    "tests/launch/test_jobs.py::test_keras_model_fit_under_multi_worker_trains_with_one_added_line"
)
_ELASTIC_JOB = (
    "tests/launch/test_elastic_jobs.py::"
    "test_job_losing_worker_2_finishes_on_2_with_the_uninterrupted_weights[arrays]"
)
_WORKERS = (
    "tests/training/test_parity_examples.py::"
    "test_cases_across_two_worker_processes_match_one_device[paths_across_workers]"
)
_PS_CLUSTER = (
    "tests/training/test_coordinator_train_step.py::test_two_workers_metrics_count_every_step"
)

# The jobs each test reads (the restarted job's weights are checked against the plain one's).
_NEEDS = {
    "test_two_workers_equal_mirrored_over_two_logical_cpus": ("plain",),
    "test_sigkilled_worker_stops_the_other_restarts_and_resumes": ("crash", "plain"),
    "test_keras_model_fit_under_multi_worker_trains_with_one_added_line": ("keras",),
    "test_parameter_server_cluster_trains_to_a_lower_loss": ("ps",),
}


def _arguments(name: str, root: Path) -> list[str]:
    """The launch arguments of job ``name``, writing into ``root / name``."""
    folder, script = root / name, str(_DATA / "mwms_train.py")
    trained = [script, "--out", str(folder / "w.npz"), "--epochs", "4"]
    trained += ["--checkpoint-dir", str(folder / "ck"), "--record", str(folder)]
    if name == "plain":
        return ["-n", "2", *trained]
    if name == "crash":
        return [
            "-n",
            "2",
            "--max-restarts",
            "1",
            "--grace",
            "2",
            *trained,
            "--crash-once-at",
            "1:5",
        ]
    if name == "keras":
        return ["-n", "2", str(_DATA / "keras_fit_train.py"), "--out", str(folder / "w.npz")]
    if name == "ps":
        return ["--ps", "1", "-n", "2", str(_DATA / "ps_train.py"), str(folder / "result.json")]
    # An unchanged script: it must fail, saying why.
    return ["-n", "2", "--max-restarts", "2", str(_DATA / f"{name}.py")]


@pytest.fixture(scope="module")
def jobs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, _Job]]:
    """The jobs of the tests this session runs, started together."""
    root = tmp_path_factory.mktemp("jobs")
    names = {name for item in selected_tests(request) for name in _NEEDS.get(item.originalname, ())}
    names |= selected_param(request, "seed")
    started: dict[str, _Job] = {}
    for name in sorted(names):
        (root / name).mkdir()
        # CUDA reads -1 as "no GPU": the launcher must train on CPUs, not refuse ("2 workers
        # cannot each have their own GPU: 1 visible", as it did when it split on commas).
        env = {"CUDA_VISIBLE_DEVICES": "-1"} if name in ("plain", "keras") else {}
        started[name] = _start(name, _arguments(name, root), root / name, **env)
    deadline = time.time() + _TIMEOUT
    try:
        for job in started.values():
            _finish(job, deadline)
    finally:
        for job in started.values():
            if job.process.poll() is None:
                os.killpg(job.process.pid, 9)
                job.process.communicate()
    yield started


def _weights(path: Path) -> list[np.ndarray]:
    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


def _chatter(job: _Job) -> list[str]:
    """The job's lines of TensorFlow's start-up chatter, oneDNN's notice included: a user's
    job (TensorFlow's defaults, as ``_start`` runs it) shows none."""
    lines = (job.stdout + job.stderr).splitlines()
    return [line for line in lines if is_chatter(line) or "oneDNN" in line]


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mwms_train", _DATA / "mwms_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.full(_WORKERS, _KERAS_JOB)
def test_two_workers_equal_mirrored_over_two_logical_cpus(
    jobs: dict[str, _Job], tmp_path: Path
) -> None:
    job = jobs["plain"]
    assert job.process.returncode == 0, job.stderr[-3000:]
    assert "[worker 0] MultiWorkerMirrored with 2 replicas: done" in job.stdout
    assert _chatter(job) == []
    assert "[worker 1] MultiWorkerMirrored with 2 replicas: done" in job.stdout
    mirrored = mirrored_on_cpus(2)
    # With a checkpoint folder as the job has: the same per-epoch order of the shuffled arrays.
    _, reference = _load_script().train(mirrored, epochs=4, checkpoint_dir=str(tmp_path / "ck"))
    difference = relative_difference(_weights(job.out_dir / "w.npz"), reference)
    assert difference <= 1e-5, difference
    # Run with CUDA_VISIBLE_DEVICES=-1, which CUDA reads as "no GPU": trained on CPUs.
    records = [json.loads(p.read_text()) for p in job.out_dir.glob("worker*-0.json")]
    assert [r["cuda_visible_devices"] for r in records] == ["-1", "-1"]
    assert groups_alive(job.pids) == []


@pytest.mark.full(_ELASTIC_JOB)
def test_sigkilled_worker_stops_the_other_restarts_and_resumes(jobs: dict[str, _Job]) -> None:
    job = jobs["crash"]
    assert job.process.returncode == 0, job.stderr[-3000:]
    assert "worker 1 was killed by SIGKILL; stopping the 1 other task(s)" in job.stderr
    assert "restarting the job (restart 1 of 1)" in job.stderr
    records = {p.stem: json.loads(p.read_text()) for p in job.out_dir.glob("worker*-*.json")}
    assert sorted(records) == ["worker0-0", "worker0-1", "worker1-0", "worker1-1"]
    # 12 updates per epoch; killed after update 18 (epoch 2, batch 6); checkpoints every
    # 5 updates and at epoch ends: 12, 17 -> the restarted job starts at update 17.
    assert records["worker0-0"]["start_step"] == 0
    assert records["worker0-1"]["start_step"] == records["worker1-1"]["start_step"] == 17
    uninterrupted = _weights(jobs["plain"].out_dir / "w.npz")
    difference = relative_difference(_weights(job.out_dir / "w.npz"), uninterrupted)
    assert difference <= 1e-6, difference
    pids = job.pids  # the process groups the launcher reports (each task's guard's pid)
    assert len(pids) == 4 and {r["pgid"] for r in records.values()} == set(pids)
    assert groups_alive(pids) == []


def test_keras_model_fit_under_multi_worker_trains_with_one_added_line(
    jobs: dict[str, _Job],
) -> None:
    """Seed 001: model.fit under MultiWorkerMirroredStrategy, plus tfscale.prepare(model)."""
    import tensorflow as tf

    job = jobs["keras"]
    # Run with CUDA_VISIBLE_DEVICES=-1 (the fixture): trained on CPUs, not refused.
    assert job.process.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("model.fit over 2 replicas: done") == 2
    assert _chatter(job) == []
    script = _load_script()
    spec = importlib.util.spec_from_file_location("keras_fit", _DATA / "keras_fit_train.py")
    assert spec is not None and spec.loader is not None
    keras_fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(keras_fit)
    with tf.device("/device:CPU:0"):  # one device, the same global batches
        reference = script.build_model()
        reference.fit(keras_fit.dataset(), epochs=2, verbose=0)
    difference = relative_difference(_weights(job.out_dir / "w.npz"), reference.get_weights())
    assert difference <= 1e-5, difference
    assert groups_alive(job.pids) == []


@pytest.mark.full(_PS_CLUSTER)
def test_parameter_server_cluster_trains_to_a_lower_loss(jobs: dict[str, _Job]) -> None:
    job = jobs["ps"]
    assert job.process.returncode == 0, job.stderr[-3000:]
    result = json.loads((job.out_dir / "result.json").read_text())
    assert result["kind"] == "ParameterServer"
    assert result["after"] < 0.5 * result["before"], result
    assert result["loss"][-1] < result["loss"][0], result
    assert "does not support: accumulation_steps, global_clipnorm" in result["refused"]
    for label in ("worker 0", "worker 1", "ps 0"):
        assert f"[{label}] serving {label}" in job.stdout
    assert len(job.pids) == 4 and groups_alive(job.pids) == []


@pytest.mark.parametrize(
    "seed",
    [
        seed
        if seed == _SEED_IN_TEST
        else pytest.param(seed, marks=pytest.mark.full(_SEED_EQUIVALENT))
        for seed in sorted(_SEEDS)
    ],
)
def test_unchanged_seed_scripts_never_exit_0_and_the_last_line_says_why(
    jobs: dict[str, _Job], seed: str
) -> None:
    job = jobs[seed]
    assert job.process.returncode == 78, job.stderr[-3000:]
    last = job.stderr.strip().splitlines()[-1]
    assert "did not train with the others" in last and _SEEDS[seed] in last, last
    assert "Fix:" in last
    if seed == "seed001_keras_fit":
        assert "tfscale.prepare(model)" in last
    assert "Traceback" not in job.stdout + job.stderr
    assert "restarting the job" not in job.stderr  # the same script would do the same again
    assert groups_alive(job.pids) == []
