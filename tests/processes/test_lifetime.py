"""No tfscale child outlives its parent, whatever ends the parent (real processes).

Each test starts a real parent (``tfscale launch``, ``tfscale bench --workers``,
``tfscale doctor --script``, a script owning a process-backend TaskPool), waits for its
children, records every process below it, ends the parent, and checks that none of them is
alive 10 s later. The children need not get far (TensorFlow may still be importing): what is
tested is their life, not their work, so the TensorFlow-heavy parents are cheap here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tfscale.testing import alive, descendants

pytestmark = pytest.mark.multiprocess

_ROOT = Path(__file__).resolve().parents[2]
_SLEEPER = _ROOT / "tests" / "launch" / "data" / "sleeper.py"
_SLEEPS = _ROOT / "tests" / "doctor" / "data" / "sleeps.py"
_POOL_OWNER = Path(__file__).parent / "data" / "pool_owner.py"
_AFTER_S = 10.0  # "no child alive 10 s later"


def _wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _survivors(pids: set[int], timeout: float = _AFTER_S) -> list[int]:
    _wait_for(lambda: not any(alive(p) for p in pids), timeout)
    return sorted(p for p in pids if alive(p))


@pytest.fixture
def started() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts parents as `python ...` in their own session; kills and reaps them at the end."""
    parents: list[subprocess.Popen[bytes]] = []

    def start(*argv: str | Path) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONPATH=str(_ROOT / "src"), TF_CPP_MIN_LOG_LEVEL="3")
        env.pop("TF_CONFIG", None)
        env.pop("TFSCALE_VIRTUAL_DEVICES", None)
        parent = subprocess.Popen(
            [sys.executable, *map(str, argv)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        parents.append(parent)
        return parent

    yield start
    for parent in parents:
        if parent.poll() is None:
            parent.kill()
        parent.wait(30)


def _sigkill_when(parent: subprocess.Popen[bytes], children: int, timeout: float) -> set[int]:
    """Waits until ``parent`` has ``children`` processes below it; SIGKILLs it; returns them."""
    assert _wait_for(lambda: len(descendants(parent.pid)) >= children, timeout), (
        f"the parent's children did not start: {descendants(parent.pid)}"
    )
    below = descendants(parent.pid)
    parent.kill()
    parent.wait(30)
    return below


def test_sigkilled_launcher_leaves_no_worker(
    started: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    launcher = started("-m", "tfscale.cli.main", "launch", "-n", "2", _SLEEPER, tmp_path)
    # Each worker starts a `sleep` child of its own: guard, worker, sleep, twice.
    assert _wait_for(lambda: len(list(tmp_path.glob("*.json"))) == 2, 60), "workers not up"
    below = _sigkill_when(launcher, 6, 30)
    assert _survivors(below) == []


def test_sigkilled_bench_workers_parent_leaves_no_worker(
    started: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    bench = started(
        "-m", "tfscale.cli.main", "bench", "--workers", "2", "--steps", "2", "--warmup", "1",
        "--trace-steps", "0", "--out", tmp_path,
    )  # fmt: skip
    below = _sigkill_when(bench, 4, 60)  # a guard and a worker per worker
    assert _survivors(below) == []


def test_sigkilled_doctor_script_parent_leaves_no_child(
    started: Callable[..., subprocess.Popen[bytes]],
) -> None:
    doctor = started("-m", "tfscale.cli.main", "doctor", "--script", _SLEEPS)
    below = _sigkill_when(doctor, 2, 60)  # the guard and the instrumented script
    assert _survivors(below) == []


def test_process_pool_owner_killed_terminated_or_returning_leaves_nothing(
    started: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    # Three owners at once (each starts TensorFlow to list its devices, the slow part).
    modes = {"return": "return", "sigterm": "wait", "sigkill": "wait"}
    folders = {name: tmp_path / name for name in modes}
    owners = {}
    for name, mode in modes.items():
        folders[name].mkdir()
        owners[name] = started(_POOL_OWNER, folders[name], mode)
    for name, folder in folders.items():
        assert _wait_for(lambda f=folder: (f / "ready").exists(), 180), f"{name}: pool not up"
    below = {name: descendants(owner.pid) for name, owner in owners.items()}
    (folders["return"] / "go").write_text("")
    owners["sigterm"].send_signal(signal.SIGTERM)
    owners["sigkill"].kill()
    deadline = time.monotonic() + 20
    for name, owner in owners.items():
        # The owner that returned without shutdown() exits by itself, not after its 120 s
        # tasks; the SIGTERMed one at once.
        exited = owner.wait(max(1.0, deadline - time.monotonic()))
        assert exited is not None, name
    assert owners["return"].returncode == 0
    assert owners["sigterm"].returncode == -signal.SIGTERM
    for name, pids in below.items():
        workers = {int(p.name.split("-")[1]) for p in folders[name].glob("task-*")}
        assert workers <= pids, (name, workers, pids)  # the task processes were below it
        assert _survivors(pids) == [], name
