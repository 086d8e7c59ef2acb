"""The supported range is the tested range: pyproject.toml bounds TensorFlow and Keras on both
sides, the Makefile's lowest virtualenv (``make test-lowest``) installs exactly the lower bounds,
the versions this suite runs under lie inside them, and the README states them. The next
virtualenv (``make test-next``) installs a Keras pre-release past the upper bound, with the
next TensorFlow: its pre-release past the bound where one is published, else the newest inside
it."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _bounds(requirement: str) -> tuple[str, str]:
    low = re.search(r">=\s*([\d.]+)", requirement)
    high = re.search(r"<\s*([\d.]+)", requirement)
    assert low and high, f"{requirement!r} must bound the version below (>=) and above (<)"
    return low.group(1), high.group(1)


def _requirement(requirements: list[str], name: str) -> str:
    found = [r for r in requirements if re.match(rf"{re.escape(name)}(?=[\s<>=!~;]|$)", r)]
    assert len(found) == 1, f"one requirement on {name} expected in {requirements}"
    return found[0]


def _tuple(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in re.findall(r"\d+", version)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def _declared() -> dict[str, tuple[str, str]]:
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    return {
        "keras": _bounds(_requirement(project["dependencies"], "keras")),
        "tensorflow-cpu": _bounds(_requirement(extras["cpu"], "tensorflow-cpu")),
        "tensorflow": _bounds(_requirement(extras["gpu"], "tensorflow[and-cuda]")),
    }


def _makefile_pins(variable: str) -> dict[str, str]:
    line = re.search(rf"^{variable} := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert line, f"the Makefile's {variable} pins are gone (make test-{variable.lower()})"
    return dict(pin.split("==") for pin in line.group(1).split())


def test_tensorflow_and_keras_are_bounded_on_both_sides_alike_in_both_extras() -> None:
    declared = _declared()
    assert declared["tensorflow-cpu"] == declared["tensorflow"], declared
    for name, (low, high) in declared.items():
        assert _tuple(low) < _tuple(high), f"{name}: {low} .. {high}"


def test_the_lowest_virtualenv_installs_exactly_the_lower_bounds() -> None:
    declared, pins = _declared(), _makefile_pins("LOWEST")
    assert set(pins) == {"tensorflow-cpu", "keras"}, pins
    for name, pinned in pins.items():
        low, high = declared[name]
        assert _tuple(pinned) == _tuple(low), f"Makefile pins {name}=={pinned}, pyproject >={low}"
        assert _tuple(pinned) < _tuple(high)


def test_the_next_virtualenv_pins_a_keras_pre_release_past_the_cap() -> None:
    declared, pins = _declared(), _makefile_pins("NEXT")
    assert set(pins) == {"tensorflow-cpu", "keras-nightly"}, pins
    nightly = Version(pins["keras-nightly"])
    cap = _tuple(declared["keras"][1])
    # A pre-release of a version pyproject already allows tests nothing `make test` does not:
    # "the next" is a version the cap keeps out (3.16.0.devN under <3.16). When the cap moves,
    # so does this pin.
    assert nightly.is_prerelease, f"keras-nightly=={nightly} is not a pre-release"
    assert _tuple(nightly.base_version) >= cap, (
        f"keras-nightly=={nightly} is not past pyproject's keras<{declared['keras'][1]}: "
        "pin the newest pre-release (pip index versions keras-nightly)"
    )
    # The other half of the pair is the next TensorFlow: a pre-release of the minor the cap
    # keeps out (2.22.0rc0 under <2.22; its own requirement is keras-nightly) where one is
    # published, else the newest minor pyproject allows, as `make test` runs.
    low, high = declared["tensorflow-cpu"]
    tensorflow = Version(pins["tensorflow-cpu"])
    pinned = _tuple(pins["tensorflow-cpu"])
    major, minor, _ = _tuple(high)
    if tensorflow.is_prerelease:
        assert pinned[:2] == (major, minor), (
            f"Makefile NEXT pins tensorflow-cpu=={tensorflow}, a pre-release of another minor "
            f"than the one pyproject's <{high} keeps out"
        )
    else:
        assert _tuple(low) <= pinned < _tuple(high)
        assert pinned[:2] == (major, minor - 1), (
            f"Makefile NEXT pins tensorflow-cpu=={tensorflow}, the newest allowed is "
            f"{major}.{minor - 1} (pyproject <{high})"
        )


def test_the_installed_versions_lie_inside_the_declared_range() -> None:
    declared = _declared()
    for name in ("keras", "tensorflow-cpu", "tensorflow"):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        low, high = declared[name]
        assert _tuple(low) <= _tuple(installed) < _tuple(high), (
            f"{name} {installed} is outside the declared >={low},<{high}: test it and move "
            "the bound, or install a version inside it"
        )


def test_the_readme_states_the_range() -> None:
    declared = _declared()
    (tf_low, tf_high), (keras_low, keras_high) = declared["tensorflow-cpu"], declared["keras"]

    def newest(high: str) -> str:  # "<2.22" -> "2.21"
        major, minor, _ = _tuple(high)
        return f"{major}.{minor - 1}"

    stated = (
        f"TensorFlow {tf_low} to {newest(tf_high)} and Keras {keras_low} to {newest(keras_high)}"
    )
    assert stated in (ROOT / "README.md").read_text(), f"README must say: {stated!r}"
