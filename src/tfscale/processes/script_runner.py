"""A user's training script, run the one way ``doctor --script`` and ``tfscale profile`` share.

The parent (:func:`run_in_child`, no TensorFlow) starts a child module of tfscale through
:mod:`tfscale.processes` (own process group, dies with the parent, killed at the timeout).
The child prepares the devices (:func:`split_cpu_when_alone`) and runs the script
(:func:`run_as_main`) as ``python script.py args`` would::

    parent: run_in_child("tfscale.doctor.instrument", [events, script, *args], timeout=...)
    child:  split_cpu_when_alone()  ->  hooks of the child module  ->  run_as_main(script, args)

- the script runs as ``__main__`` with ``sys.argv = [script, *args]``;
- its folder is ``sys.path[0]``, so it imports its neighbours (``sub/train.py`` imports
  ``sub/data.py``), as Python itself does for ``python sub/train.py``;
- without a GPU and without ``TFSCALE_VIRTUAL_DEVICES``, the CPU is split into 2 logical
  devices first, so that a ``MirroredStrategy()`` in the script gets 2 replicas.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tfscale.errors import TfscaleError, explain
from tfscale.processes import start

__all__ = [
    "CPU_SPLIT",
    "DeviceLayout",
    "ScriptRun",
    "check_script",
    "run_as_main",
    "run_in_child",
    "split_cpu_when_alone",
]

#: Logical CPU devices a script gets when the machine has no GPU and it asked for none.
CPU_SPLIT = 2


# -- parent side (no TensorFlow) ----------------------------------------------------------------
@dataclass(frozen=True)
class ScriptRun:
    """How the child ended: its exit status (None when stopped at the timeout)."""

    status: int | None
    timed_out: bool


def check_script(
    path: str | None, *, command: str, error: type[TfscaleError] = TfscaleError
) -> str:
    """The script's path, checked to exist before any child starts.

    Args:
        path: The script as given, or None.
        command: How the user runs it, for the message (``"tfscale profile"``).
        error: The exception type to raise.

    Raises:
        TfscaleError: (or ``error``) No script, or not a file.
    """
    if not path:
        raise error(
            explain(
                f"{command} needs the script to run.",
                received="no script",
                allowed="a Python file followed by its own arguments",
                fix=f"{command} train.py --epochs 1",
            )
        )
    if not os.path.isfile(path):
        raise error(
            explain(
                "The script does not exist.",
                received=path,
                allowed="the path of a Python file, relative to the working directory",
                fix=f"check the path; the working directory is {os.getcwd()}",
            )
        )
    return path


def child_environment() -> dict[str, str]:
    """This process's environment, with tfscale importable from where this process found it."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # A crash in TensorFlow's C++ (a segfault) then prints every thread's Python stack: the
    # only clue a report can show for it (see the profiler's, tensorflow/tensorboard#3149).
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def run_in_child(
    module: str,
    args: Sequence[str],
    *,
    timeout: float | None = None,
    stdout: IO[Any] | None = None,
    stderr: IO[Any] | None = None,
    env: dict[str, str] | None = None,
) -> ScriptRun:
    """Runs ``python -m module args`` (a child module that ends in :func:`run_as_main`).

    Args:
        module: The child module, e.g. ``"tfscale.profiling.script"``.
        args: Its arguments (the script and the script's own arguments among them).
        timeout: Seconds before the child and its process group are killed (None: no limit).
        stdout: Where the child's stdout goes (None: inherited).
        stderr: Where the child's stderr goes (None: inherited).
        env: Variables set in the child's environment over this process's.

    Returns:
        The child's exit status, or ``timed_out``.
    """
    sys.stdout.flush()
    argv = [sys.executable, "-m", module, *args]
    with start(
        argv, env={**child_environment(), **(env or {})}, stdout=stdout, stderr=stderr
    ) as child:
        status = child.wait(timeout)
        if status is None:
            # SIGKILL, not SIGTERM: what the child wrote so far (flushed line by line) is the
            # result; a SIGTERM handler in the user's script must not delay it.
            child.kill()
            child.wait()
            return ScriptRun(None, True)
    return ScriptRun(status, False)


# -- child side ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceLayout:
    """The devices the script was given.

    Attributes:
        virtual: ``TFSCALE_VIRTUAL_DEVICES`` as the script sees it, or None.
        set_by_runner: True when the runner split the CPU (no GPU, nothing asked).
        gpus: Physical GPUs TensorFlow sees.
    """

    virtual: str | None
    set_by_runner: bool
    gpus: int


def split_cpu_when_alone() -> DeviceLayout:
    """Splits the CPU into :data:`CPU_SPLIT` logical devices unless there is a GPU or the
    user chose a layout (``TFSCALE_VIRTUAL_DEVICES``, which ``import tfscale`` applied).

    Starts TensorFlow's device listing, not its runtime: the script can still configure it.
    """
    import tensorflow as tf

    from tfscale.devices.discovery import use_virtual_devices
    from tfscale.devices.virtual import ENV_VAR

    requested = os.environ.get(ENV_VAR, "").strip()
    gpus = len(tf.config.list_physical_devices("GPU"))
    if requested or gpus:
        return DeviceLayout(requested or None, False, gpus)
    # Exported too, so a script that imports tfscale asks for the same layout.
    os.environ[ENV_VAR] = str(CPU_SPLIT)
    use_virtual_devices(CPU_SPLIT)
    return DeviceLayout(str(CPU_SPLIT), True, 0)


def run_as_main(
    path: str,
    argv: Sequence[str],
    on_error: Callable[[BaseException], None] | None = None,
) -> int:
    """Runs the script as ``python path argv...`` would (``path`` ``"-m"``: the module named
    by ``argv[0]``, as ``python -m``); returns its exit status.

    An exception the script does not catch is printed with its traceback (status 1), so
    the caller can still write what it observed. ``on_error`` sees it first: raising
    ``SystemExit`` there ends the run with that status instead (an explained failure,
    without the traceback).
    """
    if path == "-m":
        # ``-m module args``, as ``python -m`` takes it (tfscale's own workers run this way).
        if not argv:
            print("-m needs a module name", file=sys.stderr)
            return 2
        module, argv = argv[0], argv[1:]
        sys.argv = [module, *argv]
        sys.path[0] = os.getcwd()
        run: Callable[[], object] = lambda: runpy.run_module(  # noqa: E731
            module, run_name="__main__", alter_sys=True
        )
    else:
        sys.argv = [path, *argv]
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        run = lambda: runpy.run_path(path, run_name="__main__")  # noqa: E731
    try:
        run()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return int(stop.code or 0)
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException as error:
        if on_error is not None:
            try:
                on_error(error)
            except SystemExit as stop:
                return int(stop.code) if isinstance(stop.code, int) else 1
        traceback.print_exc()
        return 1
    return 0
