"""Elastic jobs (``--min-workers``): the decisions with fakes, the tasks, the options, and the
whole launcher with TF-free workers (the trained, exact case is in test_elastic_jobs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tfscale.cli.main import main
from tfscale.cluster.notes import CheckpointNote, read_checkpoint_note, write_checkpoint_note
from tfscale.launch.elastic import Drop, elastic_line, slot_to_drop
from tfscale.launch.plan import LocalJob, plan_tasks
from tfscale.launch.supervisor import Supervisor, Task
from tfscale.testing import alive

from .test_supervisor import RUNNING_FOREVER, FakeProcess

_ROOT = Path(__file__).resolve().parents[2]
_SLEEPER = str(Path(__file__).parent / "data" / "elastic_sleeper.py")


# -- the decision ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("failed", "restarts", "expected"),
    [
        ([2, 2, 2], 2, 2),  # the same slot on every start, restarts used up
        ([2, 2], 2, None),  # a restart is left
        ([2, 1, 2], 2, None),  # different slots: a flaky job, not a lost machine
        ([1], 0, 1),  # no restarts: dropped at its first failure
        ([None, None], 1, None),  # not a worker slot (a time limit, a parameter server)
    ],
)
def test_slot_to_drop(failed: list[int | None], restarts: int, expected: int | None) -> None:
    assert slot_to_drop(failed, restarts) == expected


class ElasticCluster:
    """A spawn whose slots behave as ``behave(attempt, slot, workers)`` says."""

    def __init__(self, behave):  # type: ignore[no-untyped-def]
        self.behave = behave
        self.attempts: list[tuple[int, ...]] = []
        self.processes: list[FakeProcess] = []

    def make_tasks(self, attempt: int, slots: tuple[int, ...]) -> list[Task]:
        self.attempts.append(slots)
        return [
            Task(f"worker {s}", ("x",), {"N": str(len(slots))}, i, True, slot=s)
            for i, s in enumerate(slots)
        ]

    def spawn(self, task: Task) -> FakeProcess:
        workers = int(task.env["N"])
        assert task.slot is not None
        process = self.behave(len(self.attempts) - 1, task.slot, workers)
        self.processes.append(process)
        return process


def _run(cluster: ElasticCluster, log: list[str], **kwargs):  # type: ignore[no-untyped-def]
    supervisor = Supervisor(cluster.spawn, grace_s=0.0, log=log.append, sleep=lambda s: None)
    return supervisor.run_elastic(cluster.make_tasks, **kwargs)


def _slot_2_dies_while_3(attempt: int, slot: int, workers: int) -> FakeProcess:
    if workers == 3:
        return FakeProcess(slot, -9 if slot == 2 else RUNNING_FOREVER, polls=2)
    return FakeProcess(slot, 0, polls=1)


def test_a_slot_failing_on_every_start_is_dropped_and_the_job_finishes_on_the_rest() -> None:
    cluster = ElasticCluster(_slot_2_dies_while_3)
    log: list[str] = []
    result = _run(cluster, log, slots=(0, 1, 2), min_workers=2, max_restarts=2)
    assert cluster.attempts == [(0, 1, 2)] * 3 + [(0, 1)]
    assert (result.exit_code, result.attempts, result.workers) == (0, 4, 2)
    assert result.dropped == (Drop(2, "worker 2", "killed by SIGKILL", 3, 2),)
    assert result.below is None
    assert [f.slot for f in result.failures] == [2, 2, 2]
    assert any("dropping worker 2 (killed by SIGKILL on 3 start(s) in a row)" in m for m in log)
    assert all(p.closed for p in cluster.processes)


def test_the_tasks_keep_their_slot_and_get_new_indices() -> None:
    # Slot 1 of 3 is lost: slot 2 becomes TF_CONFIG index 1, still labelled worker 2.
    def behave(attempt: int, slot: int, workers: int) -> FakeProcess:
        if workers == 3:
            return FakeProcess(slot, 5 if slot == 1 else RUNNING_FOREVER, polls=1)
        return FakeProcess(slot, 0)

    cluster = ElasticCluster(behave)
    result = _run(cluster, [], slots=(0, 1, 2), min_workers=1, max_restarts=0)
    assert result.exit_code == 0 and cluster.attempts == [(0, 1, 2), (0, 2)]
    assert result.dropped[0].why == "exited with code 5"
    tasks = cluster.make_tasks(9, (0, 2))
    assert [(t.label, t.rank, t.slot) for t in tasks] == [("worker 0", 0, 0), ("worker 2", 1, 2)]


def test_the_restart_budget_is_fresh_after_a_drop_and_a_second_slot_can_go() -> None:
    # Slot 2 dies while it is there; then slot 1 dies while 2 workers run; 1 worker finishes.
    def behave(attempt: int, slot: int, workers: int) -> FakeProcess:
        dies = (workers == 3 and slot == 2) or (workers == 2 and slot == 1)
        if dies:
            return FakeProcess(slot, -9, polls=1)
        return FakeProcess(slot, 0 if workers == 1 else RUNNING_FOREVER, polls=2)

    cluster = ElasticCluster(behave)
    result = _run(cluster, [], slots=(0, 1, 2), min_workers=1, max_restarts=1)
    assert cluster.attempts == [(0, 1, 2)] * 2 + [(0, 1)] * 2 + [(0,)]
    assert [d.slot for d in result.dropped] == [2, 1] and result.workers == 1
    assert result.exit_code == 0


def test_below_min_workers_the_job_fails_and_says_which_slot() -> None:
    cluster = ElasticCluster(_slot_2_dies_while_3)
    log: list[str] = []
    result = _run(cluster, log, slots=(0, 1, 2), min_workers=3, max_restarts=1)
    assert cluster.attempts == [(0, 1, 2)] * 2
    assert (result.exit_code, result.attempts, result.dropped) == (137, 2, ())
    assert result.below == Drop(2, "worker 2", "killed by SIGKILL", 2, 2)
    assert "job failed after 2 attempt(s); exit status 137" in log[-1]
    stopped = [p for p in cluster.processes if p.pid != 2]
    assert all(p.signals == ["TERM"] and p.closed for p in stopped)


def test_different_slots_failing_is_not_a_lost_machine() -> None:
    def behave(attempt: int, slot: int, workers: int) -> FakeProcess:
        return FakeProcess(slot, 1 if slot == attempt else RUNNING_FOREVER, polls=1)

    cluster = ElasticCluster(behave)
    result = _run(cluster, [], slots=(0, 1, 2), min_workers=1, max_restarts=1)
    assert (result.exit_code, result.attempts, result.dropped, result.below) == (1, 2, (), None)


def test_an_unreachable_host_is_dropped_at_once() -> None:
    cluster = ElasticCluster(_slot_2_dies_while_3)
    result = _run(
        cluster,
        [],
        slots=(0, 1, 2),
        min_workers=2,
        max_restarts=5,
        unreachable=lambda slot: slot == 2,
    )
    assert cluster.attempts == [(0, 1, 2), (0, 1)]
    assert result.dropped == (Drop(2, "worker 2", "its host could not be reached", 1, 2),)


def test_without_min_workers_nothing_is_dropped() -> None:
    cluster = ElasticCluster(_slot_2_dies_while_3)
    result = _run(cluster, [], slots=(0, 1, 2), min_workers=None, max_restarts=1)
    assert (result.exit_code, result.attempts, result.workers) == (137, 2, None)


# -- the last line -----------------------------------------------------------------------
_NOTE = CheckpointNote("/ck", "/ck/ckpt-24", 2, 4, 24)


def test_last_line_after_a_drop_says_who_why_and_how_many_finished() -> None:
    line = elastic_line(
        workers=3,
        finished=2,
        dropped=[Drop(2, "worker 2", "killed by SIGKILL", 3, 2)],
        below=None,
        min_workers=2,
        checkpoint=_NOTE,
    )
    assert line == (
        "finished on 2 of 3 workers: dropped worker 2 (killed by SIGKILL on 3 starts in a row)"
    )


def test_last_line_below_min_workers_names_the_lost_and_the_checkpoint() -> None:
    line = elastic_line(
        workers=3,
        finished=None,
        dropped=[Drop(2, "worker 2", "killed by SIGKILL", 3, 2)],
        below=Drop(1, "worker 1", "exited with code 1", 1, 1),
        min_workers=2,
        checkpoint=_NOTE,
    )
    assert line is not None
    assert line.startswith("job failed: dropped worker 2 (killed by SIGKILL on 3 starts in a ")
    assert "worker 1 (exited with code 1 on 1 start), and without it 1 worker(s)" in line
    assert "fewer than --min-workers 2 (lost: worker 2, worker 1)" in line
    assert "resume from /ck/ckpt-24 (epoch 2, batch 4, update 24)" in line
    no_note = elastic_line(
        workers=2, finished=None, dropped=[], below=Drop(1, "worker 1", "x", 1, 1),
        min_workers=2, checkpoint=None,
    )  # fmt: skip
    assert no_note is not None and "no checkpoint was noted" in no_note
    assert elastic_line(
        workers=2, finished=2, dropped=[], below=None, min_workers=1, checkpoint=None
    ) is None  # fmt: skip


def test_last_line_of_a_job_that_failed_otherwise_after_a_drop() -> None:
    line = elastic_line(
        workers=3,
        finished=None,
        dropped=[Drop(2, "worker 2", "killed by SIGKILL", 1, 2)],
        below=None,
        min_workers=1,
        checkpoint=_NOTE,
    )
    assert line == (
        "job failed after it dropped worker 2 (killed by SIGKILL on 1 start); resume from "
        "/ck/ckpt-24 (epoch 2, batch 4, update 24): run the job again with the same "
        "checkpoint_dir"
    )


def test_checkpoint_note_round_trip(tmp_path: Path) -> None:
    assert read_checkpoint_note(str(tmp_path)) is None
    write_checkpoint_note(str(tmp_path), _NOTE)
    assert read_checkpoint_note(str(tmp_path)) == _NOTE
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.note"]  # not a verdict (.json)


# -- the tasks ---------------------------------------------------------------------------
def test_plan_tasks_on_the_slots_left_keeps_labels_and_gpus() -> None:
    job = LocalJob(script=("train.py",), workers=3)
    tasks = plan_tasks(job, [7, 8, 9], 3, base_env={}, gpus=["0", "1", "2"], slots=(0, 2))
    assert [(t.label, t.slot, t.rank) for t in tasks] == [("worker 0", 0, 0), ("worker 2", 2, 1)]
    configs = [json.loads(t.env["TF_CONFIG"]) for t in tasks]
    assert configs[1] == {
        "cluster": {"worker": ["127.0.0.1:7", "127.0.0.1:8"]},
        "task": {"type": "worker", "index": 1},
    }
    assert [t.env["CUDA_VISIBLE_DEVICES"] for t in tasks] == ["0", "2"]
    assert tasks[1].env["TFSCALE_LAUNCH_ATTEMPT"] == "3"


# -- the options -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "2", "--min-workers", "3"], "between 1 and the job's workers (-n: 2)"),
        (["-n", "2", "--min-workers", "0"], "--min-workers 0 with -n 2"),
        (["--ps", "1", "-n", "2", "--min-workers", "1"], "a job with parameter servers"),
        (
            ["--slurm", "--nodes", "2", "--tasks-per-node", "2", "--min-workers", "3"],
            "a multiple of --tasks-per-node (2)",
        ),
    ],
)
def test_impossible_min_workers_are_refused(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *args, _SLEEPER]) == 2
    err = capsys.readouterr().err
    assert message in err and "Received:" in err and "Fix:" in err


# -- the launcher with TF-free workers ---------------------------------------------------
def _launch(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(_ROOT / "src"))
    env.pop("TF_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "tfscale.cli.main", "launch", "--timeout", "100", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _records(folder: Path) -> dict[str, dict[str, object]]:
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


@pytest.mark.multiprocess
def test_launcher_drops_the_failing_worker_and_exits_0_on_the_rest(tmp_path: Path) -> None:
    args = ["-n", "3", "--min-workers", "2", "--max-restarts", "1", "--grace", "1"]
    done = _launch([*args, _SLEEPER, str(tmp_path), "worker 2", "2"])
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(tmp_path)
    assert sorted(records) == [
        "worker0-0", "worker0-1", "worker0-2", "worker1-0", "worker1-1", "worker1-2",
        "worker2-0", "worker2-1",
    ]  # fmt: skip
    assert records["worker1-2"]["workers"] == 2  # a new TF_CONFIG of 2 workers
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "[tfscale launch] finished on 2 of 3 workers: dropped worker 2 "
        "(killed by SIGKILL on 2 starts in a row)"
    )
    assert not any(alive(int(str(r["pid"]))) for r in records.values())


@pytest.mark.multiprocess
def test_launcher_below_min_workers_fails_naming_the_worker_and_the_checkpoint(
    tmp_path: Path,
) -> None:
    args = ["-n", "2", "--min-workers", "2", "--max-restarts", "1", "--grace", "1"]
    done = _launch([*args, _SLEEPER, str(tmp_path), "worker 1", "0"])
    assert done.returncode == 137, done.stderr[-3000:]
    assert sorted(_records(tmp_path)) == ["worker0-0", "worker0-1", "worker1-0", "worker1-1"]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("[tfscale launch] job failed: worker 1 (killed by SIGKILL on 2 "), last
    assert "fewer than --min-workers 2 (lost: worker 1)" in last
    assert f"resume from {tmp_path}/ck/ckpt-7 (epoch 1, batch 3, update 7)" in last
    assert not any(alive(int(str(r["pid"]))) for r in _records(tmp_path).values())
