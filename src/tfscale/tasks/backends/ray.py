"""Ray backend: each task is a ``ray.remote(num_gpus=...)`` task, so a pool spans a Ray cluster.

The pool's scheduling stays the same: each of its workers pulls the next task and submits it
as one Ray task asking for one GPU (or one CPU for a CPU device), and waits for it, so at most
one task per worker is in flight and Ray places it on any node with a free GPU. Ray sets
``CUDA_VISIBLE_DEVICES`` for the task, so inside it TensorFlow sees its GPU as
``/device:GPU:0``. Needs the optional extra: ``pip install "tfscale[ray]"``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from tfscale.devices.names import default_devices, normalize_device
from tfscale.errors import TaskError, explain
from tfscale.tasks.backends.base import Backend, Call, Runner, TimedOutError, WorkerLostError
from tfscale.tasks.placement import local_device

__all__ = ["RayBackend", "import_ray"]


def import_ray() -> Any:
    """Imports ray, or says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise TaskError(
            explain(
                'backend="ray" needs Ray, which is not installed.',
                received='TaskPool(backend="ray")',
                allowed='backend="thread" or "process" without Ray',
                fix='pip install "tfscale[ray]"',
            )
        ) from error
    return ray


def _remote_call(call: Call, device: str, local: str) -> tuple[Any, float]:
    """Runs in a Ray worker: the call under its device, with ``current_device()`` set."""
    import sys

    from tfscale.tasks.context import running_on

    with running_on(device):
        if "tensorflow" in sys.modules:
            import tensorflow as tf

            with tf.device(local):
                start = time.perf_counter()
                return call.fn(*call.args, **call.kwargs), time.perf_counter() - start
        start = time.perf_counter()
        return call.fn(*call.args, **call.kwargs), time.perf_counter() - start


def _lost_errors(ray: Any) -> tuple[type[BaseException], ...]:
    """Ray's errors for a worker that died (OutOfMemoryError exists from Ray 2.3 on)."""
    names = ("WorkerCrashedError", "OutOfMemoryError", "NodeDiedError", "LocalRayletDiedError")
    return tuple(getattr(ray.exceptions, n) for n in names if hasattr(ray.exceptions, n))


class _RayRunner(Runner):
    def __init__(self, device: str, ray: Any) -> None:
        self.device = device
        self._ray = ray
        gpus = 1 if ":GPU:" in device else 0
        self._remote = ray.remote(num_gpus=gpus, num_cpus=0 if gpus else 1, max_retries=0)(
            _remote_call
        )

    def run(self, call: Call, timeout: float | None) -> tuple[Any, float]:
        ray = self._ray
        ref = self._remote.remote(call, self.device, local_device(self.device))
        try:
            result, seconds = ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            raise TimedOutError("its Ray task was cancelled") from None
        except ray.exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from error
            raise
        except _lost_errors(ray) as error:
            raise WorkerLostError(f"its Ray worker died: {type(error).__name__}") from None
        return result, float(seconds)


class RayBackend(Backend):
    """Runs tasks as Ray tasks; starts a local Ray if none is running."""

    name = "ray"
    enforces_timeout = True

    def __init__(self) -> None:
        self._ray = import_ray()
        if not self._ray.is_initialized():
            # Ray pickles a function by reference to its module, and a local Ray's workers
            # start with the interpreter's default sys.path: a task defined in the user's
            # script directory or test package fails with "No module named ...". The
            # workers of a Ray we start run on this machine, so they get our sys.path. On an
            # existing cluster, ship code with Ray's own runtime_env (working_dir/py_modules).
            path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
            self._ray.init(
                ignore_reinit_error=True,
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": path}},
            )
            self._started = True
        else:
            self._started = False

    def devices(self, requested: Sequence[str] | None) -> list[str]:
        """``requested`` as given, or one device per GPU of the cluster (per CPU without GPUs).

        Requested names are not checked against the cluster's resources: a Ray cluster may
        grow, and a CPU "device" here is a slot of one CPU that Ray queues when busy.
        """
        if requested is not None:
            names = [requested] if isinstance(requested, str) else list(requested)
            return [normalize_device(name) for name in names]
        resources = self._ray.cluster_resources()
        available = [f"/device:GPU:{i}" for i in range(int(resources.get("GPU", 0)))]
        available += [f"/device:CPU:{i}" for i in range(max(1, int(resources.get("CPU", 1))))]
        return default_devices(available)

    def runner(self, device: str) -> Runner:
        return _RayRunner(device, self._ray)

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()
