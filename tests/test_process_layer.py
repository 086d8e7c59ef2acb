"""Every child process starts through ``tfscale.processes``, and tfscale has no import cycle
between its modules nor between its packages.

Both are read from the source (AST), so they cost no process: a new ``subprocess.Popen``
or ``multiprocessing`` anywhere else, or a module importing one that imports it back,
fails here with the file and line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

_SRC = Path(__file__).resolve().parents[1] / "src"
_PACKAGE = _SRC / "tfscale"
_LAYER = "processes/"
_STARTING_MODULES = ("subprocess", "multiprocessing", "pty", "concurrent.futures.process")
_STARTING_CALLS = {"fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen"}
_STARTING_PREFIXES = ("exec", "spawn")


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(_PACKAGE.rglob("*.py")):
        parts = path.relative_to(_SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def _starts_children(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names]
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for name in [module or "", *names] if module else names:
                if name.startswith(_STARTING_MODULES):
                    found.append((node.lineno, f"imports {name}"))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and (node.attr in _STARTING_CALLS or node.attr.startswith(_STARTING_PREFIXES))
        ):
            found.append((node.lineno, f"os.{node.attr}"))
    return found


def test_no_child_process_is_started_outside_the_process_layer() -> None:
    found = []
    for name, path in _modules():
        if path.relative_to(_PACKAGE).as_posix().startswith(_LAYER):
            continue
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{name}:{line} {what}" for line, what in _starts_children(tree)]
    assert found == [], "start children with tfscale.processes (start, run, replace_process)"


def test_the_scan_sees_what_it_forbids() -> None:
    tree = ast.parse(
        "import subprocess\nfrom multiprocessing import Pool\nimport os\nos.execve('a', [], {})\n"
        "os.fork()\nos.spawnv(0, 'a', [])\n"
    )
    assert [what for _, what in _starts_children(tree)] == [
        "imports subprocess",
        "imports multiprocessing",
        "os.execve",
        "os.fork",
        "os.spawnv",
    ]


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """tfscale modules ``name`` imports, at its top or inside functions alike."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets.add(base)
            targets.update(f"{base}.{a.name}" for a in node.names)
    # "from tfscale.x import y" names module tfscale.x.y only when that module exists.
    return {t for t in targets if t in known and t != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search, each listed once."""
    found, state, stack = [], dict.fromkeys(graph, 0), []

    def visit(node: str) -> None:
        state[node], _ = 1, stack.append(node)
        for target in sorted(graph[node]):
            if state[target] == 1:
                found.append([*stack[stack.index(target) :], target])
            elif state[target] == 0:
                visit(target)
        state[node], _ = 2, stack.pop()

    for node in sorted(graph):
        if state[node] == 0:
            visit(node)
    return found


def test_no_import_cycle_between_tfscale_modules() -> None:
    modules = dict(_modules())
    known = set(modules)
    # A package's __init__ imported by its own submodules is Python's normal order, not a
    # cycle between concepts: edges to a parent package are left out.
    graph = {
        name: {t for t in _imports(name, path, known) if not name.startswith(t + ".")}
        for name, path in modules.items()
    }
    cycles = [" -> ".join(c) for c in _cycles(graph)]
    assert cycles == [], "import cycles (lazy imports inside functions count too)"


def test_the_cycle_search_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def _package_graph() -> dict[str, set[str]]:
    """The module graph with each package (and each root module) as one node:
    ``tfscale.training.fit`` -> ``training``, ``tfscale.interop.internals`` -> ``internals``."""
    modules = dict(_modules())
    known = set(modules)

    def unit(name: str) -> str:
        return name.split(".")[1] if name.count(".") else "tfscale"

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        source = unit(name)
        targets = {unit(t) for t in _imports(name, path, known)} - {source, "tfscale"}
        graph.setdefault(source, set()).update(targets)
    for targets in list(graph.values()):
        for target in targets:
            graph.setdefault(target, set())
    return graph


def test_no_import_cycle_between_packages() -> None:
    """Modules without a cycle can still make packages that import each other (training's
    checkpoint used the launcher's note while the launcher's worker used training's data):
    the packages must form no cycle either, so each can be read as a layer."""
    graph = _package_graph()
    assert {"training", "launch", "profiling", "cli"} <= set(graph), "the scan found too little"
    cycles = [" -> ".join(c) for c in _cycles(graph)]
    assert cycles == [], "import cycles between packages (lazy imports count too)"


def test_training_does_not_import_the_launcher() -> None:
    """Their contract (the report folder, the checkpoint note) is cluster/notes.py."""
    assert "launch" not in _package_graph()["training"]
