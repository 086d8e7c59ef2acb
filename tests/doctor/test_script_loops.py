"""`tfscale doctor --script` on custom training loops: a model or optimizer built lazily
inside ``strategy.run`` (the first step's crash) and an update N times one device's are
named with the file and line and the fix; the loop with ``tfscale.prepare_loop`` passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tfscale.doctor.script import run_script

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(autouse=True)
def _in_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # sites are shown relative to the working directory


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.full(
    "tests/doctor/test_script_loops.py::test_a_loop_whose_update_is_n_times_one_device_is_named",
)
def test_an_optimizer_built_inside_strategy_run_is_named_with_its_line_and_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = DATA / "loop_lazy_adam.py"
    status = run_script([str(script.relative_to(ROOT))], timeout=150)
    out = _flat(capsys.readouterr().out)
    assert status != 0, out
    line = _line_of(script, "optimizer.apply_gradients(")
    assert (
        "variables (adam/sequential_dense_kernel_momentum, adam/sequential_dense_kernel_velocity"
        in out
    )
    assert "created inside strategy.run, by the replica step traced in a tf.function, at " in out
    assert f"tests/doctor/data/loop_lazy_adam.py:{line} in step" in out
    assert "Fix: add one line after the model and its optimizer are created:" in out
    assert "tfscale.prepare_loop(model, optimizer)" in out
    assert "optimizer.build(model.trainable_variables)" in out
    assert "OK: every variable" not in out


def test_a_loop_whose_update_is_n_times_one_device_is_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = DATA / "loop_reduce_mean.py"
    status = run_script([str(script.relative_to(ROOT))], timeout=150)
    out = _flat(capsys.readouterr().out)
    assert status == 1, out
    line = _line_of(script, "grads = tape.gradient(")
    assert (
        f"The custom loop's tape.gradient at tests/doctor/data/loop_reduce_mean.py:{line} in "
        "step differentiates tf.reduce_mean, a mean over each replica's examples, and Keras's "
        "optimizer sums the 2 replicas' gradients: each update is 2 times one device's"
    ) in out
    assert "tfscale.prepare_loop(model, optimizer)" in out


@pytest.mark.full(
    "tests/doctor/test_script_loops.py::test_a_loop_whose_update_is_n_times_one_device_is_named",
)
def test_the_loop_with_prepare_loop_passes(capsys: pytest.CaptureFixture[str]) -> None:
    status = run_script(["tests/doctor/data/loop_lazy_adam.py", "--prepared"], timeout=150)
    out = _flat(capsys.readouterr().out)
    assert status == 0, out
    assert "OK: every variable was created inside the strategy's scope" in out
