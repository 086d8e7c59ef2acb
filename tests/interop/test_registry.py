"""The interception registry (``tfscale.interop.registry``): every attribute tfscale replaces
in Keras, TensorFlow or a user's object is declared there and replaced only there; what is
installed process-wide is undone when nothing holds it; and after ``tfscale.fit`` returns,
code the user did not hand to tfscale runs bit for bit as in a process without tfscale."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

import tfscale
from tfscale.interop import registry
from tfscale.testing import run_python

_SRC = Path(tfscale.__file__).parent
_REGISTRY = "interop/registry.py"
# Roots whose attributes are foreign objects (or tfscale's public API, which a user holds).
_FOREIGN_ROOTS = ("keras", "tensorflow", "tf", "tfscale", "np", "numpy")


def _imported_roots(tree: ast.AST) -> set[str]:
    """Names a module binds by importing from keras / tensorflow / tfscale."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _FOREIGN_ROOTS:
                    names.add((alias.asname or alias.name).split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _FOREIGN_ROOTS
        ):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def replacements(path: Path) -> list[str]:
    """The attribute replacements of one module, by the counter's kinds: ``setattr``, writes
    into an object's ``__dict__``, ``override(...)`` / ``__setattr__`` calls (but a frozen
    dataclass setting its own field), assignments to attributes of imported Keras,
    TensorFlow or tfscale names."""
    tree = ast.parse(path.read_text(), str(path))
    roots = _imported_roots(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            own_field = (
                name == "__setattr__"
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "self"
            )
            if name in ("setattr", "delattr", "override", "__setattr__") and not own_field:
                found.append(f"{line} {name}(...)")
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("update", "setdefault", "__setitem__")
                and isinstance(func.value, ast.Attribute)
                and func.value.attr == "__dict__"
            ):
                found.append(f"{line} __dict__.{func.attr}(...)")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for each in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (
                    isinstance(each, ast.Subscript)
                    and isinstance(each.value, ast.Attribute)
                    and each.value.attr == "__dict__"
                ):
                    found.append(f"{line} .__dict__[...] =")
                if isinstance(each, ast.Attribute):
                    root = each.value
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id in roots:
                        found.append(f"{line} {root.id}....{each.attr} =")
    return found


def test_no_code_outside_the_registry_replaces_an_attribute_of_a_foreign_object() -> None:
    outside = {
        path.relative_to(_SRC).as_posix(): replacements(path)
        for path in sorted(_SRC.rglob("*.py"))
        if path.relative_to(_SRC).as_posix() != _REGISTRY
    }
    found = [f"{module}:{site}" for module, sites in outside.items() for site in sites]
    assert found == [], (
        "replace attributes of Keras, TensorFlow or user objects through "
        f"tfscale.interop.registry (declare the interception there): {found}"
    )


def test_the_registry_replaces_in_few_places_and_architecture_states_how_many() -> None:
    """The counter of the kinds above over all of ``src/`` finds the registry's primitives
    only; docs/ARCHITECTURE.md states the count and the number of interceptions."""
    sites = replacements(_SRC / _REGISTRY)
    assert 0 < len(sites) <= 16, sites
    text = (_SRC.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    stated = f"{len(registry.INTERCEPTIONS)} interceptions, replaced at {len(sites)} sites"
    assert stated in text, f"docs/ARCHITECTURE.md should say: {stated!r}"


def _registry_calls() -> list[tuple[str, int, str, str | None]]:
    calls = []
    for path in sorted(_SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "registry"
                and node.func.attr in ("replace", "restore", "install", "give_class")
            ):
                key = node.args[0]
                attribute = node.args[2] if len(node.args) > 2 else None
                calls.append(
                    (
                        path.name,
                        node.lineno,
                        key.value if isinstance(key, ast.Constant) else "?",
                        attribute.value if isinstance(attribute, ast.Constant) else None,
                    )
                )
    return calls


def test_every_replacement_names_a_declared_interception_and_attribute() -> None:
    declared = {i.key: i for i in registry.INTERCEPTIONS}
    calls = _registry_calls()
    assert len(calls) >= 10, "the scan found too few registry calls: is it broken?"
    wrong = [
        call
        for call in calls
        if call[2] not in declared
        or (call[3] is not None and call[3] not in declared[call[2]].attributes)
    ]
    assert wrong == []
    used = {call[2] for call in calls}
    assert sorted(set(declared) - used) == [], "declared but never used: drop them"
    for interception in registry.INTERCEPTIONS:
        assert interception.why and interception.target and interception.attributes


@pytest.mark.tf
def test_installed_layers_compose_and_the_last_release_puts_the_original_back() -> None:
    import tensorflow as tf

    original = tf.nn.compute_average_loss  # Keras's, or the dispatcher of a live prepared loop

    def holds() -> list[int]:
        return [n for owner, name, n in registry.installed()
                if owner is tf.nn and name == "compute_average_loss"]  # fmt: skip

    before = holds()
    seen: list[str] = []

    def layer(name: str) -> registry.Layer:
        def wrap(inner: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                seen.append(name)
                return inner(*args, **kwargs)

            return wrapped

        return wrap

    first, second = layer("first"), layer("second")
    release_first = registry.install("reduction-watch", tf.nn, "compute_average_loss", first)
    release_second = registry.install("reduction-watch", tf.nn, "compute_average_loss", second)
    again = registry.install("reduction-watch", tf.nn, "compute_average_loss", first)
    try:
        value = tf.nn.compute_average_loss(tf.constant([1.0, 3.0]), global_batch_size=2)
        assert float(value) == 2.0 and seen == ["second", "first"]  # the later layer outside
        release_first()  # still held by `again`
        seen.clear()
        tf.nn.compute_average_loss(tf.constant([1.0]), global_batch_size=1)
        assert seen == ["second", "first"]
    finally:
        release_second()
        again()
        release_first()  # a second release of the same hold does nothing
    assert tf.nn.compute_average_loss is original
    assert holds() == before


@pytest.mark.tf
def test_an_undeclared_replacement_is_refused() -> None:
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(AssertionError, match="undeclared interception"):
        registry.replace("optimizer-apply", model, "call", None)
    with pytest.raises(AssertionError, match="undeclared interception"):
        registry.replace("no-such-key", model, "call", None)
    with pytest.raises(AssertionError, match="is not made of"):  # not a subclass of its class
        registry.give_class("model-class", model, type("Other", (keras.Model,), {}))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_after_tfscale_fit_untouched_code_trains_bit_for_bit_as_without_tfscale() -> None:
    """A GradientTape loop under MirroredStrategy (its tf.reduce_mean loss and all), Keras's
    model.fit under MirroredStrategy and a one-device loop, run after ``tfscale.fit`` on
    another model, against the same code in a process that never imported tfscale; and
    nothing of tfscale is left installed once the fit has returned."""
    script = Path(__file__).parent / "data" / "untouched.py"
    runs = {}
    for mode in ("plain", "tfscale"):
        done = run_python(script.read_text(), args=[mode], timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    names = ("tape loop, mirrored", "keras fit, mirrored", "one-device loop")
    for name, plain, after in zip(names, runs["plain"], runs["tfscale"], strict=True):
        assert plain == after, f"{name}: weights differ after tfscale.fit"
