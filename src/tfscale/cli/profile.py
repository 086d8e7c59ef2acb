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
    parser.add_argument("script", help="the Python training script")
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
    import json
    import os
    import tempfile

    from rich.console import Console

    from tfscale.errors import ProfileError, explain
    from tfscale.profiling.report import print_summary, write_report
    from tfscale.profiling.script import ONE_REPLICA_ENV, script_report
    from tfscale.script_runner import check_script, run_in_child

    first, stop = trace_window(args.trace_steps)
    if args.timeout is not None and args.timeout <= 0:
        raise ProfileError(
            explain("--timeout must be positive.", received=args.timeout, fix="--timeout 600")
        )
    script = check_script(args.script, command="tfscale profile", error=ProfileError)
    console = Console(stderr=True)

    def measure(scratch: str, name: str, env: dict[str, str]) -> tuple[dict[str, Any], int]:
        out_json = os.path.join(scratch, name)
        ran = run_in_child(
            "tfscale.profiling.script",
            [out_json, str(first), str(stop), script, *args.args],
            timeout=args.timeout,
            env=env,
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
            raise ProfileError(
                explain(
                    "The script ended before any timing could be written.",
                    received=f"{script} (exit status {ran.status})",
                    fix="run it on its own first: python " + script,
                )
            )
        with open(out_json) as handle:
            return json.load(handle), int(ran.status or 0)

    with tempfile.TemporaryDirectory(prefix="tfscale-profile-") as scratch:
        with console.status(f"profiling {script} on its devices"):
            data, status = measure(scratch, "steps.json", {})
        fits = [f for f in data.get("fits", []) if f["steps_measured"]]
        reference = None
        if args.compare and status == 0 and fits and max(f["replicas"] for f in fits) > 1:
            with console.status(f"profiling {script} on 1 replica, for the comparison"):
                reference, _ = measure(scratch, "one.json", {ONE_REPLICA_ENV: "1"})
    report = script_report(data, script, reference)
    write_report(report, args.out)
    print_summary(report, args.out)
    for note in report.notes[2:]:
        console.print(note)
    return status
