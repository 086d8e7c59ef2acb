"""``tfscale doctor`` as a user runs it: a fresh process, its output and exit status."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tfscale.cli.main import build_parser, main
from tfscale.doctor.checks import CHECKS
from tfscale.doctor.snapshot import Snapshot
from tfscale.testing import run_python

from .fakes import H100_XML

_DOCTOR = "import sys; from tfscale.cli.main import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.multiprocess
@pytest.mark.full(
    "tests/doctor/test_cli.py::"
    "test_doctor_finds_the_cpu_wheel_on_a_machine_whose_driver_lists_four_h100",
)
def test_doctor_json_in_a_fresh_process() -> None:
    # TF_CPP_MIN_LOG_LEVEL unset, as for a user: TensorFlow's start-up chatter stays off.
    result = run_python(
        _DOCTOR, args=["doctor", "--json"], env={"TF_CPP_MIN_LOG_LEVEL": ""}, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr == "", result.stderr[-2000:]
    document = json.loads(result.stdout)
    snapshot = Snapshot.from_dict(document["snapshot"])
    assert snapshot.tensorflow_version
    assert len(document["checks"]) == len(CHECKS)
    assert all(c["status"] in ("ok", "warn") for c in document["checks"])


@pytest.mark.multiprocess
@pytest.mark.full(
    "tests/doctor/test_cli.py::"
    "test_doctor_finds_the_cpu_wheel_on_a_machine_whose_driver_lists_four_h100",
)
def test_doctor_fails_on_a_broken_tf_config() -> None:
    broken = '{"cluster": {"worker": ["localhost:2222"]}, "task": {"type": "worker", "index": 3}}'
    result = run_python(_DOCTOR, args=["doctor"], env={"TF_CONFIG": broken}, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    assert "\x1b" not in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("| tf-config"))
    assert "FAIL" in row


def test_script_option_takes_the_rest_of_the_command_line() -> None:
    args = build_parser().parse_args(
        ["doctor", "--json", "--timeout", "60", "--script", "train.py", "--epochs", "3", "--json"]
    )
    assert args.json is True and args.timeout == 60.0
    assert args.script == ["train.py", "--epochs", "3", "--json"]
    assert build_parser().parse_args(["doctor"]).script is None


def test_script_option_without_a_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--script"]) == 2
    assert "--script needs a script" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_doctor_finds_the_cpu_wheel_on_a_machine_whose_driver_lists_four_h100(
    tmp_path: Path,
) -> None:
    # The real tensorflow-cpu wheel of this machine, with a driver faked by an nvidia-smi
    # that prints the 4x H100 sample (NVML is absent here, so the doctor falls back to it).
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat '{H100_XML}'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    result = run_python(_DOCTOR, args=["doctor", "--json"], env={"PATH": path}, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    document = json.loads(result.stdout)
    assert document["snapshot"]["driver_source"] == "nvidia-smi"
    assert len(document["snapshot"]["driver_gpus"]) == 4
    failed = {c["name"] for c in document["checks"] if c["status"] == "fail"}
    assert failed == {"cpu-only-build", "gpu-visibility"}
