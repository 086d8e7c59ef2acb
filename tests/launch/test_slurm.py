"""Slurm without a cluster: the sbatch template's text, and one task turned into one worker
with its TF_CONFIG from a faked environment, for what one node cannot show (several nodes,
GPUs per node). A real one-node cluster runs the jobs in test_slurm_cluster.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tfscale.cli.main import main
from tfscale.errors import LaunchError
from tfscale.launch.slurm import sbatch_script, slurm_task_env

_SRC = str(Path(__file__).resolve().parents[2] / "src")


def _directives(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(r"#SBATCH --([a-z-]+)=(\S+)", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


@pytest.mark.multiprocess
def test_print_sbatch_fields(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        [
            "launch",
            "--slurm",
            "--print-sbatch",
            "--nodes",
            "2",
            "--tasks-per-node",
            "4",
            "--gpus-per-node",
            "4",
            "--time",
            "02:00:00",
            "--name",
            "resnet",
            "--max-restarts",
            "2",
            "train.py",
            "--epochs",
            "3",
        ]
    )
    assert status == 0
    text = capsys.readouterr().out
    assert text.startswith("#!/bin/bash\n")
    assert _directives(text) == {
        "job-name": "resnet",
        "nodes": "2",
        "ntasks-per-node": "4",
        "gpus-per-node": "4",
        "time": "02:00:00",
        "output": "resnet-%j.out",
    }
    (srun,) = [line.strip() for line in text.splitlines() if line.strip().startswith("srun ")]
    assert srun == (
        "srun --kill-on-bad-exit=1 tfscale launch --slurm --port 8888 train.py --epochs 3 && exit 0"
    )
    assert "MAX_RESTARTS=2" in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True, timeout=30)


def test_sbatch_without_gpus_leaves_the_line_out() -> None:
    text = sbatch_script(["t.py"], nodes=1)
    assert "gpus-per-node" not in text and _directives(text)["nodes"] == "1"


@pytest.mark.parametrize(
    ("kwargs", "option"), [({"nodes": 0}, "--nodes"), ({"tasks_per_node": 0}, "--tasks-per-node")]
)
def test_sbatch_rejects_bad_counts(kwargs: dict[str, int], option: str) -> None:
    args: dict[str, int] = {"nodes": 1} | kwargs
    with pytest.raises(LaunchError, match=option):
        sbatch_script(["t.py"], **args)


@pytest.mark.multiprocess
def test_slurm_task_execs_the_script_with_its_tf_config(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'tf_config': json.loads(os.environ['TF_CONFIG']), 'argv': sys.argv[1:],"
        " 'pid': os.getpid()}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TF_CONFIG"))} | {
        "PYTHONPATH": _SRC,
        "SLURM_PROCID": "3",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    }
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tfscale.cli.main",
            "launch",
            "--slurm",
            "--port",
            "9000",
            str(script),
            "--lr",
            "0.1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    shown = json.loads(out)
    assert shown["pid"] == launcher.pid  # exec: the script replaced the launcher
    assert shown["argv"] == ["--lr", "0.1"]
    assert shown["tf_config"] == {
        "cluster": {"worker": ["gpu07:9000", "gpu07:9001", "gpu08:9000", "gpu08:9001"]},
        "task": {"type": "worker", "index": 3},
    }


@pytest.mark.multiprocess
def test_slurm_task_outside_slurm_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = _SRC
    done = subprocess.run(
        [sys.executable, "-m", "tfscale.cli.main", "launch", "--slurm", "t.py"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "SLURM_PROCID" in done.stderr and "srun" in done.stderr


_TWO_PER_NODE = {
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "gpu[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


@pytest.mark.parametrize(
    ("rank", "visible", "expected"),
    [
        ("2", "0,1,2,3", "0,1"),  # first task on gpu2
        ("3", "0,1,2,3", "2,3"),  # second task on gpu2
        ("1", "0,1", "1"),
        ("1", "5", "5"),  # Slurm bound one GPU per task already (--gpus-per-task)
    ],
)
def test_slurm_tasks_on_one_node_get_their_own_gpus(rank: str, visible: str, expected: str) -> None:
    env = _TWO_PER_NODE | {"SLURM_PROCID": rank, "CUDA_VISIBLE_DEVICES": visible}
    out = slurm_task_env(env, list_gpus=lambda: "")
    assert out["CUDA_VISIBLE_DEVICES"] == expected
    assert out["TFSCALE_WORKER_DEVICE_KINDS"] == "GPU"
    assert json.loads(out["TF_CONFIG"])["task"] == {"type": "worker", "index": int(rank)}


def test_slurm_task_without_gpus_is_a_cpu_worker() -> None:
    out = slurm_task_env(_TWO_PER_NODE | {"SLURM_PROCID": "0"}, list_gpus=lambda: "")
    assert "CUDA_VISIBLE_DEVICES" not in out
    assert out["TFSCALE_WORKER_DEVICE_KINDS"] == "CPU"
