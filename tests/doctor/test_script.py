"""`tfscale doctor --script`: real child runs of small scripts, and the pure judgement (the
examples' runs: ``test_docs.py``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from tfscale.doctor.script import exit_status, render, run_script, summarize
from tfscale.errors import TfscaleError

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(autouse=True)
def _in_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # sites are shown relative to the working directory


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# The examples' runs (a model built outside the scope named with file and line, the replica
# devices of one built inside it, a repaired one) are checked on the documented commands that
# run them: test_docs.py.


@pytest.mark.full(
    "tests/doctor/test_docs.py::"
    "test_documented_doctor_command_runs_as_documented"
    "[doctor --script examples/train_outside_scope.py]",
)
def test_crashing_script_returns_its_status_and_stderr_tail(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = run_script([str(DATA / "crashes.py"), "--epochs", "1"], timeout=150)
    out = capsys.readouterr().out
    assert status == 3
    assert "The script failed with exit status 3" in out
    assert "loading data failed: no such file train.csv" in out


def test_script_past_timeout_is_stopped_and_leaves_no_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = run_script([str(DATA / "sleeps.py")], timeout=2)
    assert status == 0  # no scope problem seen before it was stopped
    assert "ran past the timeout and was stopped" in capsys.readouterr().out


def test_missing_script_is_a_clear_error() -> None:
    with pytest.raises(TfscaleError, match="does not exist"):
        run_script(["no/such/train.py"])
    with pytest.raises(TfscaleError, match="needs the script"):
        run_script([])


def _variable(site: str, strategy: str | None, *, copy: bool = False) -> dict[str, object]:
    return {
        "kind": "variable",
        "name": "dense/kernel:0",
        "stack": [site],
        "strategy": strategy,
        "replicas": 2 if strategy else 1,
        "device": "/device:GPU:1" if copy else "/device:GPU:0",
        "trainable": True,
        "copy": copy,
    }


_MIRRORED = {
    "kind": "strategy",
    "strategy_id": 7,
    "strategy": "MirroredStrategy",
    "replicas": 2,
    "devices": ["/device:GPU:0", "/device:GPU:1"],
    "stack": ["train.py:5 in <module>"],
}


def test_summarize_judges_only_scripts_with_a_multi_replica_strategy() -> None:
    mirrored = _MIRRORED
    outside = [_variable("train.py:9 in <module>", None)]
    inside = [
        _variable("train.py:9 in <module>", "MirroredStrategy"),
        _variable("train.py:9 in <module>", "MirroredStrategy", copy=True),
    ]
    bad = summarize([mirrored, *outside], script="train.py", exit_status=0)
    assert bad.problems and "at train.py:9;" in bad.problems[0]
    assert exit_status(bad) == 1
    good = summarize([mirrored, *inside], script="train.py", exit_status=0)
    assert good.problems == () and exit_status(good) == 0
    assert good.variables[0].count == 1
    assert good.variables[0].devices == ("/device:GPU:0", "/device:GPU:1")
    single = summarize(outside, script="train.py", exit_status=0)  # no strategy at all
    assert single.problems == () and exit_status(single) == 0
    crashed = summarize([mirrored, *outside], script="train.py", exit_status=-9)
    assert crashed.crashed and exit_status(crashed) == 137


@pytest.mark.full(
    "tests/doctor/test_docs.py::"
    "test_documented_doctor_command_runs_as_documented"
    "[doctor --script examples/train_outside_scope.py]",
)
def test_variables_moved_into_the_scope_by_tfscale_fit_are_no_problem(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = run_script([str(DATA / "fit_outside_scope.py")], json_output=True, timeout=150)
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["problems"] == [], report
    # The model's 4 weights (line 9) and compile()'s 4 metric variables (line 10).
    weights, metrics = [g for g in report["variables"] if g["repaired_by"]]
    assert (weights["count"], weights["trainable"], metrics["count"]) == (4, 4, 4)
    for moved in (weights, metrics):
        assert moved["strategy"] is None
        assert moved["repaired_by"].startswith("tfscale.prepare at ")
        assert "fit_outside_scope.py:14" in moved["repaired_by"]
    (mirrored,) = report["strategies"]
    assert mirrored["replica_devices"] == ["/device:CPU:0", "/device:CPU:1"]


def test_a_repair_covers_the_variables_created_before_it_only() -> None:
    mirrored = _MIRRORED
    before = {**_variable("train.py:9 in <module>", None), "id": 11}
    repaired = {
        "kind": "repaired",
        "ids": [11],
        "how": "tfscale.fix_scope",
        "stack": ["train.py:12 in <module>"],
    }
    reused = {**_variable("train.py:20 in <module>", None), "id": 11}  # same id, later
    findings = summarize([mirrored, before, repaired, reused], script="train.py", exit_status=0)
    fixed, late = findings.variables
    assert fixed.repaired_by == "tfscale.fix_scope at train.py:12" and late.repaired_by is None
    (problem,) = findings.problems
    assert "at train.py:20;" in problem and exit_status(findings) == 1


def test_the_tables_fold_long_sites_instead_of_cutting_them() -> None:
    """A site is one long word: an 80-column table folds it over lines (it cut it to
    "examples/train_fi…", the repair's line lost)."""
    site = "examples/a_folder_with_a_long_name/train_fixed_scope_long_name.py:12"
    made = {**_variable(f"{site} in <module>", None), "id": 11}
    repaired = {"kind": "repaired", "ids": [11], "how": "tfscale.fix_scope", "stack": [site]}
    findings = summarize([_MIRRORED, made, repaired], script="train.py", exit_status=0)
    buffer = io.StringIO()
    render(findings, Console(file=buffer, width=80, no_color=True))
    out = buffer.getvalue()
    assert "…" not in out, out
    # The variables table's "strategy scope" cells, read down the column, hold the whole site.
    table = out[out.index("Variables by creation site") :].splitlines()
    rows = [line.split("│") for line in table if line.count("│") == 5]
    scope = "".join(row[3].strip() for row in rows)
    assert f"outside,thenmovedin:tfscale.fix_scopeat{site}" in scope.replace(" ", ""), out


@pytest.mark.full(
    "tests/doctor/test_docs.py::"
    "test_documented_doctor_command_runs_as_documented"
    "[doctor --script examples/train_outside_scope.py]",
)
def test_model_fit_over_a_pydataset_under_mirrored_is_reported_unless_prepared(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """TensorFlow can write into a generator's arrays under several replicas
    (``training/data.copied_batches``): the doctor names the fit call, and a prepared model,
    whose fit copies the batches, is fine."""
    script = DATA / "fit_generator.py"
    status = run_script([str(script.relative_to(ROOT))], timeout=150)
    out = capsys.readouterr().out
    assert status == 1, out
    line = _line_of(script, "model.fit(Batches(x, y)")
    assert (
        f"model.fit at tests/doctor/data/fit_generator.py:{line} reads a PyDataset (training "
        "data) under MirroredStrategy (2 replicas): TensorFlow can write into the arrays"
    ) in " ".join(out.split())
    assert "model = tfscale.prepare(model)" in out
    # The model was built in the scope: the variables are fine, the data is the problem.
    assert "OK: every variable was created inside the strategy's scope" in out
    status = run_script(
        [str(script.relative_to(ROOT)), "--prepared"], json_output=True, timeout=150
    )
    report = json.loads(capsys.readouterr().out)
    assert status == 0 and report["ok"] and report["data_problems"] == [], report
