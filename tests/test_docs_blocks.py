"""Every Python block of README.md and docs/*.md: marked, and the runnable ones run as written.

The line before each ```` ```python ```` fence says what the block is (tests/README.md, "The
docs' Python blocks"): ``<!-- runnable -->`` (a whole program; ``<!-- runnable: NAME=VALUE
-->`` names the environment it runs with) or ``<!-- fragment: why -->`` (a piece of a larger
program). A runnable block is saved as a file and run in a fresh Python, as a reader who
pastes it would; the README's first block also runs in a new virtualenv made from the clone
with ``pip install ".[cpu]"`` (#39: the quickstart needs nothing the repository's ``.venv``
has and a user's environment lacks).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tfscale.processes import run
from tfscale.testing import run_python

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

# The info strings GitHub highlights as Python: a block under any of them is a Python block.
_PYTHON = {"python", "py", "python3", "py3", "pycon"}
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\s`]*)")
_MARKER = re.compile(r"^<!--\s*(?P<kind>runnable|fragment)\b\s*(?::(?P<rest>.*?))?\s*-->\s*$")
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


@dataclass(frozen=True)
class Block:
    """One fenced Python block of a document.

    Attributes:
        doc: The document's path relative to the repository.
        line: The line of the opening fence (1-based).
        kind: ``"runnable"``, ``"fragment"``, or None when the line before is no marker.
        env: For a runnable block, the environment its marker names.
        code: The block's text.
        problems: What is wrong with its marking (empty when nothing).
    """

    doc: str
    line: int
    kind: str | None
    env: dict[str, str] = field(default_factory=dict)
    code: str = ""
    problems: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def python_blocks(text: str, doc: str) -> tuple[list[Block], list[str]]:
    """The Python blocks of a Markdown text, and the markers that precede no Python block.

    Args:
        text: The document.
        doc: Its name, for the blocks' ``where``.

    Returns:
        ``(blocks, stray)``: every Python block in order, and one message per marker that is
        not on the line right before a Python block's fence.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    stray: list[str] = []
    i = 0
    while i < len(lines):
        marker = _MARKER.match(lines[i].strip())
        opening = _FENCE.match(lines[i])
        if marker and not (i + 1 < len(lines) and _is_python_fence(lines[i + 1])):
            stray.append(f"{doc}:{i + 1}: {lines[i].strip()} is not right before a Python block")
        if not opening:
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].lower()
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence[0] * len(fence)):
            end += 1
        if info in _PYTHON:
            before = _MARKER.match(lines[i - 1].strip()) if i > 0 else None
            blocks.append(_block(doc, i + 1, before, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return blocks, stray


def _is_python_fence(line: str) -> bool:
    opening = _FENCE.match(line)
    return bool(opening and opening["info"].lower() in _PYTHON)


def _block(doc: str, line: int, marker: re.Match[str] | None, code: str) -> Block:
    if marker is None:
        return Block(doc, line, None, code=code, problems=("no marker on the line before",))
    kind, rest = marker["kind"], (marker["rest"] or "").strip()
    if kind == "fragment":
        return Block(doc, line, kind, code=code)
    words = rest.split()
    bad = tuple(f"{w!r} is not NAME=VALUE" for w in words if not _ENV.match(w))
    env = dict(w.split("=", 1) for w in words if _ENV.match(w))
    return Block(doc, line, kind, env=env, code=code, problems=bad)


def _all_blocks() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    stray: list[str] = []
    for path in DOCS:
        found, lost = python_blocks(path.read_text(), str(path.relative_to(ROOT)))
        blocks += found
        stray += lost
    return blocks, stray


BLOCKS, STRAY = _all_blocks()
RUNNABLE = [b for b in BLOCKS if b.kind == "runnable"]
_QUICKSTART = RUNNABLE[0].where  # README's first runnable block


def test_the_marker_parser_tells_runnable_fragment_unmarked_and_stray_markers_apart() -> None:
    text = "\n".join(
        [
            "<!-- runnable: TFSCALE_VIRTUAL_DEVICES=2 -->",
            "```python",
            "print(1)",
            "```",
            "<!-- fragment: model yours -->",
            "```py",
            "model.fit(x)",
            "```",
            "```python",
            "unmarked()",
            "```",
            "<!-- runnable: lowercase=1 -->",
            "```python",
            "x = 1",
            "```",
            "<!-- fragment -->",
            "",
            "```sh",
            "# a marker before a shell block",
            "```",
            "````markdown",
            "```python",
            "inside_another_fence()",
            "```",
            "````",
        ]
    )
    blocks, stray = python_blocks(text, "doc.md")
    assert [(b.line, b.kind) for b in blocks] == [
        (2, "runnable"),
        (6, "fragment"),
        (9, None),
        (13, "runnable"),
    ]
    assert blocks[0].env == {"TFSCALE_VIRTUAL_DEVICES": "2"} and blocks[0].code == "print(1)\n"
    assert blocks[2].problems == ("no marker on the line before",)
    assert blocks[3].problems == ("'lowercase=1' is not NAME=VALUE",)
    assert stray == ["doc.md:16: <!-- fragment --> is not right before a Python block"]


def test_every_python_block_of_the_docs_is_marked_runnable_or_fragment() -> None:
    unmarked = [f"{b.where}: {p}" for b in BLOCKS for p in b.problems]
    assert not unmarked + STRAY, (
        "Each ```python block of README.md and docs/*.md needs, on the line before it, "
        "<!-- runnable --> (it runs as written; tests/test_docs_blocks.py runs it) or "
        "<!-- fragment: why --> (tests/README.md):\n" + "\n".join(unmarked + STRAY)
    )


def test_the_readme_opens_with_install_and_a_runnable_quickstart() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    readme = [b for b in BLOCKS if b.doc == "README.md"]
    assert readme and readme[0].kind == "runnable", "README.md's first Python block must run"
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; #39 holds it to 250"
    assert "## Install" in lines[:60], "README.md's install section must be in its first 60 lines"


def test_each_question_of_the_readme_shows_its_snippet_within_a_screen_of_its_heading() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    questions = [i for i, line in enumerate(lines) if re.match(r"## [1-4]\. ", line)]
    assert len(questions) == 4, [lines[i] for i in questions]
    for i in questions:
        fence = next((j for j in range(i, len(lines)) if _FENCE.match(lines[j])), len(lines))
        assert fence - i <= 30, f"{lines[i]!r}: its first snippet is {fence - i} lines below"


def _runnable(block: Block) -> object:
    """The block as a parameter: ``make test`` runs the quickstart; each other block (a
    child that starts TensorFlow, 2.5-3.5 CPU-seconds) runs in ``make test-full``, naming the
    quickstart's run, which takes the same way through a fresh process (#41)."""
    if block.where == _QUICKSTART:
        return pytest.param(block, id=block.where)
    equivalent = f"tests/test_docs_blocks.py::test_a_runnable_block_runs_as_written[{_QUICKSTART}]"
    return pytest.param(block, id=block.where, marks=pytest.mark.full(equivalent))


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", [_runnable(block) for block in RUNNABLE])
def test_a_runnable_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code)
    # As `python block.py` would: the file's own name in tracebacks and in what tfscale
    # reports (file:line), its folder first on sys.path, __name__ == "__main__".
    result = run_python(
        f"import runpy, sys; sys.argv = [{str(script)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')",
        env=block.env,
        cwd=str(tmp_path),
        timeout=300,
    )
    assert result.returncode == 0, (
        f"{block.where} fails as written:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )


def _source_files() -> list[str]:
    """The files a fresh clone of this checkout would have, with its uncommitted changes."""
    done = run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"git ls-files failed in {ROOT}: {done.stderr}"
    listed: str = done.stdout
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


@pytest.mark.slow
@pytest.mark.multiprocess
# The install is what this adds; the quickstart block itself runs in make test.
@pytest.mark.full(
    f"tests/test_docs_blocks.py::test_a_runnable_block_runs_as_written[{_QUICKSTART}]"
)
def test_the_quickstart_runs_in_a_fresh_virtualenv_after_pip_install_cpu(tmp_path: Path) -> None:
    quickstart = next(b for b in BLOCKS if b.doc == "README.md")
    clone = tmp_path / "clone"
    for name in _source_files():
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, clone / name)
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    # uv where the Makefile installed it (the same resolution as pip, from the local cache,
    # so TensorFlow is not downloaded again); pip otherwise.
    uv = Path(sys.executable).parent / "uv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    try:
        steps = [[sys.executable, "-m", "venv", "--without-pip", str(venv)]]
        if uv.exists():
            steps.append([str(uv), "pip", "install", "--quiet", "--python", str(python), ".[cpu]"])
        else:
            steps[0].remove("--without-pip")
            steps.append([str(python), "-m", "pip", "install", "--quiet", ".[cpu]"])
        for argv in steps:
            done = run(argv, timeout=600, env=env, cwd=clone)
            assert done.returncode == 0 and not done.timed_out, (argv, done.stdout, done.stderr)
        elsewhere = tmp_path / "user"
        elsewhere.mkdir()
        (elsewhere / "quickstart.py").write_text(quickstart.code)
        done = run(
            [str(python), "quickstart.py"],
            timeout=300,
            env={**env, **quickstart.env, "TF_CPP_MIN_LOG_LEVEL": "2"},
            cwd=elsewhere,
        )
        assert done.returncode == 0 and not done.timed_out, done.stdout + done.stderr
        # tfscale from the new virtualenv, not from this checkout's src/.
        where = run(
            [str(python), "-c", "import tfscale; print(tfscale.__file__)"],
            timeout=60,
            env=env,
            cwd=elsewhere,
        )
        assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
        assert "replicas: 2" in done.stdout, done.stdout
    finally:
        shutil.rmtree(venv, ignore_errors=True)
