"""The child side of ``tfscale profile script.py``: run a user's script with timing attached.

``keras.Model.fit`` is wrapped so that every call gets a :class:`ProfileCallback` (with a
trace window) added to its callbacks; the script then runs as ``doctor --script`` runs it
(:mod:`tfscale.script_runner`: as ``__main__`` with its own arguments, its folder on
``sys.path``, the CPU split into 2 logical devices where there is no GPU and no layout was
asked), and the callbacks' summaries are written as JSON when it ends, however it ends.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

from tfscale.internals import dataset_batch_size
from tfscale.script_runner import run_as_main, split_cpu_when_alone

__all__ = ["batch_size_of", "main", "run_script", "script_report"]


def batch_size_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The global batch of a ``fit`` call: its ``batch_size``, or a dataset's static batch."""
    if kwargs.get("batch_size"):
        return int(kwargs["batch_size"])
    data = args[0] if args else kwargs.get("x")
    spec = getattr(data, "element_spec", None)
    if spec is None:
        return 32 if data is not None and hasattr(data, "shape") else None
    import tensorflow as tf

    first = tf.nest.flatten(spec)[0]
    dim = first.shape[0] if first.shape.rank else None
    if dim is None:  # batch() without drop_remainder: read the batch dataset's own size
        dim = dataset_batch_size(data)
    return int(dim) if dim is not None else None


def run_script(path: str, argv: list[str], out_json: str, trace_steps: tuple[int, int]) -> int:
    """Runs ``path`` as ``__main__`` with ``argv``, timing every ``keras.Model.fit`` call.

    Returns:
        The script's exit status.
    """
    split_cpu_when_alone()
    import keras

    from tfscale.profiling.callback import ProfileCallback

    callbacks: list[ProfileCallback] = []
    original = keras.Model.fit

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        callback = ProfileCallback(batch_size=batch_size_of(args, kwargs), trace_steps=trace_steps)
        callbacks.append(callback)
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), callback]
        return original(self, *args, **kwargs)

    keras.Model.fit = fit
    status = 1
    try:
        status = run_as_main(path, argv)
    finally:
        keras.Model.fit = original
        import tensorflow as tf

        gpus = len(tf.config.list_physical_devices("GPU"))
        result = {
            "status": status,
            "device_kind": "GPU" if gpus else "CPU",
            "physical_devices": gpus or len(os.sched_getaffinity(0)),
            "fits": [c.summary() for c in callbacks],
        }
        with open(out_json, "w") as handle:
            json.dump(result, handle)
    return status


def script_report(data: dict[str, Any], path: str) -> Any:
    """Builds the same :class:`~tfscale.profiling.report.Report` as ``tfscale bench`` from the
    JSON :func:`run_script` wrote: one point per ``fit`` call, advice on the longest one.

    Raises:
        ProfileError: The script called ``model.fit`` no time, or no step was measured.
    """
    from tfscale.errors import ProfileError, explain
    from tfscale.profiling.advice import Facts, advise
    from tfscale.profiling.report import Report
    from tfscale.profiling.steptime import Breakdown
    from tfscale.profiling.sweep import SweepPoint

    fits = [f for f in data.get("fits", []) if f["steps_measured"]]
    if not fits:
        raise ProfileError(
            explain(
                "The script ran no measurable training step (keras.Model.fit was not called, "
                "or ran fewer steps than the warm-up).",
                received=f"{path} (exit status {data.get('status')})",
                allowed="a script that calls model.fit for more than 2 steps",
                fix="run it for more steps, or use tfscale.ProfileCallback in your own loop.",
            )
        )
    points = []
    for summary in fits:
        batch = summary["batch_size"] or 0
        replicas = summary["replicas"]
        b = Breakdown(
            summary["median_step_s"],
            summary["input_s"],
            summary["compute_s"],
            summary["communication_s"],
            batch,
            method=summary["method"],
        )
        points.append(
            SweepPoint(
                "script", replicas, max(batch // replicas, 0), 1, b, trace=summary["trace_shares"]
            )
        )
    device_kind, physical = data.get("device_kind", "CPU"), int(data.get("physical_devices", 1))
    main_point = max(zip(fits, points, strict=True), key=lambda fp: fp[0]["steps_measured"])[1]
    facts = Facts(
        breakdown=main_point.breakdown,
        replicas=main_point.replicas,
        batch_per_replica=main_point.batch_per_replica,  # 0 when unknown: no batch advice
        device_kind=device_kind,
        physical_devices=physical,
    )
    return Report(
        workload=path,
        device_kind=device_kind,
        physical_devices=physical,
        settings={"fit_calls": len(fits), "exit_status": data.get("status")},
        points=points,
        advice=advise(facts),
        notes=[
            "Profiled script: step time from on_train_batch_begin to on_train_batch_end of "
            "each model.fit step; input / compute / exposed communication from a TensorFlow "
            "profiler trace of a window of steps (trace method), overlaps removed by a sweep.",
            "Advice that needs a sweep (fewer replicas, batch-size cost model) is computed by "
            "`tfscale bench`; --verify is not available for scripts.",
        ],
    )


def main() -> None:
    """``python -m tfscale.profiling.script OUT_JSON FIRST STOP SCRIPT [ARGS...]``."""
    out_json, first, stop, path, *argv = sys.argv[1:]
    sys.exit(run_script(path, argv, out_json, (int(first), int(stop))))


if __name__ == "__main__":  # pragma: no cover
    main()
