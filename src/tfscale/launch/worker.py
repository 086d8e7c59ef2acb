"""The process that runs the user's script in each script task of ``tfscale launch``.

``python -m tfscale.launch.worker SCRIPT ARGS...`` (or ``-m MODULE ARGS...``) runs the script
as ``python SCRIPT ARGS`` would (``script_runner.run_as_main``), made strict
(``launch/together.py``):

- ``tfscale.choose_strategy`` raises instead of falling back to one device
  (``TFSCALE_STRICT_STRATEGY``), e.g. when the script ran a TensorFlow op before it;
- a strategy that spans fewer workers than the job (``MirroredStrategy()``), a ``model.fit``
  under no strategy, or a script that updates weights (a Keras optimizer's ``apply``) without
  ever building a multi-worker strategy stops the worker with exit status 78 and a
  :class:`~tfscale.launch.together.Verdict` for the launcher (the hooks go in when the script
  imports TensorFlow: a script that never does is not judged);
- Keras's ``model.fit`` failing under MultiWorkerMirroredStrategy ("Attempt to convert a
  value (PerReplica...)", keras-team/keras#20585) is answered with the one-line fix;
- a gRPC server that cannot listen on the port TF_CONFIG gives the worker (taken since the
  launcher chose it) ends the worker with exit status 75, which the launcher answers by
  starting the job again on new ports (``together.PORT_TAKEN_STATUS``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from tfscale.cluster.notes import REPORT_ENV
from tfscale.launch.together import (
    LABEL_ENV,
    NOT_TOGETHER_STATUS,
    PORT_TAKEN_STATUS,
    Verdict,
    alone_reason,
    write_verdict,
)

__all__ = ["STRICT_ENV", "main"]

#: ``choose_strategy`` raises instead of falling back while this is "1" (strategy/choice.py).
STRICT_ENV = "TFSCALE_STRICT_STRATEGY"

_FIX_STRATEGY = (
    "build the strategy first thing in the script with tfscale.choose_strategy() (it reads "
    "the TF_CONFIG tfscale launch gives each worker) or "
    "tf.distribute.MultiWorkerMirroredStrategy(), and the model inside its scope"
)
_FIX_KERAS_FIT = (
    "add `model = tfscale.prepare(model)` before model.fit (one line: Keras's own fit then "
    "trains across the workers), or train with tfscale.fit(model, ...)"
)


class _Job:
    def __init__(self) -> None:
        from tfscale.cluster import cluster_from_env

        cluster = cluster_from_env()
        self.label = os.environ.get(LABEL_ENV, "worker")
        self.workers = 1 if cluster is None else cluster.num_workers
        self.parameter_servers = cluster is not None and cluster.num_ps > 0
        self.together = False
        self.trained = False

    def stop(self, reason: str, fix: str) -> None:
        verdict = Verdict(self.label, reason, fix)
        folder = os.environ.get(REPORT_ENV)
        if folder:
            # A folder this node does not see (an sbatch job's submit folder that is not
            # shared) loses the file only: the line below and status 78 remain.
            with contextlib.suppress(OSError):
                write_verdict(folder, verdict)
        print(f"tfscale launch: {self.label}: {reason}. Fix: {fix}", file=sys.stderr, flush=True)
        raise SystemExit(NOT_TOGETHER_STATUS)

    def built(self, strategy: Any) -> None:
        from tfscale.strategy.current import num_workers

        reason = alone_reason(
            type(strategy).__name__, num_workers(strategy), self.workers, self.parameter_servers
        )
        if reason is not None:
            self.stop(reason, _FIX_STRATEGY)
        self.together = True

    def watch(self) -> None:
        """Hooks strategies once TensorFlow is imported, ``Model.fit`` and optimizer updates
        once Keras is (a script that never imports them, or trains nothing, is not judged)."""
        from tfscale.interop.script_watch import watch_strategies
        from tfscale.runtime import tf_import

        tf_import.on_import(lambda: watch_strategies(built=self.built))
        tf_import.on_keras_import(self.watch_fit)
        tf_import.on_keras_import(self.watch_updates)

    def watch_updates(self) -> None:
        import keras

        from tfscale.interop import registry

        def watch(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def apply(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                self.trained = True
                return original(optimizer, *args, **kwargs)

            return apply

        owner = next(c for c in keras.optimizers.Optimizer.__mro__ if "apply" in vars(c))
        registry.install("script-watch", owner, "apply", watch)

    def watch_fit(self) -> None:
        import tensorflow as tf

        from tfscale.interop.script_watch import watch_fits

        def called(model: Any, arguments: dict[str, Any]) -> None:
            if not tf.distribute.has_strategy() and model.distribute_strategy is (
                tf.distribute.get_strategy()
            ):
                self.stop(
                    "model.fit ran under no distribution strategy (the model was not built "
                    "in a multi-worker strategy's scope), so it trained alone",
                    _FIX_STRATEGY,
                )

        watch_fits(called)

    def explain_error(self, error: BaseException) -> None:
        from tfscale.errors import StrategyError

        text = str(error)
        if "Could not start gRPC server" in text:
            # The port the launcher chose was free a moment before; another program has it
            # now. Not the script's doing: the launcher starts the job again on new ports.
            print(
                f"tfscale launch: {self.label}: its gRPC server could not listen on the port "
                "chosen for it (another program took it since)",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(PORT_TAKEN_STATUS)
        if isinstance(error, StrategyError):
            lines = text.strip().splitlines()
            fixes = [line[len("Fix: ") :] for line in lines if line.startswith("Fix: ")]
            fix = fixes[0].replace(" strict=False falls back to one device.", "") if fixes else ""
            self.stop(
                f"the multi-worker strategy could not be built: {lines[0]}",
                fix.strip() or _FIX_STRATEGY,
            )
        if "PerReplica" in text and "Attempt to convert a value" in text:
            self.stop(
                "Keras's model.fit fails under MultiWorkerMirroredStrategy with a dataset "
                "(keras-team/keras#20585)",
                _FIX_KERAS_FIT,
            )


def main(argv: list[str] | None = None) -> int:
    """Runs ``SCRIPT ARGS...`` as a strict worker; returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m tfscale.launch.worker SCRIPT|-m MODULE [ARGS...]", file=sys.stderr)
        return 2
    os.environ[STRICT_ENV] = "1"
    from tfscale.processes.script_runner import run_as_main

    job = _Job()
    job.watch()
    status = run_as_main(args[0], args[1:], on_error=job.explain_error)
    if status == 0 and job.trained and not job.together and job.workers > 1:
        try:
            job.stop(
                "its script built no multi-worker strategy, so it trained alone", _FIX_STRATEGY
            )
        except SystemExit as stop:
            return int(stop.code) if isinstance(stop.code, int) else 1
    return status


if __name__ == "__main__":
    sys.exit(main())
