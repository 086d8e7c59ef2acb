"""Every ``tfscale doctor`` command in docs/doctor.md and docs/scope.md, run as written.

A command line of a ``sh`` block that starts with ``tfscale doctor`` is run through the
command line's own entry point (the script ones start their instrumented child); where the
comment says ``# exit N``, that is the status it must return. ``--json`` output must parse.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tfscale.cli.main import main

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/doctor.md", "docs/scope.md")


def documented_commands() -> list[tuple[str, list[str], int | None]]:
    """``(doc, argv after 'tfscale', documented exit status or None)`` for each command."""
    found = []
    for doc in DOCS:
        in_sh = False
        for line in (ROOT / doc).read_text().splitlines():
            if line.startswith("```"):
                in_sh = line.strip() == "```sh"
                continue
            if in_sh and line.startswith("tfscale doctor"):
                command, _, comment = line.partition("#")
                status = re.match(r"\s*exit (\d+)", comment)
                found.append((doc, shlex.split(command)[1:], int(status[1]) if status else None))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_the_doctor_commands_this_test_runs() -> None:
    scripts = [argv for _, argv, _ in COMMANDS if "--script" in argv]
    assert len(COMMANDS) >= 7 and len(scripts) >= 5
    for _, argv, _ in COMMANDS:
        if "--script" in argv:  # a real file: an example of the repository
            assert (ROOT / argv[argv.index("--script") + 1]).is_file(), argv


@pytest.mark.parametrize(
    ("doc", "argv", "status"), COMMANDS, ids=[" ".join(argv) for _, argv, _ in COMMANDS]
)
def test_documented_doctor_command_runs_as_documented(
    doc: str,
    argv: list[str],
    status: int | None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(ROOT)
    got = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if status is not None:
        assert got == status, f"{doc}: tfscale {' '.join(argv)} -> {got}\n{out[-2000:]}"
    else:  # the environment checks: 1 only when a check fails on this machine
        assert got in (0, 1), out[-2000:]
    if "--json" in argv:
        payload = json.loads(out)
        assert ("problems" in payload) if "--script" in argv else ("checks" in payload)
    if "train_fixed_scope.py" in argv:
        assert "outside, then moved in: tfscale.fix_scope at" in out
        assert "examples/train_fixed_scope.py:" in out and "Problem" not in out
