"""Process backend: one worker process per device, pinned to it, restarted when it dies.

Each worker is a fresh interpreter started through :mod:`tfscale.processes` (not ``fork``: a
forked TensorFlow runtime is not safe), talking over a :class:`~tfscale.processes.Channel`,
that sees only its GPU through ``CUDA_VISIBLE_DEVICES``. Tasks and results travel with
cloudpickle, so lambdas and closures work. A task that kills its process (``os._exit``,
SIGKILL, the OOM killer) fails its own future only; the worker is started again before its
next task. Every wait is bounded: a task past the pool's timeout has its process killed, and
closing waits at most a few seconds before killing. A worker dies with the pool's process,
even when that process is SIGKILLed (the process layer's guard).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import cloudpickle

from tfscale.processes import Channel, start
from tfscale.tasks.backends._child import READY
from tfscale.tasks.backends.base import (
    Backend,
    Call,
    RemoteTraceback,
    Runner,
    TimedOutError,
    WorkerLostError,
)
from tfscale.tasks.placement import child_environment, local_device, resolve_devices

__all__ = ["ProcessBackend"]

_CLOSE_WAIT_S = 5.0
# How long a worker may take to start (an interpreter and cloudpickle, on a loaded machine)
# before its task fails; the task's own timeout starts after it.
_START_WAIT_S = 120.0


class _Worker:
    """One child process and the channel to it."""

    def __init__(self, device: str) -> None:
        env = child_environment(device, os.environ)
        env["TFSCALE_TASK_DEVICE"] = device
        env["TFSCALE_TASK_LOCAL_DEVICE"] = local_device(device)
        # The child finds the same modules as this process (tasks pickled by reference).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self.channel, ends = Channel.pair()
        self.ready = False  # it has sent READY
        try:
            argv = [sys.executable, "-m", "tfscale.tasks.backends._child", *map(str, ends.fds)]
            self.child = start(argv, env=env, pass_fds=ends.fds, grace_s=_CLOSE_WAIT_S)
        except BaseException:
            self.channel.close()
            raise
        finally:
            ends.close()

    def kill(self) -> int:
        self.child.kill()
        return self._release(self.child.wait(_CLOSE_WAIT_S))

    def ended(self) -> int:
        """The exit code of a worker whose channel reached end of file: it is ending, and
        its guard reports how (waiting here keeps "exited with code 3" from reading as a
        kill by this process)."""
        code = self.child.wait(_CLOSE_WAIT_S)
        return self.kill() if code is None else self._release(code)

    def _release(self, code: int | None) -> int:
        self.child.close()
        self.channel.close()
        return -int(signal.SIGKILL) if code is None else code

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.channel.send(b"")
        if self.child.wait(_CLOSE_WAIT_S) is None:
            self.child.kill()
        self.child.close()
        self.channel.close()


class _ProcessRunner(Runner):
    def __init__(self, device: str) -> None:
        self.device = device
        self._worker: _Worker | None = _Worker(device)

    def run(self, call: Call, timeout: float | None) -> tuple[Any, float]:
        if self._worker is None or self._worker.child.poll() is not None:
            if self._worker is not None:
                self._worker.ended()
            self._worker = _Worker(self.device)
        worker = self._worker
        message = cloudpickle.dumps((call.fn, call.args, call.kwargs))
        try:
            if not worker.ready:
                # A worker started after its predecessor died, under load, can take seconds
                # to start: that is not the task's time (its timeout starts below).
                if not worker.channel.poll(_START_WAIT_S):
                    worker.kill()
                    self._worker = None
                    raise WorkerLostError(
                        f"its worker process (pid {worker.child.pid}) did not start within "
                        f"{_START_WAIT_S:g} s"
                    )
                if worker.channel.receive() != READY:
                    raise OSError("the worker's first message was not READY")
                worker.ready = True
            worker.channel.send(message)
            if not worker.channel.poll(timeout):
                worker.kill()
                self._worker = None
                raise TimedOutError(f"its worker process (pid {worker.child.pid}) was killed")
            reply = worker.channel.receive()
        except (EOFError, OSError):
            code = worker.ended()
            self._worker = None
            raise WorkerLostError(_exit_description(code)) from None
        outcome = cloudpickle.loads(reply)
        if outcome[0] == "ok":
            return outcome[1], float(outcome[2])
        error: BaseException = outcome[1]
        error.__cause__ = RemoteTraceback(outcome[2])
        raise error

    def interrupt(self) -> None:
        worker = self._worker
        if worker is not None:
            worker.child.kill()  # the call's wait ends at once (end of file)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (often the out-of-memory killer)" if name == "SIGKILL" else ""
        return f"its worker process was killed by {name}{hint}"
    return f"its worker process exited with code {code}"


class ProcessBackend(Backend):
    """Runs tasks in one pinned worker process per pool worker."""

    name = "process"
    enforces_timeout = True

    def devices(self, requested: Sequence[str] | None) -> list[str]:
        """Physical GPUs (a worker process pins a whole GPU), else the logical CPU devices.

        A GPU split into logical GPUs in this process is still one GPU to a worker process,
        which starts its own runtime, so ``/device:GPU:k`` here means CUDA device ``k``.
        """
        import tensorflow as tf

        gpus = [f"/device:GPU:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))]
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        return resolve_devices(requested, gpus + cpus)

    def runner(self, device: str) -> Runner:
        return _ProcessRunner(device)
