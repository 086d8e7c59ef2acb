"""``tfscale bench --workers N``: the measurement across N worker processes on this host.

The workers are a local job of the launcher (:func:`tfscale.launch.local.run_local_job`: free
ports on 127.0.0.1, one ``TF_CONFIG`` each, one GPU block each where there are GPUs, every
worker stopped when one fails or the time runs out, none outliving this process). Each runs
:mod:`tfscale.profiling.worker`: one ``MultiWorkerMirroredStrategy`` per process (one replica
each), whose gradient all-reduce goes through TensorFlow's collective ops over gRPC, as
between machines (loopback instead of a network). This is what a second machine adds to a
step, measured: unlike logical devices of one process, where an all-reduce is a memory copy,
here it really communicates.

Worker 0 hands its report back through a file in a private temporary directory; each
worker's output goes to its own log file, whose end a failure shows. This module imports no
TensorFlow and nothing of ``bench``: the workers do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from tfscale.errors import ProfileError, explain
from tfscale.launch.gpus import visible_gpus
from tfscale.launch.local import log_path, run_local_job
from tfscale.launch.plan import LocalJob
from tfscale.launch.supervisor import JobResult
from tfscale.profiling.report import Report, write_report

__all__ = ["WORKER_MODULE", "model_spec", "profile_workers"]

WORKER_MODULE = "tfscale.profiling.worker"
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
    """Runs the measurement of ``profile(model, **settings)`` in ``workers`` cluster workers.

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
    with tempfile.TemporaryDirectory(prefix="tfscale-workers-") as tmp:
        result = os.path.join(tmp, "report.pickle")
        payload = json.dumps({"model": spec, "settings": settings, "result": result})
        env = _worker_environment(timeout_s)
        gpus = visible_gpus(env)
        job = LocalJob(
            script=("-m", WORKER_MODULE, payload),
            workers=workers,
            # One GPU each where there are enough; else every worker on its CPU (a GPU
            # shared by two MultiWorkerMirrored workers would measure contention).
            gpus_per_worker=None if len(gpus) >= workers else 0,
        )
        messages: list[str] = []
        with _status(progress, f"{workers} workers measuring"):
            done = run_local_job(
                job, timeout_s=timeout_s, base_env=env, output_dir=tmp, log=messages.append
            )
        if done.exit_code != 0:
            raise _worker_failure(done, workers, timeout_s, tmp)
        with open(result, "rb") as handle:
            report: Report = pickle.load(handle)  # written by our own worker 0
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


def _worker_environment(timeout_s: float) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TFSCALE_VIRTUAL_DEVICES", None)  # one replica per worker
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["TFSCALE_WORKER_START_TIMEOUT"] = str(min(timeout_s, _START_TIMEOUT_S))
    # The workers import the model as this process would.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
    return env


def _worker_failure(done: JobResult, workers: int, timeout_s: float, logs: str) -> ProfileError:
    failure = done.failures[-1]
    if failure.timed_out:
        label, why = "worker 0", f"was still running after {timeout_s:g} s (stopped)"
    else:
        label, why = failure.label, f"exited with status {done.exit_code}"
    try:
        with open(log_path(logs, label), errors="replace") as handle:
            tail = handle.read()[-_LOG_TAIL:]
    except OSError:
        tail = "(no output)"
    index = label.rsplit(" ", 1)[-1]
    return ProfileError(
        explain(
            f"Worker {index} of {workers} {why}.",
            received=f"its output ends with:\n{tail}",
            fix="run with workers=1 to check the model measures on one process, "
            "or raise the timeout.",
        )
    )


@contextlib.contextmanager
def _status(enabled: bool, text: str) -> Iterator[None]:
    if not enabled:
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield
