"""``tfscale launch`` with real local processes that need no TensorFlow (fast)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfscale.cli.main import main
from tfscale.testing import alive, run_python

_ROOT = Path(__file__).resolve().parents[2]
_SLEEPER = str(Path(__file__).parent / "data" / "sleeper.py")


def _wait_for(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _launcher(args: list[str], *, sigint_ignored: bool = False) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(_ROOT / "src"))
    env.pop("TF_CONFIG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "tfscale.cli.main", "launch", "--timeout", "100", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Started as a parent that ignores SIGINT would start it (inherited across exec).
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if sigint_ignored
        else None,
    )


@pytest.mark.multiprocess
def test_launcher_imports_no_tensorflow() -> None:
    done = run_python(
        """
        import sys
        import tfscale.launch, tfscale.launch.supervisor, tfscale.launch.process
        import tfscale.launch.plan, tfscale.launch.local, tfscale.launch.ports
        import tfscale.launch.slurm, tfscale.launch.k8s, tfscale.launch.yamltext
        import tfscale.launch.server, tfscale.cluster, tfscale.cluster.hostlist, tfscale.cli.launch
        from tfscale.cli.main import build_parser
        build_parser().parse_args(["launch", "-n", "2", "x.py"])
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras")))
        """,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("signum", "sigint_ignored"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["SIGINT", "SIGTERM", "SIGINT-inherited-ignored"],
)
def test_interrupt_stops_every_worker_and_their_children(
    tmp_path: Path, signum: int, sigint_ignored: bool
) -> None:
    launcher = _launcher(
        ["-n", "2", "--devices-per-worker", "3", _SLEEPER, str(tmp_path)],
        sigint_ignored=sigint_ignored,
    )
    try:
        assert _wait_for(lambda: len(list(tmp_path.glob("*.json"))) == 2, 60), "workers not up"
        records = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 130, err
    pids = [r[k] for r in records.values() for k in ("pid", "child")]
    assert _wait_for(lambda: not any(alive(p) for p in pids), 10), "a process of the job lives"
    # Each worker got its own TF_CONFIG with two distinct local addresses, and K devices.
    workers = records["worker0-0"]["tf_config"]["cluster"]["worker"]
    assert len(set(workers)) == 2 and all(a.startswith("127.0.0.1:") for a in workers)
    assert records["worker1-0"]["tf_config"] == {
        "cluster": {"worker": workers},
        "task": {"type": "worker", "index": 1},
    }
    assert {r["virtual_devices"] for r in records.values()} == {"3"}
    assert "[worker 0] hello from worker0" in out and "[worker 1] hello from worker1" in out


@pytest.mark.multiprocess
def test_exit_status_is_the_jobs_after_restarts(tmp_path: Path) -> None:
    launcher = _launcher(["-n", "2", "--max-restarts", "1", _SLEEPER, str(tmp_path), "7"])
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 7
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == [
        "worker0-0", "worker0-1", "worker1-0", "worker1-1",
    ]  # fmt: skip
    ports = [
        json.loads((tmp_path / f"worker0-{a}.json").read_text())["tf_config"]["cluster"]["worker"]
        for a in (0, 1)
    ]
    assert ports[0] != ports[1]  # fresh ports for the restart
    assert "restarting the job (restart 1 of 1)" in err
    assert "job failed after 2 attempt(s); exit status 7" in err


def test_port_in_use_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        status = main(["launch", "-n", "2", "--port", str(port), _SLEEPER])
    err = capsys.readouterr().err
    assert status == 2
    assert f"Port {port} on 127.0.0.1 is already in use" in err and "--port" in err


@pytest.mark.multiprocess
def test_time_limit_ends_the_job_with_124(tmp_path: Path) -> None:
    launcher = _launcher(
        ["-n", "2", "--timeout", "1", "--max-restarts", "2", _SLEEPER, str(tmp_path)]
    )
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 124, err
    assert "ran past its time limit; stopping 2 task(s)" in err
    assert "restarting" not in err


def test_slurm_with_ps_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--slurm", "--ps", "1", "train.py"]) == 2
    assert "--ps is not supported" in capsys.readouterr().err


def test_missing_script_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "-n", "2"]) == 2
    assert "needs a script" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slurm", "--k8s", "--image", "me/train:1"], "--slurm and --k8s"),
        (["--print-sbatch"], "--print-sbatch writes a Slurm batch script"),
        (["-n", "2", "--port", "70000"], "--port is not a TCP port"),
        (["-n", "0"], "-n is invalid"),
        (["-n", "2", "--max-restarts", "-1"], "--max-restarts is invalid"),
    ],
)
def test_contradictory_or_impossible_options_are_refused_before_anything_starts(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *args, _SLEEPER]) == 2
    err = capsys.readouterr().err
    assert message in err and "Received:" in err and "Traceback" not in err


@pytest.mark.parametrize("what", ["missing", "folder"])
def test_a_missing_script_or_a_folder_is_refused_not_restarted(
    what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / ("train.py" if what == "missing" else "data")
    if what == "folder":
        path.mkdir()
    assert main(["launch", "-n", "2", "--max-restarts", "3", str(path)]) == 2
    err = capsys.readouterr().err
    expected = "does not exist" if what == "missing" else "is a folder without __main__.py"
    assert expected in err and str(path) in err
    assert "attempt" not in err  # nothing was started
