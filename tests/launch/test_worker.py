"""The worker runner (``launch/worker.py``) in a real process: a port taken between the
launcher's choice and the worker's start."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from tfscale.launch.ports import free_ports
from tfscale.launch.together import PORT_TAKEN_STATUS
from tfscale.processes import run

pytestmark = pytest.mark.multiprocess

_SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_a_worker_whose_port_was_taken_exits_for_a_start_on_new_ports(tmp_path: Path) -> None:
    """Another program listens on the port TF_CONFIG gives worker 0: its gRPC server cannot
    start, and the worker exits with PORT_TAKEN_STATUS (the supervisor then starts the job
    again on new ports, not counting a restart: test_supervisor.py), not with 78 ("would not
    train with the others", which ends the job)."""
    script = tmp_path / "train.py"
    script.write_text("import tfscale\ntfscale.choose_strategy()\nprint('built')\n")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cluster = {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{free_ports(1)[0]}"]}
        env = dict(
            os.environ,
            PYTHONPATH=_SRC,
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}),
            TFSCALE_LAUNCH_TASK="worker 0",
        )
        env.pop("TFSCALE_VIRTUAL_DEVICES", None)
        done = run(
            [sys.executable, "-m", "tfscale.launch.worker", str(script)], timeout=120, env=env
        )
    assert not done.timed_out
    assert done.returncode == PORT_TAKEN_STATUS, done.stdout + done.stderr[-3000:]
    assert "worker 0: its gRPC server could not listen on the port chosen for it" in done.stderr
    assert "built" not in done.stdout
