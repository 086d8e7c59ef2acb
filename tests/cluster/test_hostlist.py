"""Slurm hostlist expansion, checked against TensorFlow's own expansion."""

from __future__ import annotations

import pytest

from tfscale.cluster.hostlist import expand_hostlist, expand_tasks_per_node
from tfscale.errors import ClusterConfigError
from tfscale.interop.internals import slurm_cluster_resolver_module

_CASES = [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[8-10],b5", ["a8", "a9", "a10", "b5"]),
    ("gpu[008-010],login", ["gpu008", "gpu009", "gpu010", "login"]),
    ("n[1-2],m5,o[3-4,6,7-9]", ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
    ("c-[1-2]", ["c-1", "c-2"]),
]


_TASK_CASES = [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4])]


@pytest.mark.parametrize(("expression", "hosts"), _CASES)
def test_expand_hostlist(expression: str, hosts: list[str]) -> None:
    assert expand_hostlist(expression) == hosts


@pytest.mark.parametrize(("expression", "counts"), _TASK_CASES)
def test_expand_tasks_per_node(expression: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(expression) == counts


@pytest.mark.tf
def test_the_expected_expansions_are_tensorflows() -> None:
    """The cases above, expanded by TensorFlow's own SlurmClusterResolver module."""
    tf_slurm = slurm_cluster_resolver_module()
    for expression, hosts in _CASES:
        assert tf_slurm.expand_hostlist(expression) == hosts, expression
    for expression, counts in _TASK_CASES:
        assert tf_slurm.expand_tasks_per_node(expression) == counts, expression


@pytest.mark.parametrize(
    "expression",
    ["", "node[01-03", "node01-03]", "node[[1]]", "node[a-b]", "node[3-1]", "a,,b", "n[1-]"],
)
def test_bad_hostlists_name_the_field(expression: str) -> None:
    with pytest.raises(ClusterConfigError, match="SLURM_STEP_NODELIST"):
        expand_hostlist(expression)


@pytest.mark.parametrize("expression", ["", "2(x)", "x", "0", "2,(x2)", "-1"])
def test_bad_tasks_per_node_name_the_field(expression: str) -> None:
    with pytest.raises(ClusterConfigError, match="SLURM_STEP_TASKS_PER_NODE"):
        expand_tasks_per_node(expression)
