"""The child side of ``tfscale profile script.py``: run a user's script with timing attached.

``keras.Model.fit`` is wrapped so that every call gets a :class:`ProfileCallback` (with a
trace window) added to its callbacks; the script then runs as ``doctor --script`` runs it
(:mod:`tfscale.processes.script_runner`: as ``__main__`` with its own arguments, its folder on
``sys.path``, the CPU split into 2 logical devices where there is no GPU and no layout was
asked), and the callbacks' summaries are written as JSON when it ends, however it ends.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from tfscale.interop import registry
from tfscale.interop.internals import dataset_batch_size
from tfscale.interop.script_watch import watch_fits
from tfscale.processes.script_runner import run_as_main, split_cpu_when_alone
from tfscale.profiling.timeline import traced

__all__ = [
    "TRACES_ENV",
    "WORKER_FILE",
    "batch_size_of",
    "crash_retries",
    "crashed",
    "main",
    "merge_workers",
    "profiled_command",
    "read_workers",
    "retried_while_crashing",
    "run_script",
    "script_report",
    "trace_crash_note",
    "trace_logdir",
    "worker_output",
]

#: The part of a multi-worker profile each worker writes into the profile folder.
WORKER_FILE = "worker-{index}.json"


#: Set in the environment of the reference run: the script on one replica.
ONE_REPLICA_ENV = "TFSCALE_PROFILE_ONE_REPLICA"
#: Where the trace windows are kept, one TensorBoard run per process (``script``,
#: ``one-replica``, ``worker-<index>``); unset: a worker's part folder's ``trace/``, else none.
TRACES_ENV = "TFSCALE_PROFILE_TRACES"


R = TypeVar("R")

#: Signals a crash in native code ends a process with (Popen: -N; the launcher, as a shell: 128+N).
_CRASH_SIGNALS = ("SIGSEGV", "SIGABRT", "SIGBUS")


def crashed(status: int | None, output: str = "") -> bool:
    """Whether a profiled process died of a crash in native code: a SIGSEGV, SIGABRT or
    SIGBUS (exit status -N, or 128+N from the launcher), or faulthandler's fatal-error line in
    its output (the children run with faulthandler on: ``script_runner.child_environment``)."""
    import signal

    numbers = [int(getattr(signal, name)) for name in _CRASH_SIGNALS]
    if status is not None and (-status in numbers or status - 128 in numbers):
        return True
    return "Fatal Python error: " in output


def crash_retries(window: tuple[int, int]) -> list[tuple[int, int]]:
    """The trace windows to run again with, in turn, while a traced run crashes: the same
    window once more (the crash is a race, most second runs pass), then no trace."""
    return [window, (0, 0)] if traced(window) else []


def retried_while_crashing(
    window: tuple[int, int],
    attempt: Callable[[tuple[int, int]], R],
    crash_of: Callable[[R], tuple[bool, int | None]],
    who: str,
    what: str,
    say: Callable[[str], None],
) -> tuple[R, str | None]:
    """``attempt(window)``, run again with each window of :func:`crash_retries` while
    ``crash_of`` says the last one crashed (and with which exit status), saying so as it goes.

    Args:
        window: The trace window asked for.
        attempt: One run with a trace window; returns its outcome.
        crash_of: Whether an outcome is a crash, and its exit status.
        who: Who crashed, for the line and the note ("The script", "A worker").
        what: What runs again ("it", "the job").
        say: Prints a line.

    Returns:
        The last outcome, and the report's note (:func:`trace_crash_note`) if any run crashed.
    """
    outcome = attempt(window)
    crashes: list[int | None] = []
    for again in crash_retries(window):
        failed, status = crash_of(outcome)
        if not failed:
            break
        crashes.append(status)
        untraced = "" if traced(again) else " without a trace"
        say(f"{who} crashed (exit status {status}) while traced: running {what} again{untraced}.")
        outcome = attempt(again)
    return outcome, trace_crash_note(who, crashes, window) if crashes else None


def trace_crash_note(who: str, statuses: list[int | None], window: tuple[int, int]) -> str:
    """The report's note when ``who`` crashed while traced (``statuses``: each crashed run's
    exit status) and the run was repeated (:func:`crash_retries`).

    TensorFlow's profiler can crash the process that stops a trace window (a segfault, or an
    abort on a corrupted heap: ``munmap_chunk(): invalid pointer``) while other threads run:
    a ``from_generator`` input's Python, tf.data's or the collectives' threads
    (tensorflow/tensorboard#3149, open since 2020).
    """
    codes = ", ".join(str(s) for s in statuses)
    head = (
        f"{who} crashed (exit status {codes}) as TensorFlow's profiler traced steps "
        f"{window[0]}-{window[1]}, a known upstream crash (tensorflow/tensorboard#3149): "
    )
    if len(statuses) == 1:
        return head + "these timings and the trace come from a second run."
    return head + (
        f"these timings come from run {len(statuses) + 1}, without a trace (wall clock: "
        "across workers, a wait in the collective the input iterator runs counts as input, "
        "so a straggler may go unnamed). Feeding the input through tf.data ops rather than "
        "from_generator or py_function makes the crash rarer; docs/profiling.md, "
        "'A known crash'."
    )


def trace_logdir(out_json: str) -> str | None:
    """This process's TensorBoard run folder for its trace windows (see :data:`TRACES_ENV`):
    ``tensorboard --logdir ROOT`` shows one run per worker in its profile plugin."""
    import re

    from tfscale.cluster import cluster_from_env

    root = os.environ.get(TRACES_ENV)
    if not root and re.fullmatch(r"worker-\d+\.json", os.path.basename(out_json)):
        root = os.path.join(os.path.dirname(out_json), "trace")
    if not root:
        return None
    cluster = cluster_from_env()
    if cluster is not None:
        name = f"worker-{cluster.task_index}"
    else:
        name = "one-replica" if os.environ.get(ONE_REPLICA_ENV) else "script"
    return os.path.join(root, name)


def batch_size_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The global batch of a ``fit`` call (``model.fit``'s or ``tfscale.fit``'s arguments
    after the model): its ``batch_size``, Keras's default 32 for arrays, or a dataset's
    static batch (None where it cannot be known before the first step)."""
    if kwargs.get("batch_size"):
        return int(kwargs["batch_size"])
    data = args[0] if args else kwargs.get("x", kwargs.get("data"))
    spec = getattr(data, "element_spec", None)
    if spec is None:
        if data is None:
            return None
        first = next(iter(data.values()), None) if isinstance(data, dict) else data
        if isinstance(first, (list, tuple)) and first:
            first = first[0]
        return 32 if hasattr(first, "shape") else None
    import tensorflow as tf

    first = tf.nest.flatten(spec)[0]
    dim = first.shape[0] if first.shape.rank else None
    if dim is None:  # batch() without drop_remainder: read the batch dataset's own size
        dim = dataset_batch_size(data)
    return int(dim) if dim is not None else None


def _one_replica() -> None:
    """The reference run's layout: one device (the first GPU, or the whole CPU), and every
    ``MirroredStrategy`` the script builds placed on it, whatever devices it names."""
    from tfscale.devices.virtual import ENV_KIND_VAR, ENV_VAR

    os.environ[ENV_VAR] = "1"  # before TensorFlow starts: one CPU device
    os.environ.pop(ENV_KIND_VAR, None)
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[:1], "GPU")

    def one_device(original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def init(self: Any, devices: Any = None, cross_device_ops: Any = None) -> None:
            original(self, devices=None, cross_device_ops=cross_device_ops)

        return init

    registry.install("script-watch", tf.distribute.MirroredStrategy, "__init__", one_device)


_FIT_MODULE = "tfscale.training.fit"


def _hook_fits(make: Callable[[int | None], Any]) -> Callable[[], None]:
    """Adds ``make(batch)`` to the callbacks of every ``keras.Model.fit`` and ``tfscale.fit``
    call (one per call: a ``model.fit`` inside ``tfscale.fit`` gets none of its own, the
    outer call knows the batch the user asked for). Returns the undo."""
    import importlib

    import tfscale

    inside = [0]

    def called(model: Any, arguments: dict[str, Any]) -> None:
        if not inside[0]:
            arguments["callbacks"] = [
                *(arguments.get("callbacks") or []),
                make(batch_size_of((), arguments)),
            ]

    def watch(tfscale_fit: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(tfscale_fit)
        def fit_tfscale(model: Any, *args: Any, **kwargs: Any) -> Any:
            callbacks = [*(kwargs.get("callbacks") or []), make(batch_size_of(args, kwargs))]
            kwargs["callbacks"] = callbacks
            inside[0] += 1
            try:
                return tfscale_fit(model, *args, **kwargs)
            finally:
                inside[0] -= 1

        return fit_tfscale

    tfscale.fit  # noqa: B018 - loaded (tfscale's names load on first use) before it is wrapped
    undoes = [
        watch_fits(called),
        registry.install("script-watch", tfscale, "fit", watch),
        # tfscale.fit and the function it is (training/fit.py), however the script names it.
        registry.install(
            "script-watch", importlib.import_module("tfscale.training.fit"), "fit", watch
        ),
    ]

    def undo() -> None:
        for each in undoes:
            each()

    return undo


def run_script(path: str, argv: list[str], out_json: str, trace_steps: tuple[int, int]) -> int:
    """Runs ``path`` as ``__main__`` with ``argv``, timing every ``keras.Model.fit`` and
    ``tfscale.fit`` call (on one replica when :data:`ONE_REPLICA_ENV` is set).

    Returns:
        The script's exit status.
    """
    if os.environ.get(ONE_REPLICA_ENV):
        _one_replica()
    else:
        split_cpu_when_alone()
    from tfscale.profiling.callback import ProfileCallback
    from tfscale.profiling.loopsteps import LoopSteps, watch_loop_steps

    callbacks: list[ProfileCallback] = []

    logdir = trace_logdir(out_json)

    def make(batch: int | None) -> ProfileCallback:
        callbacks.append(ProfileCallback(batch_size=batch, trace_steps=trace_steps, logdir=logdir))
        return callbacks[-1]

    def make_loop(strategy: Any, batch: int | None) -> LoopSteps:
        callbacks.append(
            LoopSteps(strategy, batch_size=batch, trace_steps=trace_steps, logdir=logdir)
        )
        return callbacks[-1]  # type: ignore[return-value]

    undo = _hook_fits(make)
    undo_loops = watch_loop_steps(make_loop)
    status = 1
    try:
        status = run_as_main(path, argv)
    finally:
        undo()
        undo_loops()
        for callback in callbacks:
            if isinstance(callback, LoopSteps):
                callback.on_train_end()  # a trace window the loop did not reach the end of
        from tfscale.profiling.facts import gather_environment

        result = {
            "status": status,
            # The facts the advice rules need beyond the steps, gathered as bench gathers
            # them (the precision policy as the script left it; XLA is each fit's own).
            **gather_environment().to_json(),
            "fits": [
                {**c.summary(), "kind": "loop" if isinstance(c, LoopSteps) else "fit"}
                for c in callbacks
            ],
        }
        with open(out_json, "w") as handle:
            json.dump(result, handle)
    return status


def _points(data: dict[str, Any]) -> list[tuple[dict[str, Any], Any]]:
    """``(fit summary, SweepPoint)`` for each fit call of a run that measured a step."""
    from tfscale.profiling.steptime import from_record
    from tfscale.profiling.sweep import SweepPoint

    out = []
    for summary in data.get("fits", []):
        if not summary["steps_measured"]:
            continue
        batch = summary["batch_size"] or 0
        replicas = summary["replicas"]
        b = from_record(summary, batch)
        point = SweepPoint(
            "script",
            replicas,
            max(batch // replicas, 0),
            1,
            b,
            trace=summary["trace_shares"],
            memory=summary.get("memory") or {},
        )
        out.append((summary, point))
    return out


def measured(data: dict[str, Any]) -> bool:
    """Whether a run's timings hold a measured training step."""
    return bool(_points(data))


def _main(points: list[tuple[dict[str, Any], Any]]) -> Any:
    """The fit call that measured the most steps (the training, not a warm-up fit)."""
    return max(points, key=lambda fp: fp[0]["steps_measured"])[1]


def script_report(data: dict[str, Any], path: str, reference: dict[str, Any] | None = None) -> Any:
    """Builds the same :class:`~tfscale.profiling.report.Report` as ``tfscale bench`` from the
    JSON :func:`run_script` wrote: one point per ``fit`` call, advice on the longest one.

    Args:
        data: The run on the script's own devices.
        path: The script, as the user named it.
        reference: The run on one replica (same global batch), or None: its longest fit
            becomes a 1-replica point and the script's point gets its speedup and
            efficiency against it.

    Raises:
        ProfileError: The script called ``fit`` no time, or no step was measured.
    """
    import dataclasses

    from tfscale.errors import ProfileError, explain
    from tfscale.profiling.advice import advise
    from tfscale.profiling.facts import Environment, facts_for
    from tfscale.profiling.report import Report

    fits = _points(data)
    status = data.get("status")
    if not fits and status not in (0, None):
        # The script's own error is the news, not the missing steps (its output is relayed).
        raise ProfileError(
            explain(
                f"The script failed (exit status {status}) before a training step was measured.",
                received=f"{path} (exit status {status})",
                fix=f"its error is in its output above; run it on its own first: python {path}",
            )
        )
    if not fits:
        raise ProfileError(
            explain(
                "The script ran no measurable training step (neither keras.Model.fit nor "
                "tfscale.fit was called, no tf.function called strategy.run, or they ran "
                "fewer steps than the warm-up).",
                received=f"{path} (exit status {status})",
                allowed="a script that calls model.fit or tfscale.fit, or a tf.function around "
                "strategy.run (a custom loop's step), for more than 2 steps",
                fix="run it for more steps; in a custom loop, call strategy.run inside a "
                "tf.function (see docs/profiling.md).",
            )
        )
    main_point = _main(fits)
    notes = [
        "Profiled script: step time from on_train_batch_begin to on_train_batch_end of "
        "each fit step (tfscale.fit: its train function's own fetch and step seconds; a "
        "custom loop: each call of its tf.function around strategy.run, the time between "
        "calls as input wait); "
        "input / compute / exposed communication from a TensorFlow profiler trace of a "
        "window of steps (trace method), overlaps removed by a sweep.",
        "Advice that needs a sweep (fewer replicas, batch-size cost model) is computed by "
        "`tfscale bench`; --verify is not available for scripts.",
    ]
    if not main_point.breakdown.examples_per_step:
        notes.append(
            "The global batch could not be read from the fit call (a dataset without a "
            "static batch): examples/s is 0; pass batch_size or batch the dataset."
        )
    points = [p for _, p in fits]
    throughput: dict[int, float] = {main_point.replicas: main_point.examples_per_s}
    ref_fits = _points(reference) if reference else []
    if ref_fits and main_point.replicas > 1:
        ref = _main(ref_fits)
        throughput[ref.replicas] = ref.examples_per_s
        speedup = main_point.examples_per_s / ref.examples_per_s if ref.examples_per_s else 0.0
        compared = dataclasses.replace(
            main_point, speedup=speedup, efficiency=speedup / main_point.replicas
        )
        points = [ref, *(compared if p is main_point else p for p in points)]
        main_point = compared
        notes.append(
            f"Compared with the same script on 1 replica (global batch {ref.global_batch}): "
            f"{speedup:.2f}x examples/s on {compared.replicas} replicas, scaling efficiency "
            f"{100 * compared.efficiency:.0f}%."
        )
    elif reference is not None and main_point.replicas > 1:
        notes.append(
            "The 1-replica run measured no step (exit status "
            f"{reference.get('status')}): no comparison."
        )
    elif main_point.replicas == 1:
        notes.append(
            "The script trained on 1 replica: nothing to compare. `tfscale doctor --script` "
            "says why it did not use more devices."
        )
    if status != 0:
        notes.append(f"The script exited with status {status}; the steps before are reported.")
    main_summary = max(fits, key=lambda fp: fp[0]["steps_measured"])[0]
    # The environment the child gathered (as bench gathers its own), with the measured
    # fit's XLA setting.
    environment = dataclasses.replace(
        Environment.from_json(data), jit_compile=bool(main_summary.get("jit_compile", False))
    )
    device_kind, physical = environment.device_kind, environment.physical_devices
    basis = [p for p in points if p.replicas != main_point.replicas] + [main_point]
    facts = facts_for(Report(path, device_kind, physical, {}, basis), environment)
    settings: dict[str, Any] = {"fit_calls": len(fits), "exit_status": status}
    if reference is not None:
        settings["reference_exit_status"] = reference.get("status")
    return Report(
        workload=path,
        device_kind=device_kind,
        physical_devices=physical,
        settings=settings,
        points=points,
        advice=advise(facts),
        notes=notes,
    )


def profiled_command(
    script: tuple[str, ...], directory: str, window: tuple[int, int] = (5, 10)
) -> tuple[str, ...]:
    """A worker's command line (after the interpreter) that runs ``script`` under this
    module, writing its part into ``directory`` (``tfscale profile -n``, ``tfscale launch
    --profile``)."""
    folder = os.path.join(os.path.abspath(directory), "")
    return ("-m", __name__, folder, str(window[0]), str(window[1]), *script)


def worker_output(out: str) -> str:
    """Where this process writes its timings: ``out`` itself, or, where ``out`` is a folder
    (ends with ``/``, as ``tfscale profile -n`` and ``tfscale launch --profile`` pass it),
    ``out/worker-<index>.json`` with this worker's index in its cluster (0 alone)."""
    if not out.endswith(os.sep):
        return out
    from tfscale.cluster import cluster_from_env

    cluster = cluster_from_env()
    index = cluster.task_index if cluster is not None else 0
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, WORKER_FILE.format(index=index))


def read_workers(directory: str) -> dict[int, dict[str, Any]]:
    """The parts the workers of a profiled job wrote into ``directory``, by worker index.

    Raises:
        ProfileError: None there.
    """
    import glob
    import re

    from tfscale.errors import ProfileError, explain

    parts: dict[int, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "worker-*.json"))):
        match = re.fullmatch(r"worker-(\d+)\.json", os.path.basename(path))
        if match:
            with open(path) as handle:
                parts[int(match.group(1))] = json.load(handle)
    if not parts:
        raise ProfileError(
            explain(
                "No worker wrote its part of the profile into this folder.",
                received=directory,
                allowed="a folder with worker-<index>.json files, written by the workers of "
                "tfscale launch --profile DIR",
                fix="tfscale launch --profile DIR -n 2 train.py, then tfscale profile --merge DIR",
            )
        )
    return parts


