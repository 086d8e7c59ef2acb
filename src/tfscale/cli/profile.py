"""``tfscale profile script.py [args]``: time a user's own training script and report on it."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Adds the ``profile`` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "profile",
        help="run a training script with step timing and a trace, and write a report",
        description="Runs SCRIPT in a child process with a tfscale.ProfileCallback attached to "
        "every keras.Model.fit call (step times, and a TensorFlow profiler trace of a window of "
        "steps split into input, compute and exposed communication), then writes "
        "report.json, report.md and report.html.",
    )
    parser.add_argument("--out", default="tfscale-profile", metavar="DIR")
    parser.add_argument(
        "--trace-steps",
        default="5,10",
        metavar="FIRST,STOP",
        help="global steps to trace (default 5,10; 0,0 for none)",
    )
    parser.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip the second run of the script on 1 replica (the speedup comparison)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop each run of the script after this long (default: no limit)",
    )
    parser.add_argument(
        "-n",
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="run the script as a local N-worker job (as tfscale launch -n N would) and "
        "report per worker, naming the straggler",
    )
    parser.add_argument(
        "--merge",
        default=None,
        metavar="DIR",
        help="build the report from the parts the workers of tfscale launch --profile DIR "
        "wrote (no script is run)",
    )
    parser.add_argument("script", nargs="?", help="the Python training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    parser.set_defaults(handler=run)


def trace_window(text: str) -> tuple[int, int]:
    """``FIRST,STOP`` (or ``FIRST`` alone: no window) as two step numbers.

    Raises:
        ProfileError: Not two whole numbers, negative, or a window that ends before it starts.
    """
    from tfscale.errors import ProfileError, explain

    first, _, stop = text.partition(",")
    try:
        window = (int(first), int(stop or first))
    except ValueError:
        window = (-1, -1)
    if min(window) < 0 or window[1] < window[0]:
        raise ProfileError(
            explain(
                "--trace-steps is a window of global steps, FIRST,STOP with STOP after FIRST.",
                received=text,
                allowed="two whole numbers 0 <= FIRST <= STOP (0,0: no trace)",
                fix="--trace-steps 5,10",
            )
        )
    return window


def run(args: argparse.Namespace) -> int:
    """Runs the script in a child process (and again on 1 replica), then builds and prints
    the report."""
    import dataclasses
    import json
    import os
    import tempfile

    from rich.console import Console

    from tfscale.errors import ProfileError, explain
    from tfscale.processes.script_runner import check_script, run_in_child
    from tfscale.profiling.report import print_summary, write_report
    from tfscale.profiling.script import (
        ONE_REPLICA_ENV,
        TRACES_ENV,
        crashed,
        retried_while_crashing,
        script_report,
    )

    first, stop = trace_window(args.trace_steps)
    if args.merge:
        from tfscale.profiling.script import merge_workers, read_workers

        report = merge_workers(read_workers(args.merge), args.script or args.merge)
        write_report(report, args.out)
        print_summary(report, args.out)
        return 0
    if args.timeout is not None and args.timeout <= 0:
        raise ProfileError(
            explain("--timeout must be positive.", received=args.timeout, fix="--timeout 600")
        )
    script = check_script(args.script, command="tfscale profile", error=ProfileError)
    console = Console(stderr=True)
    if args.workers is not None:
        return _profile_workers(args, script, (first, stop), console)

    traces = {TRACES_ENV: os.path.abspath(os.path.join(args.out, "trace"))}

    def attempt(
        scratch: str, name: str, env: dict[str, str], window: tuple[int, int]
    ) -> tuple[dict[str, Any] | None, int | None]:
        out_json = os.path.join(scratch, name)
        ran = run_in_child(
            "tfscale.profiling.script",
            [out_json, str(window[0]), str(window[1]), script, *args.args],
            timeout=args.timeout,
            env={**traces, **env},
        )
        if ran.timed_out:
            raise ProfileError(
                explain(
                    f"The script ran past --timeout {args.timeout:g} s and was stopped.",
                    received=script,
                    fix="raise --timeout or shorten the run.",
                )
            )
        if not os.path.exists(out_json):
            return None, ran.status
        with open(out_json) as handle:
            return json.load(handle), ran.status

    notes: list[str] = []

    def measure(scratch: str, name: str, env: dict[str, str]) -> tuple[dict[str, Any], int]:
        # The profiler's known crash (trace_crash_note): traced once more, then untraced.
        (data, status), note = retried_while_crashing(
            (first, stop),
            lambda window: attempt(scratch, name, env, window),
            lambda outcome: (outcome[0] is None and crashed(outcome[1]), outcome[1]),
            "The script",
            "it",
            lambda line: console.print(line, markup=False, soft_wrap=True),
        )
        if note:
            notes.append(note)
        if data is None:
            raise ProfileError(
                explain(
                    "The script ended before any timing could be written.",
                    received=f"{script} (exit status {status})",
                    fix="run it on its own first: python " + script,
                )
            )
        return data, int(status or 0)

    with tempfile.TemporaryDirectory(prefix="tfscale-profile-") as scratch:
        with console.status(f"profiling {script} on its devices"):
            data, status = measure(scratch, "steps.json", {})
        fits = [f for f in data.get("fits", []) if f["steps_measured"]]
        reference = None
        if args.compare and status == 0 and fits and max(f["replicas"] for f in fits) > 1:
            with console.status(f"profiling {script} on 1 replica, for the comparison"):
                reference, _ = measure(scratch, "one.json", {ONE_REPLICA_ENV: "1"})
    report = script_report(data, script, reference)
    if notes:
        report = dataclasses.replace(report, notes=[*notes, *report.notes])
    write_report(report, args.out)
    print_summary(report, args.out)
    for note in report.notes[2:]:
        console.print(note)
    _trace_line(args.out, console)
    return status


def _profile_workers(
    args: argparse.Namespace, script: str, window: tuple[int, int], console: Any
) -> int:
    """``-n N``: the script as a local N-worker job of the launcher, each worker timed and
    writing its part; one report with a row per worker and the straggler."""
    import dataclasses
    import itertools
    import os
    import tempfile

    from tfscale.devices.virtual import ENV_VAR
    from tfscale.errors import ProfileError, explain
    from tfscale.launch.gpus import visible_gpus
    from tfscale.launch.local import log_path, run_local_job
    from tfscale.launch.plan import LocalJob
    from tfscale.processes.script_runner import child_environment
    from tfscale.profiling.report import print_summary, write_report
    from tfscale.profiling.script import (
        TRACES_ENV,
        crashed,
        measured,
        merge_workers,
        profiled_command,
        read_workers,
        retried_while_crashing,
    )

    if args.workers < 2:
        raise ProfileError(
            explain("-n needs at least 2 workers.", received=args.workers, fix="-n 2")
        )
    env = child_environment()
    env.setdefault(ENV_VAR, "1")  # one replica per worker, as tfscale launch gives it
    env[TRACES_ENV] = os.path.abspath(os.path.join(args.out, "trace"))
    gpus = visible_gpus(env)

    def run(scratch: str, parts: str, window: tuple[int, int]) -> tuple[Any, str]:
        """The job with this trace window: its outcome, and the output of the worker that
        failed (empty when none did)."""
        job = LocalJob(
            script=profiled_command((script, *args.args), parts, window),
            workers=args.workers,
            # One GPU each where there are enough (a shared GPU would time contention).
            gpus_per_worker=None if len(gpus) >= args.workers else 0,
        )
        with console.status(f"profiling {script} as {args.workers} workers"):
            done = run_local_job(
                job,
                timeout_s=args.timeout,
                base_env=env,
                output_dir=scratch,
                log=lambda line: None,
            )
        if done.exit_code == 0:
            return done, ""
        failure = done.failures[-1] if done.failures else None
        label = failure.label if failure else "worker 0"
        try:
            with open(log_path(scratch, label), errors="replace") as handle:
                return done, f"{label}'s output ends with:\n" + handle.read()[-6000:]
        except OSError:
            return done, f"{label}: (no output)"

    def written(parts: str) -> int:
        # A worker makes the folder when it starts, so count the parts themselves.
        if not os.path.isdir(parts):
            return 0
        return sum(n.startswith("worker-") and n.endswith(".json") for n in os.listdir(parts))

    with tempfile.TemporaryDirectory(prefix="tfscale-profile-") as scratch:
        tries = itertools.count()  # each run writes its parts into a folder of its own

        def attempt(again: tuple[int, int]) -> tuple[Any, str, str]:
            parts = os.path.join(scratch, f"parts-{next(tries)}")
            return (*run(scratch, parts, again), parts)

        # The profiler's known crash (trace_crash_note): traced once more, then untraced.
        (done, tail, parts), note = retried_while_crashing(
            window,
            attempt,
            lambda outcome: (
                written(outcome[2]) < args.workers and crashed(outcome[0].exit_code, outcome[1]),
                outcome[0].exit_code,
            ),
            "A worker",
            "the job",
            lambda line: console.print(line, markup=False, soft_wrap=True),
        )
        if done.exit_code != 0 and not (
            written(parts) and any(measured(p) for p in read_workers(parts).values())
        ):
            # The workers' output went to files: the failed one's tail is the only word of it.
            raise ProfileError(
                explain(
                    f"The {args.workers}-worker job failed (exit status {done.exit_code}) "
                    "before any worker measured a training step.",
                    received=tail,
                    fix=f"run it as a job first: tfscale launch -n {args.workers} {script}",
                )
            )
        report = merge_workers(read_workers(parts), script)
    if note:
        report = dataclasses.replace(report, notes=[note, *report.notes])
    write_report(report, args.out)
    print_summary(report, args.out)
    _trace_line(args.out, console)
    return int(done.exit_code)


def _trace_line(out: str, console: Any) -> None:
    """Where the trace windows are, as TensorBoard runs (one per process)."""
    import os

    traces = os.path.join(out, "trace")
    if os.path.isdir(traces):
        runs = ", ".join(sorted(os.listdir(traces)))
        console.print(
            f"Traces ({runs}): tensorboard --logdir {traces}, Profile tab "
            "(its profile plugin: pip install xprof)",
            markup=False,
        )
