"""Elastic Slurm jobs: which node the sbatch loop leaves out of the next step.

The sbatch script of ``tfscale launch --slurm --print-sbatch --min-workers M`` runs the job
step in a loop; after a failed step it asks ``tfscale launch --slurm --next-step DIR`` what
to do. The answer comes from the same rule as a local job's (``elastic.slot_to_drop``), with
the node as the slot:

- the node of the first task that failed is read from ``srun``'s own line
  (``srun: error: NODE: task 1: Killed``, written before the tasks srun stops are reported);
- a node that Slurm reports unusable (DOWN, DRAIN, FAIL, NOT_RESPONDING: ``State=IDLE*``)
  is left out at once, as a host that cannot be reached;
- a node whose task failed on every start until the restarts are used up is left out;
- the step restarts with ``srun --nodes=K --ntasks=K*T --exclude=NODES``, the nodes of
  the allocation (``SLURM_JOB_NODELIST``, expanded as ``scontrol show hostnames`` does)
  minus those left out, as long as ``M`` workers are left; otherwise the loop ends with
  the job's last line (which nodes were lost, the checkpoint to resume from).

State between the loop's turns is a JSON file in ``DIR``. Pure decisions (:func:`decide`)
and one impure entry (:func:`next_step`). TensorFlow-free.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from tfscale.cluster.hostlist import expand_hostlist
from tfscale.cluster.notes import read_checkpoint_note
from tfscale.launch.elastic import Drop, elastic_line, slot_to_drop

__all__ = [
    "NextStep",
    "StepState",
    "decide",
    "failed_node",
    "next_step",
    "srun_options",
    "unusable_nodes",
]

_STATE_FILE = "state.json"
_SRUN_ERROR = re.compile(r"^srun: error: (\S+): tasks? [\d,\-]+: (.+)$", re.MULTILINE)
_UNUSABLE = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWER_DOWN", "POWERED_DOWN")


def failed_node(srun_stderr: str) -> tuple[str, str] | None:
    """The node of the first task that failed and how (``("node2", "Killed")``), from
    ``srun``'s stderr; None when srun named no task (e.g. it could not start the step)."""
    match = _SRUN_ERROR.search(srun_stderr)
    return None if match is None else (match.group(1), match.group(2).strip())


def unusable_nodes(scontrol_nodes: str) -> set[str]:
    """Nodes that ``scontrol show node --oneliner`` reports unusable (a trailing ``*`` in
    the state is Slurm's "not responding")."""
    unusable = set()
    for line in scontrol_nodes.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        state = fields.get("State", "")
        if fields.get("NodeName") and (state.endswith("*") or any(s in state for s in _UNUSABLE)):
            unusable.add(fields["NodeName"])
    return unusable


@dataclass
class StepState:
    """What the loop remembers between steps.

    Attributes:
        nodes: The allocation's nodes, in order.
        excluded: Nodes left out, in the order they were lost.
        failed: The node that ended each failed step at the current size (None: unknown).
        dropped: The nodes dropped, as :class:`~tfscale.launch.elastic.Drop` fields.
    """

    nodes: list[str]
    excluded: list[str] = field(default_factory=list)
    failed: list[str | None] = field(default_factory=list)
    dropped: list[dict[str, object]] = field(default_factory=list)

    @property
    def left(self) -> list[str]:
        """The nodes the next step runs on."""
        return [n for n in self.nodes if n not in self.excluded]


@dataclass(frozen=True)
class NextStep:
    """The decision after a failed step.

    Attributes:
        restart: Start the step again (on ``state.left``).
        drop: The node left out by this decision, or None.
        below: The node whose loss leaves fewer than the minimum (the job fails), or None.
    """

    restart: bool
    drop: Drop | None = None
    below: Drop | None = None


def _node_drop(node: str, why: str, starts: int, tasks_left: int) -> Drop:
    return Drop(-1, f"node {node}", why, starts, tasks_left)


