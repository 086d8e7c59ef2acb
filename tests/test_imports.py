"""What may import what: no import cycle between tfscale's packages (each root module counts
as one), and training never imports the launcher (their contract is ``cluster/notes.py``).
Read from the source, function-level imports included, so nothing is imported here."""

from __future__ import annotations

import ast
from pathlib import Path

import tfscale

_SRC = Path(tfscale.__file__).parent


def _unit(module: str) -> str:
    """``tfscale.training.fit`` -> ``training``; ``tfscale.internals`` -> ``internals``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tfscale"


def package_imports() -> dict[str, dict[str, set[str]]]:
    """``{unit: {imported unit: {modules of unit that import it}}}``."""
    edges: dict[str, dict[str, set[str]]] = {}
    for path in sorted(_SRC.rglob("*.py")):
        parts = path.relative_to(_SRC.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        source = _unit(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
                if node.module == "tfscale":  # from tfscale import internals
                    names = [f"tfscale.{alias.name}" for alias in node.names]
            for name in names:
                if name.startswith("tfscale.") and source != "tfscale":
                    target = _unit(name)
                    if target != source:
                        edges.setdefault(source, {}).setdefault(target, set()).add(module)
    return edges


def _cycles(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for other in edges.get(unit, {}):
            if other not in index:
                visit(other)
                low[unit] = min(low[unit], low[other])
            elif other in stack:
                low[unit] = min(low[unit], index[other])
        if low[unit] == index[unit]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for unit in list(edges):
        if unit not in index:
            visit(unit)
    return found


def test_no_import_cycle_between_packages() -> None:
    edges = package_imports()
    assert {"training", "launch", "profiling", "cli"} <= set(edges), "the scan found too little"
    cycles = _cycles(edges)
    described = [
        {a: {b: sorted(edges[a][b]) for b in cycle if b in edges.get(a, {})} for a in cycle}
        for cycle in cycles
    ]
    assert cycles == [], f"import cycles between packages: {described}"


def test_training_does_not_import_the_launcher() -> None:
    assert "launch" not in package_imports().get("training", {})


def test_the_cycle_check_finds_a_cycle() -> None:
    edges = {"a": {"b": {"tfscale.a.x"}}, "b": {"c": {"tfscale.b.y"}}, "c": {"a": {"z"}}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b": {"x"}}}) == []
