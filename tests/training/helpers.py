"""Shared pieces of the training tests: strategies over the session's logical CPUs, tiny
seeded models and data, and a hand-written single-device reference loop.

In-process MirroredStrategies use ReductionToOneDevice: TensorFlow's collective all-reduce
keys its groups per strategy object, and two strategies over different device sets in one
process then join the same group key with different sizes ("joining a group with size 4,
but that group has size 2"). The default collective path is exercised in the worker-process
tests instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfscale.launch.ports import free_ports
from tfscale.testing import mirrored_on_cpus
from tfscale.workloads import build_model, synthetic_classification

FEATURES, CLASSES = 12, 4


def strategy_for(n: int) -> tf.distribute.Strategy:
    """OneDevice on CPU:0 for ``n == 0``, else the shared Mirrored over ``n`` logical CPUs."""
    if n == 0:
        return _ONE_DEVICE
    return mirrored_on_cpus(n)


_ONE_DEVICE = tf.distribute.OneDeviceStrategy("/device:CPU:0")


DATA = synthetic_classification(256, FEATURES, CLASSES, seed=7)


class NoCallModel(keras.Model):  # type: ignore[misc]
    """A model without ``call`` whose ``train_step`` drives a sub-model (keras-io's GAN and
    VAE shape), trained on ``(x, y)`` with a mean squared error."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.inner(x) - y))
        grads = tape.gradient(loss, self.inner.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.inner.trainable_weights, strict=True))
        return {"loss": loss}


def tiny_model(
    strategy: tf.distribute.Strategy | None, optimizer: str = "sgd", lr: float = 0.1, **kw: Any
) -> keras.Model:
    """The same tiny compiled MLP every time (fixed initialiser seeds)."""
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        return build_model(
            "mlp",
            input_shape=(FEATURES,),
            classes=CLASSES,
            width=4,
            optimizer=optimizer,
            learning_rate=lr,
            **kw,
        )


def batches(x: np.ndarray, y: np.ndarray, batch: int) -> tf.data.Dataset:
    """A batched, unshuffled dataset (the order every run and the reference see)."""
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def reference_weights(
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch: int,
    steps: int,
    optimizer: str = "sgd",
    global_clipnorm: float | None = None,
    lr: float = 0.1,
    epochs: int = 1,
) -> list[np.ndarray]:
    """Plain single-device training: mean loss of each batch, one optimizer step per batch.

    Each epoch goes over the first ``steps`` batches of ``x`` in order (the last may be short).
    """
    with tf.device("/device:CPU:0"):
        model = tiny_model(None, optimizer, lr=lr)
        for step in [s for _ in range(epochs) for s in range(steps)]:
            xb = x[step * batch : (step + 1) * batch]
            yb = y[step * batch : (step + 1) * batch]
            with tf.GradientTape() as tape:
                loss = model.compute_loss(x=xb, y=yb, y_pred=model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            if global_clipnorm is not None:
                grads, _ = tf.clip_by_global_norm(grads, global_clipnorm)
            model.optimizer.apply(grads, model.trainable_variables)
        return model.get_weights()


#: How a worker's code for :func:`run_workers` starts: ``out`` (its output path prefix), the
#: tests folder importable, ``strategy`` (MultiWorkerMirrored), Keras, tfscale, this module's
#: ``DATA`` as ``x, y``, and an empty ``report`` (but the replica count) and ``weights``.
WORKER_PRELUDE = """
import json, os, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
out = sys.argv[1]
import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
import keras, tfscale
from training.helpers import DATA, batches, tiny_model

x, y = DATA
report = {"replicas": strategy.num_replicas_in_sync}
weights = {}
"""


def run_workers(code: str, args: list[str], workers: int = 2, timeout: float = 300.0) -> list[str]:
    """Runs ``python -c code OUT_PREFIX+i *args`` as ``workers`` MultiWorkerMirrored workers
    (one ``TF_CONFIG`` each on 127.0.0.1, one CPU device each) and returns their stdouts.

    ``args[0]`` is a path prefix: worker i gets ``f"{args[0]}{i}"`` in its place. Every worker
    runs in its own session and is killed with its group at the timeout; a worker that fails
    fails the test with the end of its stderr.
    """
    import json
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(workers)]}
    processes = []
    for index in range(workers):
        env = dict(os.environ)
        env.pop("TFSCALE_VIRTUAL_DEVICES", None)
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        argv = [sys.executable, "-c", textwrap.dedent(code), f"{args[0]}{index}", *args[1:]]
        processes.append(
            subprocess.Popen(
                argv,
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
    return [out for out, _ in outputs]


def launch(job: Path, args: list[str], timeout: float) -> Any:
    """Runs ``tfscale launch -n 2 JOB ARGS`` (2 local workers, this checkout's ``src``) with
    the launcher's own ``--timeout`` and a little more for the command; fails the test with
    the end of its stderr where it fails. Returns the completed process (text output)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    for name in ("TF_CONFIG", "TFSCALE_VIRTUAL_DEVICES"):
        env.pop(name, None)
    command = [sys.executable, "-m", "tfscale.cli.main", "launch", "-n", "2"]
    done = subprocess.run(
        [*command, "--timeout", str(int(timeout)), str(job), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout + 60,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def equivalent_id(equivalent: str, test: str, full: dict[str, str] | None = None) -> str:
    """A ``full`` test's ``make test`` equivalent as a node id: ``equivalent`` itself where it
    is one, else a parameter id of ``test``; where that parameter is in ``full`` too (a path
    whose own test moved to ``make test-full``, naming its feature's), the one it names, in
    turn."""
    seen = {equivalent}
    while full and "::" not in equivalent and equivalent in full:
        equivalent = full[equivalent]
        if equivalent in seen:
            raise ValueError(f"{test}: the full table's equivalents go round: {sorted(seen)}")
        seen.add(equivalent)
    return equivalent if "::" in equivalent else f"{test}[{equivalent}]"


def tiered(
    values: list[Any], full: dict[str, str], test: str, ids: list[str] | None = None
) -> list[Any]:
    """``values`` (named ``ids``, by default the values themselves; a tuple holds one value
    per argument name) as ``test``'s parameters: those ``full`` maps run in ``make
    test-full`` (the ``full`` marker, tests/README.md), each naming its ``make test``
    equivalent: another of ``ids`` (which may be in ``full`` too: its own equivalent, in
    turn), or a whole node id."""
    import pytest

    params = []
    for value, name in zip(values, ids or [str(v) for v in values], strict=True):
        arguments = value if isinstance(value, tuple) else (value,)
        marks = [pytest.mark.full(equivalent_id(full[name], test, full))] if name in full else []
        params.append(pytest.param(*arguments, id=name, marks=marks))
    return params