def decide(
    state: StepState,
    failure: tuple[str, str] | None,
    unusable: set[str],
    *,
    max_restarts: int,
    min_workers: int,
    tasks_per_node: int,
) -> NextStep:
    """Updates ``state`` with a failed step and says what the loop does next.

    Args:
        state: The loop's state (changed in place).
        failure: :func:`failed_node` of the step's srun stderr.
        unusable: :func:`unusable_nodes` of the allocation.
        max_restarts: Restarts per size.
        min_workers: ``--min-workers`` (workers = nodes x tasks per node).
        tasks_per_node: Workers per node.
    """
    node, how = failure if failure is not None else (None, "failed")
    state.failed.append(node)
    lost = [n for n in state.left if n in unusable]
    if lost:
        target, why, starts = lost[0], "not usable in Slurm (down, drained or not responding)", 1
    elif len(state.failed) <= max_restarts:
        return NextStep(restart=True)
    else:
        chosen = slot_to_drop(state.failed, max_restarts)
        if chosen is None or chosen not in state.left:
            return NextStep(restart=False)
        target, why, starts = chosen, f"its task: {how}", len(state.failed)
    tasks_left = (len(state.left) - 1) * tasks_per_node
    drop = _node_drop(target, why, starts, tasks_left)
    if tasks_left < min_workers:
        return NextStep(restart=False, below=drop)
    state.excluded.append(target)
    state.dropped.append(asdict(drop))
    state.failed = []
    return NextStep(restart=True, drop=drop)


def srun_options(state: StepState, tasks_per_node: int) -> str:
    """``srun`` options that run the step on ``state.left`` (empty before any loss)."""
    if not state.excluded:
        return ""
    left = len(state.left)
    return f"--nodes={left} --ntasks={left * tasks_per_node} --exclude={','.join(state.excluded)}"


def _load(folder: str, env: Mapping[str, str]) -> StepState:
    path = os.path.join(folder, _STATE_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            return StepState(**json.load(handle))
    return StepState(nodes=expand_hostlist(env["SLURM_JOB_NODELIST"], field="SLURM_JOB_NODELIST"))


def _save(folder: str, state: StepState) -> None:
    with open(os.path.join(folder, _STATE_FILE), "w", encoding="utf-8") as handle:
        json.dump(asdict(state), handle)


def _scontrol_nodes(nodes: Sequence[str]) -> str:
    from tfscale.processes import run

    try:
        done = run(["scontrol", "show", "node", "--oneliner", ",".join(nodes)], timeout=30)
    except OSError:
        return ""
    return done.stdout or "" if done.returncode == 0 else ""


def next_step(
    folder: str,
    *,
    attempt: int | None,
    max_restarts: int,
    min_workers: int,
    tasks_per_node: int,
    report_dir: str | None,
    env: Mapping[str, str],
    scontrol_nodes: Callable[[Sequence[str]], str] = _scontrol_nodes,
) -> tuple[int, str, str]:
    """One turn of the sbatch loop: ``(exit status, stdout, last line for stderr)``.

    With ``attempt`` (a step failed; its srun stderr is ``folder/srun-ATTEMPT.err``): status
    0 and the srun options of the next step, or 1 and the job's last line. Without it (the
    step succeeded): status 0 and, if nodes were dropped, the job's last line.
    """
    state = _load(folder, env)
    workers = len(state.nodes) * tasks_per_node
    dropped = [Drop(**d) for d in state.dropped]  # type: ignore[arg-type]
    if attempt is None:
        line = elastic_line(
            workers=workers,
            finished=len(state.left) * tasks_per_node,
            dropped=dropped,
            below=None,
            min_workers=min_workers,
            checkpoint=None,
        )
        return 0, "", "" if line is None else f"tfscale: {line}"
    try:
        with open(os.path.join(folder, f"srun-{attempt}.err"), encoding="utf-8") as handle:
            stderr = handle.read()
    except OSError:
        stderr = ""
    decision = decide(
        state,
        failed_node(stderr),
        unusable_nodes(scontrol_nodes(state.left)),
        max_restarts=max_restarts,
        min_workers=min_workers,
        tasks_per_node=tasks_per_node,
    )
    _save(folder, state)
    if decision.restart:
        line = ""
        if decision.drop is not None:
            line = (
                f"tfscale: leaving out {decision.drop.label} ({decision.drop.why}); restarting "
                f"the step on {', '.join(state.left)} from the last checkpoint"
            )
        return 0, srun_options(state, tasks_per_node), line
    checkpoint = read_checkpoint_note(report_dir) if report_dir else None
    line = elastic_line(
        workers=workers,
        finished=None,
        dropped=[Drop(**d) for d in state.dropped],  # type: ignore[arg-type]
        below=decision.below,
        min_workers=min_workers,
        checkpoint=checkpoint,
    )
    return 1, "", "" if line is None else f"tfscale: {line}"
