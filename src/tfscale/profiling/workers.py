"""``tfscale bench --workers N``: the measurement across N worker processes on this host.

Each worker is a child process with its own ``TF_CONFIG`` (``tfscale.cluster.tf_config``, free
ports on 127.0.0.1) that runs :func:`tfscale.profiling.bench.profile` as a cluster worker: one
``MultiWorkerMirroredStrategy`` per process (one replica each), whose gradient all-reduce
goes through TensorFlow's collective ops over gRPC, as between machines (loopback instead
of a network). This is what a second machine adds to a step, measured: unlike logical
devices of one process, where an all-reduce is a memory copy, here it really communicates.

Worker 0 hands its report back through a file in a private temporary directory. The parent
stops every worker's process group when one fails or the time runs out, so none is left
behind and a failure never hangs the others (which would wait in a collective).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from tfscale.errors import ProfileError, explain
from tfscale.profiling.report import Report, write_report
from tfscale.profiling.sweep import SweepPoint

__all__ = ["agree_points", "main", "model_spec", "profile_workers"]

_START_TIMEOUT_S = 120.0
_LOG_TAIL = 2000


def model_spec(model: str | Callable[[], Any]) -> str:
    """A spec the workers can import: the string itself, or ``module:function`` of a callable.

    Raises:
        ProfileError: The callable is not a module-level function (a lambda or a local one).
    """
    if isinstance(model, str):
        return model
    module = getattr(model, "__module__", None)
    name = getattr(model, "__qualname__", "")
    if not module or module == "__main__" or not name or "<" in name or "." in name:
        raise ProfileError(
            explain(
                "Worker processes must import the model builder, and this one cannot be "
                "imported by name.",
                received=f"{module}:{name}",
                allowed="mlp, cnn, 'module:function', or a function defined at module level "
                "in an importable module",
                fix="move the builder to a module and pass it (or 'module:function').",
            )
        )
    return f"{module}:{name}"


def profile_workers(
    model: str | Callable[[], Any],
    workers: int,
    *,
    settings: dict[str, Any],
    timeout_s: float = 900.0,
    out: str | None = None,
    progress: bool = True,
    dataset_fn: Callable[[Any], Any] | None = None,
) -> Report:
    """Runs ``profile(model, **settings)`` in ``workers`` cluster worker processes.

    Args:
        model: What to measure (see :func:`model_spec`).
        workers: Worker processes (one replica each), at least 2.
        settings: Keyword arguments of ``profile`` for every worker (no ``replicas``).
        timeout_s: Seconds before every worker is stopped.
        out: Directory for the report files (None: none).
        progress: Show a status line while the workers measure.
        dataset_fn: Not supported across processes (must be None).

    Returns:
        Worker 0's report.

    Raises:
        ProfileError: A worker failed or the time ran out (with the end of its log).
    """
    if workers < 2:
        raise ProfileError(explain("--workers needs at least 2 workers.", received=workers))
    if dataset_fn is not None:
        raise ProfileError(
            explain(
                "A dataset_fn cannot be sent to worker processes.",
                received="dataset_fn with workers > 1",
                fix="measure it over local devices (workers=1).",
            )
        )
    spec = model_spec(model)
    from tfscale.cluster import tf_config
    from tfscale.launch.ports import free_ports

    with tempfile.TemporaryDirectory(prefix="tfscale-workers-") as tmp:
        result = os.path.join(tmp, "report.pickle")
        addresses = [f"127.0.0.1:{port}" for port in free_ports(workers)]
        env = dict(os.environ)
        env.pop("TFSCALE_VIRTUAL_DEVICES", None)  # one replica per worker
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env["TFSCALE_WORKER_START_TIMEOUT"] = str(min(timeout_s, _START_TIMEOUT_S))
        # The workers import the model as this process would.
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
        payload = json.dumps({"model": spec, "settings": settings, "result": result})
        processes: list[subprocess.Popen[bytes]] = []
        logs = [os.path.join(tmp, f"worker-{index}.log") for index in range(workers)]
        try:
            for index, log in enumerate(logs):
                with open(log, "wb") as handle:
                    processes.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "tfscale.profiling.workers", payload],
                            env={**env, "TF_CONFIG": tf_config(addresses, index)},
                            stdout=handle,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            failed = _wait(processes, timeout_s, progress)
        finally:
            _stop(processes)
        if failed is not None:
            index, why = failed
            with open(logs[index], errors="replace") as handle:
                tail = handle.read()[-_LOG_TAIL:]
            raise ProfileError(
                explain(
                    f"Worker {index} of {workers} {why}.",
                    received=f"its output ends with:\n{tail}",
                    fix="run with workers=1 to check the model measures on one process, "
                    "or raise the timeout.",
                )
            )
        with open(result, "rb") as handle:
            report: Report = pickle.load(handle)  # written by our own worker 0 above
    note = (
        f"Measured across {workers} worker processes on 127.0.0.1 (MultiWorkerMirroredStrategy, "
        "one replica each): the all-reduce crosses processes through TensorFlow's collective "
        "ops over gRPC, as between machines, with loopback instead of a network."
    )
    report = dataclasses.replace(
        report,
        settings={**report.settings, "workers": workers},
        notes=[*report.notes, note],
    )
    if out:
        write_report(report, out)
    return report


def _wait(
    processes: Sequence[subprocess.Popen[bytes]], timeout_s: float, progress: bool
) -> tuple[int, str] | None:
    """Waits for every worker; returns ``(index, what went wrong)`` at the first failure."""
    deadline = time.monotonic() + timeout_s
    status: Any = None
    if progress:
        from rich.console import Console

        status = Console(stderr=True).status(f"{len(processes)} workers measuring")
        status.start()
    try:
        while True:
            codes = [p.poll() for p in processes]
            for index, code in enumerate(codes):
                if code not in (None, 0):
                    return index, f"exited with status {code}"
            if all(code == 0 for code in codes):
                return None
            if time.monotonic() > deadline:
                index = next(i for i, code in enumerate(codes) if code is None)
                return index, f"was still running after {timeout_s:g} s (stopped)"
            time.sleep(0.2)
    finally:
        if status is not None:
            status.stop()


def _stop(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kills the process group of every worker still running and reaps it."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def agree_points(points: Sequence[SweepPoint], strategy: Any) -> list[SweepPoint]:
    """Replaces each worker's timings by their mean over the cluster's workers.

    Every worker times the same synchronous steps, but each with its own clock and noise;
    advice and ``--verify`` must then build the same configurations on every worker (their
    variables are created with collective broadcasts, which fail or hang when workers
    diverge), so they all judge the same numbers: the cluster mean, identical bytes on
    every worker after one all-reduce.
    """
    import numpy as np
    import tensorflow as tf

    fields = ("step_s", "input_s", "compute_s", "communication_s")
    keys = [sorted(point.breakdown.extra) for point in points]
    values = [
        [getattr(point.breakdown, name) for name in fields]
        + [point.breakdown.extra[key] for key in extra]
        for point, extra in zip(points, keys, strict=True)
    ]
    flat = np.asarray([v for row in values for v in row], dtype=np.float64)
    per_replica = strategy.run(lambda: tf.constant(flat))
    mean = strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None).numpy()
    agreed, offset = [], 0
    for point, extra in zip(points, keys, strict=True):
        row = [float(v) for v in mean[offset : offset + len(fields) + len(extra)]]
        offset += len(row)
        step_s, input_s, compute_s, communication_s = row[: len(fields)]
        breakdown = dataclasses.replace(
            point.breakdown,
            step_s=step_s,
            input_s=input_s,
            compute_s=compute_s,
            communication_s=communication_s,
            extra=dict(zip(extra, row[len(fields) :], strict=True)),
        )
        agreed.append(dataclasses.replace(point, breakdown=breakdown))
    return agreed


def main(argv: Sequence[str] | None = None) -> int:
    """A worker: measure as one task of ``TF_CONFIG``'s cluster; worker 0 writes the report."""
    from tfscale.cluster import cluster_from_env
    from tfscale.profiling.bench import profile

    payload = json.loads((sys.argv[1:] if argv is None else argv)[0])
    report = profile(payload["model"], progress=False, **payload["settings"])
    cluster = cluster_from_env()
    if cluster is not None and cluster.task_index == 0:
        partial = payload["result"] + ".partial"
        with open(partial, "wb") as handle:
            pickle.dump(report, handle)
        os.replace(partial, payload["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
