"""The test suite's own honesty: no assertion that cannot fail, no timing asserted.

A timing on a shared 2-core machine is a measurement, not a property: it belongs in
``benchmarks/`` as a ratio against a peer, and a test asserts what the code decides from the
numbers it is given (with an injected clock where it measures time). An assertion that holds
whatever the code does (``abs(x) >= 0``) hides a missing check. The scan reads every test
module's syntax tree; it imports none of them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
_CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns"}
# Names of measured quantities: comparing one with a number asserts a timing.
_TIMED = re.compile(
    r"(speedup|efficiency|examples_per_s|per_second|_ms$|_seconds$|^seconds$|\bshares?\b|"
    r"wall|elapsed|duration|fetch)",
    re.IGNORECASE,
)
_ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
# Quantities that are never negative by construction: ``>= 0`` holds whatever they are.
_NEVER_NEGATIVE = re.compile(r"(error|difference|distance)", re.IGNORECASE)


def _name_of(node: ast.AST) -> str | None:
    """The names a value is read by: ``x``, ``a.x``, ``a["x"]`` -> ``x``; ``s["k"]`` -> ``s.k``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return f"{_name_of(node.value) or ''}.{node.slice.value}"
    return None


def _is_number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float))


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.UnaryOp):
        return -_value(node.operand)
    assert isinstance(node, ast.Constant)
    return float(node.value)


def _is_call(node: ast.AST, names: set[str]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    return name in names


def _problems(tree: ast.AST) -> list[tuple[int, str]]:
    found: set[tuple[int, str]] = set()
    for statement in ast.walk(tree):
        if not isinstance(statement, ast.Assert):
            continue
        for node in ast.walk(statement.test):
            if _is_call(node, _CLOCKS) and not isinstance(node, ast.Compare):
                found.add((statement.lineno, "reads a clock inside an assert"))
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for left, op, right in zip(sides, node.ops, sides[1:], strict=False):
                for measured, bound, flipped in ((left, right, False), (right, left, True)):
                    if not _is_number(bound):
                        continue
                    name = _name_of(measured)
                    # abs(x) >= 0 (or len(x) >= 0) holds whatever x is.
                    if _is_call(measured, {"abs", "len"}) or (
                        name is not None and _NEVER_NEGATIVE.search(name)
                    ):
                        at_least = isinstance(op, ast.LtE if flipped else ast.GtE)
                        above = isinstance(op, ast.Lt if flipped else ast.Gt)
                        c = _value(bound)
                        if (at_least and c <= 0.0) or (above and c < 0.0):
                            found.add((statement.lineno, "a bound that always holds"))
                    if (
                        isinstance(op, _ORDER)
                        and name is not None
                        and "predicted" not in name
                        and _TIMED.search(name)
                    ):
                        found.add((statement.lineno, f"a timing ({name}) compared with a number"))
    return sorted(found)


def _test_sources() -> list[Path]:
    return sorted(p for p in _TESTS.rglob("*.py") if p.name != Path(__file__).name)


@pytest.mark.parametrize("source", _test_sources(), ids=lambda p: str(p.relative_to(_TESTS)))
def test_no_assertion_that_cannot_fail_and_no_timing_asserted(source: Path) -> None:
    problems = _problems(ast.parse(source.read_text(encoding="utf-8")))
    assert not problems, "\n".join(
        f"{source.relative_to(_TESTS.parent)}:{line}: {what} (tests/README.md: timings go "
        "to benchmarks/, tests assert what the code decides)"
        for line, what in problems
    )


@pytest.mark.parametrize(
    "code",
    [
        "assert abs(a - b) >= 0.0",
        "assert 0 <= abs(x)",
        "assert len(items) >= 0",
        "assert time.perf_counter() - start < 15",
        "assert time.monotonic() < deadline",
        "assert result['measured_speedup'] > 1.0",
        "assert 0 < point.efficiency < 1",
        "assert shares['compute'] > 0",
        "assert report.communication_ms > 0",
        "assert verification['relative_error'] >= 0.0",
        "assert all(fetch >= 0.0 for fetch in seen)",
    ],
)
def test_the_scan_finds_what_it_is_for(code: str) -> None:
    assert _problems(ast.parse(code))


@pytest.mark.parametrize(
    "code",
    [
        "assert abs(a - b) <= 1e-5",
        "assert relative_difference(x, y) > 0.0",
        "assert advice.predicted_speedup == pytest.approx(1.43)",
        "assert compress.predicted_speedup > 1",
        "assert len(items) >= 2",
        "assert shares == {'compute': 1.0}",
    ],
)
def test_the_scan_lets_real_checks_through(code: str) -> None:
    assert not _problems(ast.parse(code))
