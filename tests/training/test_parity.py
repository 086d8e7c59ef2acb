"""The parity suite: every case of ``tests/training/parity`` trained by ``tfscale.fit`` over 2
logical CPUs (MirroredStrategy) against one-device ``model.fit`` (see ``parity/registry.py``
for what is compared and with which tolerance)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from .helpers import strategy_for
from .parity import CASES
from .parity.registry import Case, Run, exact_checks, run_case, run_reference

TESTS = Path(__file__).resolve().parents[1]


def _param(case: Case) -> object:
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_tfscale_fit_matches_one_device_model_fit(case: Case) -> None:
    run_case(case, strategy_for(2))


# -- the same cases across 2 worker processes ----------------------------------------------------
MULTIWORKER_CASES = (
    "fit_flow_arrays",
    "fit_with_val_split",
    "steps_per_epoch_infinite_dataset",
    "loss_weights_dict_outputs",
    "custom_compute_loss",
    "class_weight",
    "early_stopping_min_delta",
    "gradient_accumulation_adam",
)

_WORKER = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
import tfscale
from training.parity import CASES
from training.parity.registry import _arguments

cases = {case.name: case for case in CASES}
report = {}
weights = {}
for name in sys.argv[3].split(","):
    case = cases[name]
    with strategy.scope():
        model = case.build()
    history = tfscale.fit(model, strategy=strategy, **_arguments(case.fit), **case.options)
    report[name] = {
        "history": history.history,
        "epoch": history.epoch,
        "iterations": int(model.optimizer.iterations.numpy()),
    }
    weights.update({f"{name}/{i}": w for i, w in enumerate(model.get_weights())})
np.savez(sys.argv[1] + ".npz", **weights)
with open(sys.argv[1] + ".json", "w") as handle:
    json.dump(report, handle)
"""


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _run_workers(tmp_path: Path, names: tuple[str, ...], timeout: float = 300.0) -> None:
    cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(2)]}
    processes = []
    for index in range(2):
        env = dict(os.environ)
        env.pop("TFSCALE_VIRTUAL_DEVICES", None)
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        argv = [sys.executable, "-c", _WORKER, str(tmp_path / f"w{index}"), str(TESTS)]
        processes.append(
            subprocess.Popen(
                [*argv, ",".join(names)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    failed = [
        err[-3000:]
        for process, (_, err) in zip(processes, outputs, strict=True)
        if process.returncode != 0
    ]
    assert not failed, "\n---\n".join(failed)


class _Trained:
    """A worker's trained model as the checks read it."""

    def __init__(self, weights: list[np.ndarray], iterations: int) -> None:
        self.weights = weights
        count = types.SimpleNamespace(numpy=lambda: iterations)
        self.optimizer = types.SimpleNamespace(iterations=count)

    def get_weights(self) -> list[np.ndarray]:
        return self.weights


def test_cases_across_two_worker_processes_match_one_device(tmp_path: Path) -> None:
    """8 cases trained by 2 worker processes (MultiWorkerMirroredStrategy, one CPU each)."""
    cases = {case.name: case for case in CASES}
    _run_workers(tmp_path, MULTIWORKER_CASES)
    for index in range(2):
        report = json.loads((tmp_path / f"w{index}.json").read_text())
        weights = np.load(tmp_path / f"w{index}.npz")
        for name in MULTIWORKER_CASES:
            case = cases[name]
            expected = run_reference(case)
            trained = [weights[f"{name}/{i}"] for i in range(len(expected.initial_weights))]
            history = types.SimpleNamespace(
                history=report[name]["history"], epoch=report[name]["epoch"]
            )
            got = Run(
                _Trained(trained, report[name]["iterations"]),
                history,
                {},
                expected.initial_weights,
            )
            for check in exact_checks(case):
                check(expected, got)
