"""Every ``tfscale doctor`` command in docs/doctor.md and docs/scope.md, run as written.

A command line of a ``sh`` block that starts with ``tfscale doctor`` is run through the
command line's own entry point (the script ones start their instrumented child); where the
comment says ``# exit N``, that is the status it must return. ``--json`` output must parse.
The runs of the examples are also where their findings are checked (``_SHOWS``: the variables
built outside the scope named with file and line, the replica devices, the repair), so that
each example runs once; ``test_script.py`` checks the rest of ``doctor --script``. An example
the docs run more than once (other options: ``--epochs``, ``--timeout``, which
``test_cli.py`` and ``test_script.py`` check on their own children) runs once in ``make
test``, in its command with findings to check; its other commands are ``full``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tfscale.cli.main import main

# The environment commands take the snapshot in this process (TensorFlow imported); the
# script commands start their child.
pytestmark = [pytest.mark.tf, pytest.mark.multiprocess]

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


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _names_the_variables_built_outside_the_scope(out: str) -> None:
    script = ROOT / "examples" / "train_outside_scope.py"
    construct = _line_of(script, "return keras.Sequential(")
    call = _line_of(script, "model = build_model()")
    strategy_line = _line_of(script, "strategy = tf.distribute.MirroredStrategy()")
    assert (
        f"4 variables (4 trainable: sequential/dense/kernel, sequential/dense/bias, "
        f"sequential/dense_1/kernel ...) were created outside the scope of MirroredStrategy "
        f"(2 replicas, created at examples/train_outside_scope.py:{strategy_line}) at "
        f"examples/train_outside_scope.py:{construct} in build_model, called from "
        f"examples/train_outside_scope.py:{call}; they live on /device:CPU:0 only." in out
    ), out
    assert "The CPU was split into 2 logical devices" in out
    assert "MirroredStrategy never ran a step" in out
    assert "with strategy.scope():" in out and "tfscale.fix_scope(model, strategy)" in out
    # The fixes for a saved model and for tfscale.fit, which now moves a trained one in too.
    assert "keras.models.load_model(path) inside the scope" in out
    assert "tfscale.fit(model, ...), which moves it in" in out
    assert "OK:" not in out


def _shows_the_replica_devices(out: str) -> None:
    report = json.loads(out)
    assert report["ok"] is True and report["problems"] == [] and report["crashed"] is False
    assert report["devices_set_by_doctor"] is True and report["virtual_devices"] == "2"
    (mirrored,) = report["strategies"]
    assert mirrored["kind"] == "MirroredStrategy" and mirrored["replicas"] == 2
    assert mirrored["replica_devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert report["default_runs"] == []
    model_group = report["variables"][0]
    assert model_group["strategy"] == "MirroredStrategy" and model_group["count"] == 4
    assert model_group["devices"] == ["/device:CPU:0", "/device:CPU:1"]


def _names_the_repair(out: str) -> None:
    # The verdict's words, and the repair's name (its site is folded in the table, not cut).
    assert "moved into it before training (8 moved)" in " ".join(out.split()), out
    assert "tfscale.fix_scope" in out and "…" not in out and "Problem" not in out


# What the run of a documented command must show besides its status.
_SHOWS = {
    "doctor --script examples/train_outside_scope.py": _names_the_variables_built_outside_the_scope,
    "doctor --json --script examples/train_in_scope.py": _shows_the_replica_devices,
    "doctor --script examples/train_fixed_scope.py": _names_the_repair,
}


def test_the_docs_show_the_doctor_commands_this_test_runs() -> None:
    scripts = [argv for _, argv, _ in COMMANDS if "--script" in argv]
    assert len(COMMANDS) >= 7 and len(scripts) >= 5
    # A doc edit that changes one of these commands must move its checks with it.
    assert set(_SHOWS) <= {" ".join(argv) for _, argv, _ in COMMANDS}
    for _, argv, _ in COMMANDS:
        if (script := _script(argv)) is not None:  # a real file: an example of the repository
            assert (ROOT / script).is_file(), argv


def _script(argv: list[str]) -> str | None:
    return argv[argv.index("--script") + 1] if "--script" in argv else None


def _command_id(argv: list[str]) -> str:
    return " ".join(argv)


def _param(doc: str, argv: list[str], status: int | None) -> object:
    """The command as a parameter. Each command with ``--script`` starts its example in a
    child (2.5-4 CPU-seconds of TensorFlow's start-up): ``make test`` runs the one whose
    finding the doctor exists for (a model built outside the scope, :data:`_IN_MAKE_TEST`);
    the others run in ``make test-full``, naming it (#41)."""
    if _script(argv) is None or _command_id(argv) == _IN_MAKE_TEST:
        return pytest.param(doc, argv, status, id=_command_id(argv))
    equivalent = f"tests/doctor/test_docs.py::{_DOCUMENTED}[{_IN_MAKE_TEST}]"
    return pytest.param(doc, argv, status, id=_command_id(argv), marks=pytest.mark.full(equivalent))


_DOCUMENTED = "test_documented_doctor_command_runs_as_documented"
_IN_MAKE_TEST = "doctor --script examples/train_outside_scope.py"


@pytest.mark.parametrize(("doc", "argv", "status"), [_param(*command) for command in COMMANDS])
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
    if " ".join(argv) in _SHOWS:
        _SHOWS[" ".join(argv)](out)
