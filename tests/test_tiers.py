"""The test tiers themselves: the marker gates of ``tests/conftest.py`` and the process grouping
``make test`` relies on, each run as pytest runs them, on a small suite written here."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tfscale.processes import run

pytestmark = pytest.mark.multiprocess

_TESTS = Path(__file__).resolve().parent
# The suite under test loads the real conftest's hooks and fixtures.
_CONFTEST = f"""
import importlib.util
_spec = importlib.util.spec_from_file_location("tfscale_conftest", {str(_TESTS / "conftest.py")!r})
_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_real)
globals().update({{k: v for k, v in vars(_real).items() if not k.startswith("__")}})
"""


def _pytest(folder: Path, *args: str) -> tuple[int, str]:
    done = run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", *args],
        timeout=120,
        cwd=str(folder),
    )
    assert not done.timed_out
    return done.returncode, done.stdout + done.stderr


def _suite(folder: Path, files: dict[str, str]) -> Path:
    (folder / "conftest.py").write_text(_CONFTEST)
    (folder / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    tf: t\n    multiprocess: m\n    slow: s\n    full: f\n"
        "    late: l\n"
    )
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(textwrap.dedent(text))
    return folder


def test_unmarked_tensorflow_imports_and_child_processes_fail_naming_the_marker(
    tmp_path: Path,
) -> None:
    suite = _suite(
        tmp_path,
        {
            "test_needs.py": """
                import subprocess

                def test_imports_tensorflow():
                    import tensorflow  # noqa: F401

                def test_starts_a_process():
                    subprocess.run(["true"], check=True)

                def test_goes_on_without_tensorflow():
                    try:  # as a probe that records its failure does
                        import tensorflow  # noqa: F401
                    except ImportError:
                        pass

                def test_goes_on_without_its_child():
                    try:
                        subprocess.run(["true"], check=True)
                    except Exception:
                        pass
            """,
            "test_marked_tf.py": """
                import pytest
                import tensorflow  # noqa: F401 (a module the fast tier never imports)

                pytestmark = [pytest.mark.tf]

                def test_uses_tensorflow():
                    pass
            """,
        },
    )
    status, out = _pytest(suite, "-m", "not tf and not multiprocess")
    assert status == 1, out
    assert "test_imports_tensorflow imports tensorflow: mark it @pytest.mark.tf" in out
    assert "test_starts_a_process starts a child process: mark it" in out
    assert "@pytest.mark.multiprocess" in out
    # A refusal that the test's code caught fails the test in its teardown.
    assert "ERROR test_needs.py::test_goes_on_without_tensorflow" in out
    assert (
        "the test went on after its import of tensorflow was refused: mark it @pytest.mark.tf"
        in out
    )
    assert "ERROR test_needs.py::test_goes_on_without_its_child" in out
    assert (
        "the test went on after its child process was refused: mark it "
        "@pytest.mark.multiprocess" in out
    )
    # The module marked tf as a whole was not imported (nor counted): 2 failed, the caught
    # refusals an error each in teardown, none else.
    assert out.rstrip().splitlines()[-1].startswith("2 failed, 2 passed, 2 errors in "), out


def test_a_group_of_tests_runs_in_one_process_under_loadgroup(tmp_path: Path) -> None:
    suite = _suite(
        tmp_path,
        {
            "test_grouped.py": """
                import time
                import pytest

                pytestmark = [pytest.mark.xdist_group("together")]

                @pytest.mark.parametrize("i", range(6))
                def test_grouped(i):
                    time.sleep(0.2)  # ungrouped, these would be handed to both processes
            """,
            "test_free.py": """
                import time
                import pytest

                @pytest.mark.parametrize("i", range(20))
                def test_free(i):
                    time.sleep(0.1)
            """,
        },
    )
    status, out = _pytest(suite, "-n", "2", "--dist", "loadgroup", "-vv")
    assert status == 0, out
    ran = [
        line.split()[0]  # "[gw0] [ 10%] PASSED test_grouped.py::test_grouped[0]"
        for line in out.splitlines()
        if line.startswith("[gw") and "PASSED test_grouped.py" in line
    ]
    assert len(ran) == 6, out
    workers = set(ran)
    assert len(workers) == 1, f"the group ran on {sorted(workers)} (pytest-dev/pytest-xdist#1386)"


def test_late_tests_run_before_the_training_suites_last_modules(tmp_path: Path) -> None:
    training = "tests/training/"
    suite = _suite(
        tmp_path,
        {
            f"{training}test_b.py": "def test_b():\n    pass\n",
            f"{training}test_sharded_state.py": "def test_s():\n    pass\n",
            f"{training}test_sparse_updates.py": "def test_sp():\n    pass\n",
            f"{training}test_threads.py": """
                import pytest

                def test_other():
                    pass

                @pytest.mark.late
                def test_repeated():
                    pass

                @pytest.mark.late
                def test_repeated_too():
                    pass

                @pytest.mark.late
                def test_repeated_third():
                    pass
            """,
            f"{training}test_xla.py": "def test_x():\n    pass\n",
        },
    )

    def order(*paths: str) -> list[str]:
        status, out = _pytest(suite, "--collect-only", *paths)
        assert status == 0, out
        return [line.split("::")[1] for line in out.splitlines() if "::" in line]

    # One before each LATE_BEFORE module in turn, the last taking the rest.
    assert order() == [
        "test_b",
        "test_repeated",
        "test_s",
        "test_repeated_too",
        "test_repeated_third",
        "test_sp",
        "test_other",
        "test_x",
    ]
    # With one of the modules collected, all go before it.
    assert order(f"{training}test_sparse_updates.py", f"{training}test_threads.py") == [
        "test_repeated",
        "test_repeated_too",
        "test_repeated_third",
        "test_sp",
        "test_other",
    ]
    # Without a LATE_BEFORE module (a run of a few files) the order is pytest's own.
    assert order(f"{training}test_threads.py") == [
        "test_other",
        "test_repeated",
        "test_repeated_too",
        "test_repeated_third",
    ]


def test_full_tests_leave_make_test_and_each_names_an_equivalent_it_runs(tmp_path: Path) -> None:
    tests = """
        import pytest

        def test_kept():
            pass

        @pytest.mark.full("test_full.py::test_kept")
        def test_moved():
            pass

        @pytest.mark.parametrize(
            "kind", ["a", pytest.param("b", marks=pytest.mark.full("test_full.py::test_p[a]"))]
        )
        def test_p(kind):
            pass
    """
    suite = _suite(tmp_path, {"test_full.py": tests})
    status, out = _pytest(suite, "-m", "not full")  # make test
    assert status == 0 and "PASSED test_full.py::test_p[a]" in out, out
    assert "test_moved" not in out and "test_p[b]" not in out, out
    assert out.rstrip().splitlines()[-1].startswith("2 passed, 2 deselected in "), out
    status, out = _pytest(suite, "-m", "full")  # make test-full
    assert status == 0 and out.rstrip().splitlines()[-1].startswith("2 passed, 2 deselected"), out
    assert "PASSED test_full.py::test_moved" in out and "PASSED test_full.py::test_p[b]" in out
    # One `full` test run alone, by its node id: its equivalent, not selected, is no problem.
    status, out = _pytest(suite, "test_full.py::test_p[b]")
    assert status == 0 and "PASSED test_full.py::test_p[b]" in out, out


@pytest.mark.parametrize(
    ("mark", "says"),
    [
        (
            'full("test_broken.py::test_gone")',
            "equivalent test_broken.py::test_gone does not exist",
        ),
        (
            'full("test_broken.py::test_other")',
            "equivalent test_broken.py::test_other is `full` too",
        ),
        ('full("test_elsewhere.py::test_x")', "no file test_elsewhere.py"),
        ("full", "pytest.mark.full needs the node ids of its `make test` equivalents"),
    ],
)
def test_a_full_test_without_a_make_test_equivalent_stops_the_session(
    tmp_path: Path, mark: str, says: str
) -> None:
    tests = f"""
        import pytest

        @pytest.mark.{mark}
        def test_moved():
            pass

        @pytest.mark.full("test_broken.py::test_moved")
        def test_other():
            pass
    """
    suite = _suite(tmp_path, {"test_broken.py": tests})
    status, out = _pytest(suite, "-m", "not full")
    assert status != 0 and "test_broken.py::test_moved: " in out and says in out, out


@pytest.mark.tf
def test_a_tables_equivalent_that_moved_too_names_its_own_equivalent_in_turn() -> None:
    """A ``tiered`` table may name a case that is ``full`` itself (a path whose feature's
    test is another case): the marker names the case that ``make test`` runs, and a table
    whose names go round is refused."""
    from training.helpers import equivalent_id

    test = "tests/training/test_x.py::test_x"
    full = {"a": "b", "b": "c", "d": "tests/other.py::test_o"}
    assert equivalent_id("b", test, full) == f"{test}[c]"
    assert equivalent_id("a", test, full) == f"{test}[c]"
    assert equivalent_id("d", test, full) == "tests/other.py::test_o"
    assert equivalent_id("b", test) == f"{test}[b]"
    with pytest.raises(ValueError, match="go round"):
        equivalent_id("a", test, {"a": "b", "b": "a"})
