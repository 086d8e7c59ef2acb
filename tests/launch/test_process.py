"""The supervisor with real processes (no TensorFlow): group kill, grace, restart, prefixes."""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

import pytest

from tfscale.launch.process import spawn_process
from tfscale.launch.supervisor import Supervisor, Task
from tfscale.testing import alive

pytestmark = pytest.mark.multiprocess


def _wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


# Worker 0 starts a grandchild (same process group), records both pids, then blocks, as a
# worker waiting in a collective for a dead peer would. Worker 1 fails once both are up.
_BLOCKED = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "60"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
print("ready", flush=True)
time.sleep(60)
"""
_FAILS_AFTER_PEER = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
print("failing now", flush=True)
sys.exit(int(os.environ["CODE"]))
"""


def test_failure_stops_blocked_peer_and_its_children(tmp_path: Path) -> None:
    marker = str(tmp_path / "pids")
    sink = io.StringIO()
    env = dict(os.environ, CODE="3")
    tasks = [
        Task("worker 0", (*_py(_BLOCKED), marker), env, 0),
        Task("worker 1", (*_py(_FAILS_AFTER_PEER), marker), env, 1),
    ]
    log: list[str] = []
    supervisor = Supervisor(lambda t: spawn_process(t, sink=sink), grace_s=5.0, log=log.append)
    result = supervisor.run(lambda attempt: tasks, timeout_s=60)
    assert result.exit_code == 3
    worker0, grandchild = (int(p) for p in Path(marker).read_text().split())
    assert _wait_dead([worker0, grandchild]) == []
    lines = sink.getvalue().splitlines()
    assert "[worker 0] ready" in lines and "[worker 1] failing now" in lines
    assert any("worker 1 exited with code 3" in m for m in log)


def test_worker_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    marker = tmp_path / "up"
    stubborn = (
        "import signal, time, pathlib, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "pathlib.Path(sys.argv[1]).touch()\n"
        "time.sleep(60)\n"
    )
    failing = (
        "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.02)\nsys.exit(2)"
    )
    tasks = [
        Task("worker 0", (*_py(stubborn), str(marker)), dict(os.environ), 0),
        Task("worker 1", (*_py(failing), str(marker)), dict(os.environ), 1),
    ]
    log: list[str] = []
    sink = io.StringIO()
    supervisor = Supervisor(lambda t: spawn_process(t, sink=sink), grace_s=0.5, log=log.append)
    assert supervisor.run(lambda attempt: tasks, timeout_s=60).exit_code == 2
    assert any("worker 0 ignored SIGTERM for 0.5 s; killing it" in m for m in log)


def test_restart_runs_a_fresh_attempt(tmp_path: Path) -> None:
    # Killed by SIGKILL on attempt 0 (exit status 137), succeeds on attempt 1.
    code = (
        "import os, signal, sys\n"
        "print('attempt', os.environ['ATTEMPT'], flush=True)\n"
        "if os.environ['ATTEMPT'] == '0' and sys.argv[1] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )

    def make_tasks(attempt: int) -> list[Task]:
        env = dict(os.environ, ATTEMPT=str(attempt))
        return [Task(f"worker {i}", (*_py(code), str(i)), env, i) for i in range(2)]

    sink = io.StringIO()
    supervisor = Supervisor(lambda t: spawn_process(t, sink=sink), grace_s=2.0, log=lambda m: None)
    result = supervisor.run(make_tasks, max_restarts=1, timeout_s=60)
    assert (result.exit_code, result.attempts) == (0, 2)
    assert result.failures[0].returncode == -9
    assert "[worker 0] attempt 1" in sink.getvalue().splitlines()