def _worker_step(index: int, data: dict[str, Any]) -> Any:
    from tfscale.profiling.steptime import from_record
    from tfscale.profiling.stragglers import WorkerStep

    summary = max(
        (f for f in data.get("fits", []) if f["steps_measured"]),
        key=lambda f: f["steps_measured"],
        default=None,
    )
    if summary is None:
        return None
    b = from_record(summary, summary.get("batch_size") or 0)
    return WorkerStep(index, b.step_s, b.input_s, b.compute_s, b.communication_s, b.method)


def merge_workers(parts: dict[int, dict[str, Any]], path: str) -> Any:
    """One report of a multi-worker job from each worker's part: the chief's (lowest index)
    scaling row and advice, a row per worker (step, input, compute, the wait for the others
    in the collective) and the straggler, if one worker holds the others back, with its
    cause and advice first (:mod:`tfscale.profiling.stragglers`).

    Raises:
        ProfileError: No worker measured a step.
    """
    import dataclasses

    from tfscale.profiling.stragglers import judge

    chief = min(parts)
    report = script_report(parts[chief], path)
    steps = [s for s in (_worker_step(i, d) for i, d in sorted(parts.items())) if s is not None]
    table, straggler = judge(steps)
    advice = [straggler.advice, *report.advice] if straggler else report.advice
    missing = sorted(set(parts) - {s.worker for s in steps})
    notes = [
        *report.notes,
        f"{len(parts)} workers profiled; the scaling row and the advice other than the "
        f"straggler's are worker {chief}'s. Each worker's wait for the others is the time it "
        "spent in the collective beyond the least any worker spent there (trace: exposed "
        "communication; wall-clock: the step call, assuming equal compute); docs/profiling.md.",
    ]
    if missing:
        notes.append(f"Workers {missing} measured no step: they are left out of the table.")
    statuses = {i: d.get("status") for i, d in parts.items()}
    return dataclasses.replace(
        report,
        settings={**report.settings, "workers": len(parts), "worker_exit_status": statuses},
        advice=advice,
        notes=notes,
        workers=table,
        straggler=straggler,
    )


def main() -> None:
    """``python -m tfscale.profiling.script OUT FIRST STOP SCRIPT [ARGS...]`` (``OUT``: a JSON
    file, or a folder ending in ``/`` for a worker's part)."""
    out, first, stop, path, *argv = sys.argv[1:]
    sys.exit(run_script(path, argv, worker_output(out), (int(first), int(stop))))


if __name__ == "__main__":  # pragma: no cover
    main()
