"""Whether the workers of a ``tfscale launch`` job trained together, and why not.

A worker of an N-worker job whose script builds ``MirroredStrategy()`` (this machine's devices
only), falls back to one device, or trains under no strategy at all, trains alone: the job
would run N solo trainings and exit 0. The worker runner (``launch/worker.py``) judges what
each worker's script does with the pure functions here and, when it trains alone, stops it
and leaves a :class:`Verdict` in the job's report folder; the launcher reads them after the
job and ends with the reason. TensorFlow-free.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

__all__ = [
    "LABEL_ENV",
    "NOT_TOGETHER_STATUS",
    "PORT_TAKEN_STATUS",
    "Verdict",
    "alone_reason",
    "final_line",
    "read_verdicts",
    "write_verdict",
]

#: The task's label, ``worker 1`` or ``chief 0``.
LABEL_ENV = "TFSCALE_LAUNCH_TASK"
#: The exit status of a worker that would not train with the others (sysexits' EX_CONFIG):
#: the job is not restarted, the same script would do the same again.
NOT_TOGETHER_STATUS = 78
#: The exit status of a worker whose gRPC server could not listen on the port the launcher
#: chose for it (sysexits' EX_TEMPFAIL): another program took the port between the choice and
#: the worker's start (an outgoing connection's ephemeral port, most often). The launcher
#: starts the job again on new ports without counting a restart.
PORT_TAKEN_STATUS = 75

_PARAMETER_SERVER = "ParameterServerStrategy"


@dataclass(frozen=True)
class Verdict:
    """Why one task of a job did not train with the others.

    Attributes:
        task: Its label (``worker 1``).
        reason: What its script did.
        fix: How to make it train with the others.
    """

    task: str
    reason: str
    fix: str


def alone_reason(
    strategy_class: str, strategy_workers: int, job_workers: int, parameter_servers: bool
) -> str | None:
    """Why a strategy the script built makes its worker train alone, or None if it does not.

    Args:
        strategy_class: The strategy's class name.
        strategy_workers: Worker processes the strategy spans (1 without a cluster).
        job_workers: Worker processes of the job (chief included).
        parameter_servers: The job has parameter servers (a ParameterServerStrategy job).
    """
    if parameter_servers:
        if strategy_class.startswith(_PARAMETER_SERVER):
            return None
        return (
            f"its script built {strategy_class}, not ParameterServerStrategy, in a job with "
            "parameter servers"
        )
    if strategy_workers >= job_workers > 1:
        return None
    if job_workers <= 1:
        return None
    return (
        f"its script built {strategy_class} over this worker's devices only "
        f"({strategy_workers} of the job's {job_workers} workers), so it trained alone"
    )


def write_verdict(folder: str, verdict: Verdict) -> None:
    """Leaves ``verdict`` in ``folder`` for the launcher (one file per task)."""
    name = verdict.task.replace(" ", "-") + ".json"
    with open(os.path.join(folder, name), "w", encoding="utf-8") as handle:
        json.dump(asdict(verdict), handle)


def read_verdicts(folder: str) -> list[Verdict]:
    """Every verdict the tasks left in ``folder``, by task label."""
    verdicts = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                verdicts.append(Verdict(**json.load(handle)))
    return verdicts


def final_line(verdicts: list[Verdict]) -> str:
    """The job's last line: which task trained alone (the first), why, and the fix."""
    first = verdicts[0]
    others = f" (and {len(verdicts) - 1} other task(s))" if len(verdicts) > 1 else ""
    return f"{first.task} did not train with the others{others}: {first.reason}. Fix: {first.fix}"
