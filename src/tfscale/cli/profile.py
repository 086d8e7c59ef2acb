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
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop the script after this long (default: no limit)",
    )
    parser.add_argument("script", help="the Python training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Runs the script in a child process, then builds and prints the report."""
    import json
    import os
    import tempfile

    from tfscale.errors import ProfileError, explain
    from tfscale.profiling.report import print_summary, write_report
    from tfscale.profiling.script import script_report
    from tfscale.script_runner import check_script, run_in_child

    script = check_script(args.script, command="tfscale profile", error=ProfileError)
    first, _, stop = args.trace_steps.partition(",")
    with tempfile.TemporaryDirectory(prefix="tfscale-profile-") as scratch:
        out_json = os.path.join(scratch, "steps.json")
        ran = run_in_child(
            "tfscale.profiling.script",
            [out_json, first, stop or first, script, *args.args],
            timeout=args.timeout,
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
            data = json.load(handle)
    report = script_report(data, script)
    write_report(report, args.out)
    print_summary(report, args.out)
    return 0 if ran.status == 0 else int(ran.status or 1)
