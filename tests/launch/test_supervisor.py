"""Supervision logic with fake processes: stop together, restart, exit status, Ctrl-C."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tfscale.launch.supervisor import (
    Supervisor,
    Task,
    describe_exit,
    exit_status,
)

RUNNING_FOREVER = None


class FakeProcess:
    """Exits with ``code`` after ``polls`` looks (never if code is None)."""

    def __init__(self, pid: int, code: int | None, polls: int = 0, ignores_term: bool = False):
        self.pid = pid
        self._code = code
        self._polls_left = polls
        self._ignores_term = ignores_term
        self.returncode: int | None = None
        self.signals: list[str] = []
        self.closed = False

    def poll(self) -> int | None:
        if self.returncode is None and self._code is not None:
            if self._polls_left <= 0:
                self.returncode = self._code
            self._polls_left -= 1
        return self.returncode

    def wait(self, timeout: float) -> int | None:
        return self.poll()

    def terminate(self) -> None:
        self.signals.append("TERM")
        if self.returncode is None and not self._ignores_term:
            self.returncode = -15

    def kill(self) -> None:
        self.signals.append("KILL")
        if self.returncode is None:
            self.returncode = -9

    def close(self) -> None:
        self.closed = True


class FakeCluster:
    """A spawn function whose processes behave as scripted per (attempt, rank)."""

    def __init__(self, script: Callable[[int, int], FakeProcess]):
        self._script = script
        self.started: list[tuple[int, FakeProcess]] = []  # (attempt, process)
        self.attempt = -1

    def make_tasks(self, n: int, must_finish: tuple[bool, ...] | None = None):
        def make(attempt: int) -> list[Task]:
            self.attempt = attempt
            flags = must_finish or (True,) * n
            return [
                Task(f"worker {i}", ("python", "x.py"), {"A": str(attempt)}, i, flags[i])
                for i in range(n)
            ]

        return make

    def spawn(self, task: Task) -> FakeProcess:
        process = self._script(self.attempt, task.rank)
        self.started.append((self.attempt, process))
        return process


def _supervisor(cluster: FakeCluster, log: list[str], **kwargs: object) -> Supervisor:
    return Supervisor(cluster.spawn, grace_s=0.0, log=log.append, sleep=lambda s: None, **kwargs)


def test_all_workers_succeed_exit_zero_one_attempt() -> None:
    cluster = FakeCluster(lambda attempt, rank: FakeProcess(100 + rank, 0, polls=rank + 1))
    log: list[str] = []
    result = _supervisor(cluster, log).run(cluster.make_tasks(3), max_restarts=2)
    assert (result.exit_code, result.attempts, result.failures) == (0, 1, ())
    assert all(p.closed and p.signals == [] for _, p in cluster.started)


def test_failure_stops_the_others_and_gives_the_failing_code() -> None:
    def script(attempt: int, rank: int) -> FakeProcess:
        return FakeProcess(rank, 3 if rank == 1 else RUNNING_FOREVER, polls=2)

    cluster = FakeCluster(script)
    log: list[str] = []
    result = _supervisor(cluster, log).run(cluster.make_tasks(3))
    assert result.exit_code == 3 and result.attempts == 1
    assert [(f.label, f.returncode) for f in result.failures] == [("worker 1", 3)]
    survivors = [p for _, p in cluster.started if p.pid != 1]
    assert all(p.signals == ["TERM"] and p.returncode == -15 for p in survivors)
    assert all(p.closed for _, p in cluster.started)
    assert any("worker 1 exited with code 3; stopping the 2 other task(s)" in m for m in log)


def test_killed_worker_gives_128_plus_signal() -> None:
    cluster = FakeCluster(lambda a, rank: FakeProcess(rank, -9 if rank == 0 else None, polls=1))
    result = _supervisor(cluster, []).run(cluster.make_tasks(2))
    assert result.exit_code == 137


def test_worker_ignoring_sigterm_is_killed_after_grace() -> None:
    def script(attempt: int, rank: int) -> FakeProcess:
        if rank == 0:
            return FakeProcess(0, 1, polls=1)
        return FakeProcess(1, None, ignores_term=True)

    cluster = FakeCluster(script)
    log: list[str] = []
    result = _supervisor(cluster, log).run(cluster.make_tasks(2))
    stubborn = cluster.started[1][1]
    assert stubborn.signals == ["TERM", "KILL"] and stubborn.returncode == -9
    assert result.exit_code == 1
    assert any("worker 1 ignored SIGTERM" in m for m in log)


def test_restarts_until_success_and_counts_attempts() -> None:
    # Worker 1 dies (SIGKILL) on attempts 0 and 1; attempt 2 succeeds.
    def script(attempt: int, rank: int) -> FakeProcess:
        if attempt < 2 and rank == 1:
            return FakeProcess(rank, -9, polls=1)
        return FakeProcess(rank, 0 if attempt == 2 else None, polls=3)

    cluster = FakeCluster(script)
    log: list[str] = []
    result = _supervisor(cluster, log).run(cluster.make_tasks(2), max_restarts=2)
    assert (result.exit_code, result.attempts) == (0, 3)
    assert [f.attempt for f in result.failures] == [0, 1]
    assert sorted({a for a, _ in cluster.started}) == [0, 1, 2]
    assert sum("restarting the job" in m for m in log) == 2
    assert all(p.closed for _, p in cluster.started)


def test_restarts_exhausted_returns_last_failure() -> None:
    cluster = FakeCluster(lambda a, rank: FakeProcess(rank, 2 + a if rank == 0 else None))
    result = _supervisor(cluster, []).run(cluster.make_tasks(2), max_restarts=1)
    assert (result.exit_code, result.attempts) == (3, 2)
    assert [f.returncode for f in result.failures] == [2, 3]


def test_ctrl_c_stops_every_worker_and_propagates() -> None:
    cluster = FakeCluster(lambda a, rank: FakeProcess(rank, None))
    calls = []

    def sleep(seconds: float) -> None:
        calls.append(seconds)
        if len(calls) == 3:
            raise KeyboardInterrupt

    supervisor = Supervisor(cluster.spawn, grace_s=0.0, log=lambda m: None, sleep=sleep)
    with pytest.raises(KeyboardInterrupt):
        supervisor.run(cluster.make_tasks(3), max_restarts=5)
    assert len(cluster.started) == 3  # no restart after Ctrl-C
    assert all(p.signals == ["TERM"] and p.closed for _, p in cluster.started)


def test_spawn_failure_stops_tasks_already_started() -> None:
    started: list[FakeProcess] = []

    def spawn(task: Task) -> FakeProcess:
        if task.rank == 1:
            raise OSError("no such interpreter")
        started.append(FakeProcess(task.rank, None))
        return started[-1]

    supervisor = Supervisor(spawn, grace_s=0.0, log=lambda m: None, sleep=lambda s: None)
    with pytest.raises(OSError):
        supervisor.run(FakeCluster(lambda a, r: FakeProcess(r, None)).make_tasks(2))
    assert started[0].signals == ["TERM"] and started[0].closed


def test_server_tasks_are_stopped_when_the_chief_finishes() -> None:
    # Parameter-server job: chief (must finish), worker and ps servers (run until stopped).
    cluster = FakeCluster(lambda a, rank: FakeProcess(rank, 0 if rank == 0 else None, polls=2))
    result = _supervisor(cluster, []).run(cluster.make_tasks(3, (True, False, False)))
    assert result.exit_code == 0
    assert [p.signals for _, p in cluster.started] == [[], ["TERM"], ["TERM"]]


def test_server_exiting_early_fails_the_attempt() -> None:
    cluster = FakeCluster(lambda a, rank: FakeProcess(rank, None if rank == 0 else 0, polls=1))
    log: list[str] = []
    result = _supervisor(cluster, log).run(cluster.make_tasks(2, (True, False)))
    assert result.exit_code == 1
    assert any("worker 1 exited before the job finished" in m for m in log)


def test_time_limit_stops_the_job_without_restart() -> None:
    cluster = FakeCluster(lambda a, rank: FakeProcess(rank, None))
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    log: list[str] = []
    supervisor = Supervisor(
        cluster.spawn, grace_s=0.0, log=log.append, sleep=sleep, clock=lambda: now[0]
    )
    result = supervisor.run(cluster.make_tasks(2), max_restarts=3, timeout_s=1.0)
    assert (result.exit_code, result.attempts) == (124, 1)
    assert result.failures[0].timed_out
    assert all(p.signals == ["TERM"] and p.closed for _, p in cluster.started)
    assert any("ran past its time limit" in m for m in log)


@pytest.mark.parametrize(
    ("code", "status", "words"),
    [
        (0, 0, "exited with code 0"),
        (3, 3, "exited with code 3"),
        (-9, 137, "killed by SIGKILL"),
        (-15, 143, "killed by SIGTERM"),
    ],
)
def test_exit_status_and_description(code: int, status: int, words: str) -> None:
    assert exit_status(code) == status
    assert words in describe_exit(code)


def test_a_taken_port_starts_the_job_again_without_counting_a_restart() -> None:
    # Worker 1 finds its port taken (status 75) on attempts 0 and 1; attempt 2 trains. No
    # restart is allowed, and none is used.
    def script(attempt: int, rank: int) -> FakeProcess:
        if attempt < 2 and rank == 1:
            return FakeProcess(rank, 75, polls=1)
        return FakeProcess(rank, 0 if attempt == 2 else None, polls=3)

    cluster = FakeCluster(script)
    log: list[str] = []
    supervisor = _supervisor(cluster, log, retry_statuses=(75,), max_retries=2)
    result = supervisor.run(cluster.make_tasks(2), max_restarts=0)
    assert (result.exit_code, result.attempts) == (0, 3)
    assert [f.returncode for f in result.failures] == [75, 75]
    assert sum("not counted as a restart" in m for m in log) == 2
    assert "(2 of 2)" in [m for m in log if "not counted" in m][-1]
    assert not any("restarting the job" in m for m in log)


def test_taken_ports_past_the_retries_count_as_failures() -> None:
    # Three taken ports with 1 retry: the second is the job's failure, and with one restart
    # the third ends it.
    cluster = FakeCluster(lambda a, rank: FakeProcess(rank, 75 if rank == 0 else None, polls=1))
    log: list[str] = []
    supervisor = _supervisor(cluster, log, retry_statuses=(75,), max_retries=1)
    result = supervisor.run(cluster.make_tasks(2), max_restarts=1)
    assert (result.exit_code, result.attempts) == (75, 3)
    assert sum("not counted as a restart" in m for m in log) == 1
    assert sum("restarting the job (restart 1 of 1)" in m for m in log) == 1
