"""``tfscale launch --slurm`` on a real one-node Slurm cluster (``slurm_cluster.py``).

As a user runs it: ``srun -n 2 tfscale launch --slurm train.py`` and ``sbatch`` of the
script ``tfscale launch --slurm --print-sbatch`` prints, with only the options one node
needs (``--nodes 1 --tasks-per-node 2``, a free ``--port``). The jobs start together in one
module fixture (TensorFlow's start-up dominates; Slurm shares the node's CPUs between them)
and each test checks one. What one node cannot show (several nodes, GPUs per node) stays in
the fakes of ``test_slurm.py``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from tfscale.processes import DEVNULL, Child, run, start
from tfscale.testing import relative_difference

from .slurm_cluster import SlurmCluster, free_port_bases, tfscale_bin

# One worker runs this module (make test: --dist loadgroup), so its module fixture runs once.
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.xdist_group("slurm-cluster"),
]

_SRC = str(Path(__file__).resolve().parents[2] / "src")
_DATA = Path(__file__).parent / "data"
_TRAIN = str(_DATA / "slurm_train.py")
_TIMEOUT_S = 420.0
# Rank 1 fails with status 3 at once; rank 0 would sleep: srun --kill-on-bad-exit stops it.
_FAILING = (
    "import os, sys, time\n"
    "if os.environ['SLURM_PROCID'] == '1':\n"
    "    print('task 1 fails', flush=True)\n"
    "    sys.exit(3)\n"
    "time.sleep(300)\n"
)


@dataclass
class _Job:
    """One job of the fixture: its folder, how it ended and what it wrote."""

    name: str
    folder: Path
    port: int = 0
    sbatch: str = ""
    job_id: int = 0
    fields: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    output: str = ""
    stderr: str = ""

    def records(self) -> dict[str, dict[str, object]]:
        """The tasks' ``task{rank}-{attempt}.json``, by file stem."""
        return {p.stem: json.loads(p.read_text()) for p in sorted(self.folder.glob("task*.json"))}

    def weights(self, rank: int) -> list[np.ndarray]:
        with np.load(self.folder / f"task{rank}.npz") as data:
            return [data[f"arr_{i}"] for i in range(len(data.files))]


def _train_args(job: _Job) -> list[str]:
    return [_TRAIN, str(job.folder), "--epochs", "2", "--checkpoint-dir", str(job.folder / "ck")]


def _srun(cluster: SlurmCluster, job: _Job, env: dict[str, str], *command: str) -> Child:
    out = open(job.folder / "srun.out", "wb")  # noqa: SIM115 (closed once started)
    err = open(job.folder / "srun.err", "wb")  # noqa: SIM115
    with out, err:
        return start(
            ["srun", "-n", "2", "--kill-on-bad-exit=1", *command],
            env=cluster.env | env,
            cwd=job.folder,
            stdin=DEVNULL,
            stdout=out,
            stderr=err,
        )


