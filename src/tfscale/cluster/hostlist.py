"""Slurm hostlist and tasks-per-node expressions, expanded without TensorFlow or ``scontrol``.

Slurm writes node lists compactly (``node[01-03,07],gpu5``) and tasks per node run-length
encoded (``2(x3),1``). The launcher runs where TensorFlow may not be importable yet, so it
expands both itself; a test checks the result against TensorFlow's ``SlurmClusterResolver``.
"""

from __future__ import annotations

import re

from tfscale.errors import ClusterConfigError, explain

__all__ = ["expand_hostlist", "expand_tasks_per_node"]

_PART = re.compile(r"([^,\[\]]*)(?:\[([^\[\]]+)\])?([^,\[\]]*)")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_hostlist(expression: str, *, field: str = "SLURM_STEP_NODELIST") -> list[str]:
    """Expands a Slurm hostlist expression into host names, keeping Slurm's order.

    Args:
        expression: e.g. ``"node[01-03,07],login1"``.
        field: The environment variable it came from, named in errors.

    Returns:
        The host names, e.g. ``["node01", "node02", "node03", "node07", "login1"]``.

    Raises:
        ClusterConfigError: The expression is empty or not valid hostlist syntax.
    """
    hosts: list[str] = []
    for part in _split_outside_brackets(expression, field):
        match = _PART.fullmatch(part)
        if match is None or not part:
            raise _bad_hostlist(expression, field, f"cannot read {part!r}")
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for item in ranges.split(","):
            hosts.extend(prefix + n + suffix for n in _expand_range(item, expression, field))
    return hosts


def _split_outside_brackets(expression: str, field: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current = ""
    for char in expression.strip():
        if char == "[":
            depth += 1
            if depth > 1:
                raise _bad_hostlist(expression, field, "nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _bad_hostlist(expression, field, "']' without '['")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise _bad_hostlist(expression, field, "'[' without ']'")
    parts.append(current)
    if any(not p for p in parts):
        raise _bad_hostlist(expression, field, "empty host name")
    return parts


def _expand_range(item: str, expression: str, field: str) -> list[str]:
    match = _RANGE.fullmatch(item)
    if match is None:
        raise _bad_hostlist(expression, field, f"range {item!r} is not N or N-M")
    low, high = match.group(1), match.group(2) or match.group(1)
    if int(high) < int(low):
        raise _bad_hostlist(expression, field, f"range {item!r} runs backwards")
    width = len(low)  # Slurm keeps leading zeros: node[08-10] -> node08 node09 node10
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def _bad_hostlist(expression: str, field: str, why: str) -> ClusterConfigError:
    return ClusterConfigError(
        explain(
            f"{field} is not a valid Slurm hostlist ({why}).",
            received=repr(expression),
            allowed="comma-separated names with optional [ranges], e.g. node[01-03,07],login1",
            fix=f"run inside a Slurm job step (srun), where Slurm sets {field} itself.",
        )
    )


def expand_tasks_per_node(
    expression: str, *, field: str = "SLURM_STEP_TASKS_PER_NODE"
) -> list[int]:
    """Expands Slurm's tasks-per-node list, e.g. ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        ClusterConfigError: The expression is not valid.
    """
    counts: list[int] = []
    for part in expression.strip().split(","):
        match = _TASKS.fullmatch(part.strip())
        if match is None or int(match.group(1)) == 0:
            raise ClusterConfigError(
                explain(
                    f"{field} is not a valid Slurm tasks-per-node list.",
                    received=repr(expression),
                    allowed="comma-separated counts >= 1 with optional (xR) repeats, e.g. 2(x3),1",
                    fix=f"run inside a Slurm job step (srun), where Slurm sets {field} itself.",
                )
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
