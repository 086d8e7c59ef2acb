"""The child side of ``tfscale doctor --script``: runs a user's script under instrumentation.

Run as ``python -m tfscale.doctor.instrument EVENTS_FILE SCRIPT [ARGS...]``. The script
runs as ``__main__`` with its folder on ``sys.path``
(:func:`tfscale.processes.script_runner.run_as_main`, shared with ``tfscale profile``) while
three hooks append one JSON object per line to ``EVENTS_FILE``, flushed at once, so that a
script killed by a timeout still leaves its findings behind:

- ``variable``: every ``tf.Variable`` created in the main thread (Keras 3 variables
  included), with its creation site (``file:line``), the strategy whose scope was active,
  and its device (via :func:`tfscale.scope.track_variable_creation`);
- ``strategy``: every ``tf.distribute`` strategy constructed, with its replicas, worker
  devices and creation site (a wrapper around ``Strategy.__init__``);
- ``run``: the device each replica's outputs were placed on, the first time each strategy
  runs a step (a wrapper around ``Strategy.run``, which Keras ``fit`` and custom loops call);
- ``repaired``: the variables ``tfscale.fix_scope`` replaced with a clone's, or
  ``tfscale.fit`` / ``prepare`` moved into the scope (:func:`tfscale.scope.watch_repairs`),
  by the ``id`` their ``variable`` events carry;
- ``loop_loss``: each place a custom loop's ``tape.gradient`` runs in a replica of a
  multi-replica strategy that tfscale does not train, with how its loss is scaled over
  replicas (``training/conventions.py``); variable events also say whether the variable
  was created inside a traced ``strategy.run`` (``in_step``: built lazily by a step);
- ``fit``: each ``keras.Model.fit`` call over a Python generator or ``keras.utils.PyDataset``
  (training or validation data): the input's kind, the model's strategy and replicas, and
  whether tfscale copies its batches (see ``training/data.copied_batches``).

The replica devices are read from the outputs of ``Strategy.run`` rather than from
``tf.debugging.set_log_device_placement``: the strategy pins each replica's ops with a
device scope, the output tensors carry it (the actual device for eager tensors), and
reading it needs no parsing of TensorFlow's C++ log, which is not an interface.

When ``TFSCALE_VIRTUAL_DEVICES`` is unset and TensorFlow sees no GPU, the CPU is split into
2 logical devices before the script starts
(:func:`tfscale.processes.script_runner.split_cpu_when_alone`), so a ``MirroredStrategy()``
in the script gets 2 replicas and the report can show where each ran.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from tfscale.interop.script_watch import watch_fits, watch_strategies
from tfscale.processes.script_runner import CPU_SPLIT, run_as_main, split_cpu_when_alone

__all__ = ["DEMO_VIRTUAL_DEVICES", "main"]

DEMO_VIRTUAL_DEVICES = CPU_SPLIT
_COPY_NAME = re.compile(r"/replica_\d+/?(:\d+)?$")


class _EventLog:
    """Appends one JSON object per line, flushed at once; safe across threads."""

    def __init__(self, handle: TextIO) -> None:
        self._handle = handle
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, **fields}, default=str)
        with self._lock:
            self._handle.write(line + "\n")
            self._handle.flush()


def _configure_devices(log: _EventLog) -> None:
    """Splits the CPU into 2 logical devices unless the user chose a layout or has a GPU."""
    layout = split_cpu_when_alone()
    log.write(
        "devices", virtual=layout.virtual, set_by_doctor=layout.set_by_runner, gpus=layout.gpus
    )


def _strategy_fields(strategy: Any) -> dict[str, Any]:
    from tfscale.scope import short_device

    try:
        devices = [short_device(d) for d in strategy.extended.worker_devices]
    except (RuntimeError, NotImplementedError, AttributeError):
        devices = []
    try:
        replicas = int(strategy.num_replicas_in_sync)
    except Exception:  # a strategy half-built by a failing constructor
        replicas = 0
    return {
        "strategy_id": id(strategy),
        "strategy": type(strategy).__name__,
        "replicas": replicas,
        "devices": devices,
    }


def _hook_strategies(log: _EventLog) -> None:
    """Records the strategies the script builds and the devices each replica ran on."""
    import tensorflow as tf

    from tfscale.scope import creation_stack, short_device

    seen_runs: set[tuple[int, tuple[str, ...]]] = set()

    def built(strategy: Any) -> None:
        log.write("strategy", stack=list(creation_stack()), **_strategy_fields(strategy))

    def ran(strategy: Any, outputs: Any) -> None:
        try:
            devices = tuple(
                next(
                    (short_device(str(t.device)) for t in tf.nest.flatten(local) if _has_device(t)),
                    "",
                )
                for local in strategy.experimental_local_results(outputs)
            )
        except Exception:  # never let the instrumentation break the user's step
            return
        if (id(strategy), devices) not in seen_runs:
            seen_runs.add((id(strategy), devices))
            fields = _strategy_fields(strategy)
            log.write("run", stack=list(creation_stack()), replica_devices=list(devices), **fields)

    watch_strategies(built, ran)


def _hook_fits(log: _EventLog) -> None:
    """Records ``model.fit`` calls whose data goes through ``from_generator``."""
    from tfscale.scope import creation_stack
    from tfscale.training.data import COPIED_FIT_ARGUMENTS, generator_kind, is_copied

    def called(model: Any, arguments: dict[str, Any]) -> None:
        try:
            inputs = {name: generator_kind(arguments.get(name)) for name in COPIED_FIT_ARGUMENTS}
            if not any(inputs.values()):
                return
            strategy = model.distribute_strategy
            log.write(
                "fit",
                stack=list(creation_stack()),
                inputs={name: kind for name, kind in inputs.items() if kind},
                copied=all(is_copied(arguments.get(name)) for name, kind in inputs.items() if kind),
                strategy=type(strategy).__name__,
                replicas=int(strategy.num_replicas_in_sync),
            )
        except Exception:  # never let the instrumentation break the user's fit
            return

    watch_fits(called)


def _hook_loop_losses(log: _EventLog) -> None:
    """Records, for each ``tape.gradient`` in a replica of a multi-replica strategy that
    tfscale does not train (no ``prepare_loop``, not ``fit``'s own step), how its loss is
    scaled over replicas (``training/conventions.py``, the classifier ``prepare_loop``
    uses), so the parent can say whether Keras's sum of the replicas' gradients is one
    device's update."""
    import tensorflow as tf

    from tfscale.interop import internals
    from tfscale.scope import creation_stack

    seen: set[tuple[str, ...]] = set()

    # tfscale.training is imported at the first gradient or reduction, not before the
    # script runs: the script configures TensorFlow first, as it would without the doctor.
    def on_gradient(target: Any, sources: Any) -> None:
        try:
            from tfscale.training import conventions
            from tfscale.training.loop import prepared_sources
            from tfscale.training.optimizer import step_in_progress

            if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
                return
            replicas = tf.distribute.get_replica_context().num_replicas_in_sync
            if replicas < 2 or step_in_progress() or prepared_sources(sources):
                return
            terms = conventions.classify(target)
            conventions.forget_recorded(gradient_of=target)
            stack = tuple(creation_stack())
            if stack in seen:
                return
            seen.add(stack)
            log.write(
                "loop_loss",
                stack=list(stack),
                replicas=int(replicas),
                kinds=[t.kind.name if t.kind else None for t in terms],
                terms=[t.what for t in terms],
            )
        except Exception:  # never let the instrumentation break the user's step
            return

    def on_reduction(name: str, output: Any, args: Any, kwargs: dict[str, Any]) -> None:
        from tfscale.training import conventions

        conventions.on_reduction(name, output, args, kwargs)

    internals.watch_gradient_targets(on_gradient)
    internals.watch_loss_reductions(on_reduction)


def _has_device(value: Any) -> bool:
    try:
        return bool(getattr(value, "device", None) is not None)
    except Exception:  # symbolic values without a device
        return False


def _variable_event(log: _EventLog) -> Callable[[Any, Any], None]:
    import tensorflow as tf

    from tfscale.scope import short_device

    def on_create(variable: Any, origin: Any) -> None:
        strategy_id = id(tf.distribute.get_strategy()) if origin.strategy else None
        # Created inside strategy.run (a replica context) while a tf.function was traced:
        # a model or optimizer built lazily by the first replica step.
        in_step = bool(
            origin.strategy
            and not tf.distribute.in_cross_replica_context()
            and not tf.executing_eagerly()
        )
        try:
            shape = [int(d) if d is not None else None for d in variable.shape]
        except (TypeError, ValueError):
            shape = None
        log.write(
            "variable",
            id=id(variable),
            name=origin.name,
            site=origin.site,
            stack=list(origin.stack),
            strategy=origin.strategy,
            strategy_id=strategy_id,
            replicas=origin.num_replicas,
            device=short_device(origin.device),
            trainable=bool(getattr(variable, "trainable", False)),
            shape=shape,
            copy=bool(_COPY_NAME.search(origin.name)),
            in_step=in_step,
        )

    return on_create


def main(argv: list[str] | None = None) -> int:
    """Runs ``SCRIPT ARGS...`` under instrumentation, logging events to ``EVENTS_FILE``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        print("usage: python -m tfscale.doctor.instrument EVENTS_FILE SCRIPT [ARGS...]")
        return 2
    events_path, script, script_args = argv[0], argv[1], argv[2:]
    with open(events_path, "a", encoding="utf-8") as handle:
        log = _EventLog(handle)
        _configure_devices(log)
        _hook_strategies(log)
        _hook_fits(log)
        _hook_loop_losses(log)

        from tfscale.scope import creation_stack, track_variable_creation, watch_repairs

        def repaired(variables: Any, how: str) -> None:
            log.write(
                "repaired", ids=[id(v) for v in variables], how=how, stack=list(creation_stack())
            )

        watch_repairs(repaired)
        log.write("start", script=script, args=script_args)
        with track_variable_creation(_variable_event(log)):
            status = run_as_main(script, script_args)
        log.write("exit", status=status)
    return status


if __name__ == "__main__":
    sys.exit(main())