def _sbatch(cluster: SlurmCluster, job: _Job, env: dict[str, str], *options: str) -> None:
    printed = run(
        ["tfscale", "launch", "--slurm", "--print-sbatch", *options],
        timeout=60,
        env=cluster.env | env,
        cwd=job.folder,
    )
    assert printed.returncode == 0, printed.stderr
    job.sbatch = printed.stdout
    script = job.folder / "job.sbatch"
    script.write_text(printed.stdout)  # submitted as printed
    job.job_id = cluster.submit(script, env=env, cwd=job.folder)


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster) -> Iterator[dict[str, _Job]]:
    cluster = slurm_cluster
    root = cluster.root / "jobs"
    names = ("srun", "sbatch", "restart", "failing", "seed000", "seed000-sbatch")
    ports = free_port_bases(len(names), 2)
    made = {}
    for name, port in zip(names, ports, strict=True):
        (root / name).mkdir(parents=True)
        made[name] = _Job(name, root / name, port)
    # The tasks run this checkout's tfscale with this interpreter: `tfscale` on PATH (the
    # sbatch script calls it), the sources on PYTHONPATH (srun and sbatch export the
    # environment).
    bin_dir = tfscale_bin(cluster.root / "bin")
    env = {"PYTHONPATH": _SRC, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    single_node = ["--nodes", "1", "--tasks-per-node", "2", "--time", "00:10:00"]
    sbatch, restart = made["sbatch"], made["restart"]
    _sbatch(
        cluster,
        sbatch,
        env,
        *single_node,
        "--port",
        str(sbatch.port),
        "--name",
        "plain",
        *_train_args(sbatch),
    )
    _sbatch(
        cluster,
        restart,
        env,
        *single_node,
        "--port",
        str(restart.port),
        "--name",
        "restart",
        "--max-restarts",
        "1",
        *_train_args(restart),
        "--crash-once-at",
        "1:5",
    )
    alone = made["seed000-sbatch"]
    _sbatch(
        cluster,
        alone,
        env,
        *single_node,
        "--port",
        str(alone.port),
        "--name",
        "alone",
        "--max-restarts",
        "1",
        str(_DATA / "seed000_mirrored.py"),
    )
    failing_script = made["failing"].folder / "failing.py"
    failing_script.write_text(_FAILING)
    launch = ["tfscale", "launch", "--slurm", "--port"]
    sruns = {
        "srun": [*launch, str(made["srun"].port), *_train_args(made["srun"])],
        "failing": [*launch, str(made["failing"].port), str(failing_script)],
        "seed000": [*launch, str(made["seed000"].port), str(_DATA / "seed000_mirrored.py")],
    }
    children = {name: _srun(cluster, made[name], env, *argv) for name, argv in sruns.items()}
    deadline = time.monotonic() + _TIMEOUT_S
    try:
        for name, child in children.items():
            job = made[name]
            job.returncode = child.wait(max(1.0, deadline - time.monotonic()))
            job.output = (job.folder / "srun.out").read_text(errors="replace")
            job.stderr = (job.folder / "srun.err").read_text(errors="replace")
        for job in (sbatch, restart, alone):
            job.fields = cluster.wait_job(job.job_id, max(1.0, deadline - time.monotonic()))
            out = job.folder / f"{job.fields.get('JobName')}-{job.job_id}.out"
            job.output = out.read_text(errors="replace") if out.exists() else ""
    finally:
        for child in children.values():
            child.stop(5.0)
            child.close()
    yield made


def _assert_one_job_of_two(job: _Job, attempt: str, node: str) -> None:
    """Both tasks trained in one MultiWorkerMirrored job of 2 workers with their own ranks."""
    records = job.records()
    tasks = [records[f"task{rank}-{attempt}"] for rank in (0, 1)]
    for rank, record in enumerate(tasks):
        assert record["kind"] == "MultiWorkerMirrored", record
        assert record["replicas"] == 2 and record["workers"] == 2, record
        assert record["task_index"] == rank, record
        assert record["cluster"] == {"worker": [f"{node}:{job.port}", f"{node}:{job.port + 1}"]}
    assert tasks[0]["job_id"] == tasks[1]["job_id"] is not None
    assert tasks[0]["step_id"] == tasks[1]["step_id"] is not None
    assert tasks[0]["pid"] != tasks[1]["pid"]


def _assert_identical_weights(job: _Job) -> None:
    first, second = job.weights(0), job.weights(1)
    assert len(first) == len(second) == 4
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def _assert_nothing_left(cluster: SlurmCluster, job: _Job) -> None:
    deadline = time.monotonic() + 15.0
    while cluster.processes(job.folder) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.processes(job.folder) == []


def test_srun_two_tasks_train_one_multi_worker_job(
    jobs: dict[str, _Job], slurm_cluster: SlurmCluster
) -> None:
    job = jobs["srun"]
    assert job.returncode == 0, job.stderr[-3000:]
    for rank in (0, 1):
        assert f"task {rank}: MultiWorkerMirrored with 2 replicas: done" in job.output
    _assert_one_job_of_two(job, "0", slurm_cluster.node)
    _assert_identical_weights(job)
    _assert_nothing_left(slurm_cluster, job)


def test_sbatch_of_the_printed_script_completes(
    jobs: dict[str, _Job], slurm_cluster: SlurmCluster
) -> None:
    job = jobs["sbatch"]
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n" in job.sbatch
    assert job.fields["JobState"] == "COMPLETED", (job.fields, job.output[-3000:])
    assert job.fields["ExitCode"] == "0:0"
    for rank in (0, 1):
        assert f"task {rank}: MultiWorkerMirrored with 2 replicas: done" in job.output
    assert "job step failed" not in job.output
    _assert_one_job_of_two(job, "0", slurm_cluster.node)
    assert job.records()["task0-0"]["job_id"] == str(job.job_id)
    _assert_identical_weights(job)
    # The same training as under srun: the same weights.
    assert relative_difference(job.weights(0), jobs["srun"].weights(0)) <= 1e-6
    _assert_nothing_left(slurm_cluster, job)


def test_sbatch_restart_loop_after_a_killed_task_resumes(
    jobs: dict[str, _Job], slurm_cluster: SlurmCluster
) -> None:
    job = jobs["restart"]
    assert job.fields["JobState"] == "COMPLETED", (job.fields, job.output[-3000:])
    assert job.fields["ExitCode"] == "0:0"
    assert "tfscale: job step failed (status" in job.output
    assert "attempt 0" in job.output and "attempt 1" not in job.output
    records = job.records()
    assert sorted(records) == ["task0-0", "task0-1", "task1-0", "task1-1"]
    _assert_one_job_of_two(job, "0", slurm_cluster.node)
    _assert_one_job_of_two(job, "1", slurm_cluster.node)
    # One job, a second job step; 12 updates per epoch, rank 1 killed after update 18,
    # checkpoints every 5 updates and at epoch ends: 12, 17 -> the step resumes at 17.
    assert records["task0-1"]["job_id"] == records["task0-0"]["job_id"] == str(job.job_id)
    assert records["task0-1"]["step_id"] != records["task0-0"]["step_id"]
    assert records["task0-0"]["start_step"] == 0
    assert records["task0-1"]["start_step"] == records["task1-1"]["start_step"] == 17
    _assert_identical_weights(job)
    uninterrupted = jobs["srun"].weights(0)
    assert relative_difference(job.weights(0), uninterrupted) <= 1e-6
    _assert_nothing_left(slurm_cluster, job)


def test_failing_task_status_propagates_and_stops_the_other(
    jobs: dict[str, _Job], slurm_cluster: SlurmCluster
) -> None:
    job = jobs["failing"]
    # srun exits with the highest status of its tasks: here 143, rank 0's, which Slurm
    # stopped with SIGTERM (--kill-on-bad-exit); the failing task's own status is on its
    # error line.
    assert job.returncode == 128 + 15, (job.output, job.stderr)
    assert "task 1 fails" in job.output
    assert "task 1: Exited with exit code 3" in job.stderr, job.stderr
    assert "task 0: Terminated" in job.stderr, job.stderr
    _assert_nothing_left(slurm_cluster, job)  # rank 0's sleep was stopped


def test_script_that_trains_alone_exits_78_with_the_reason_last(
    jobs: dict[str, _Job], slurm_cluster: SlurmCluster
) -> None:
    job = jobs["seed000"]
    # 78 from both tasks, or 143 where Slurm stopped one before it got there.
    assert job.returncode in (78, 128 + 15), (job.output, job.stderr[-3000:])
    assert "Exited with exit code 78" in job.stderr
    lines = [line for line in job.stderr.splitlines() if line.startswith("tfscale launch:")]
    assert lines, job.stderr[-3000:]
    assert "Slurm task" in lines[-1] and "MirroredStrategy over this worker's devices" in lines[-1]
    assert "Fix:" in lines[-1]
    assert "Traceback" not in job.output + job.stderr
    _assert_nothing_left(slurm_cluster, job)


def test_sbatch_does_not_restart_a_script_that_trains_alone(
    jobs: dict[str, _Job], slurm_cluster: SlurmCluster
) -> None:
    job = jobs["seed000-sbatch"]
    assert job.fields["JobState"] == "FAILED", (job.fields, job.output[-3000:])
    assert job.fields["ExitCode"] == "78:0"
    reasons = [line for line in job.output.splitlines() if line.startswith("tfscale launch:")]
    assert reasons and "MirroredStrategy over this worker's devices" in reasons[0]
    assert job.output.strip().splitlines()[-1] == (
        "tfscale: a worker did not train with the others (why: above); not restarting"
    )
    assert "job step failed" not in job.output  # one attempt of 2
    assert not list(job.folder.glob(".tfscale-*"))  # the verdicts' folder is removed
    _assert_nothing_left(slurm_cluster, job)
