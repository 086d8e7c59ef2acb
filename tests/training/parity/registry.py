"""The parity case type and the runner that trains each case twice.

A case is run as:

    reference: built under tf.device("/device:CPU:0"), model.fit(verbose=0, **fit())
    tfscale:   built again (same seed; the reference's initial weights copied in),
               tfscale.fit(model, verbose=0, strategy=<Mirrored over 2 logical CPUs>, **fit())

and then checked by its ``checks``. The default checks are the exact-parity ones:

- weights: ``relative_difference(got, expected) <= weights_rtol`` (1e-4 unless the case says
  otherwise): the largest absolute difference of each weight array divided by the largest
  magnitude of the reference array (a max-norm relative check, per array);
- History: the same keys, and each key's values within ``history_rtol`` (1e-4), measured the
  same way over the key's per-epoch values;
- ``optimizer.iterations`` equal.

A case whose difference from one device is inherent or a Keras quirk says why in
``known_difference`` and its checks assert that documented difference instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import tfscale
from tfscale.testing import relative_difference

WEIGHTS_RTOL = 1e-4
HISTORY_RTOL = 1e-4


@dataclasses.dataclass
class Run:
    """One side of a case: the trained model, its History and the fit arguments it got."""

    model: Any
    history: Any
    fit: dict[str, Any]
    initial_weights: list[np.ndarray]

    @property
    def iterations(self) -> int:
        """The optimizer's update count after the run."""
        return int(self.model.optimizer.iterations.numpy())


Check = Callable[[Run, Run], None]
Train = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Case:
    """One parity case.

    Attributes:
        name: A short id (the pytest id).
        source: The Keras test or keras-io example it is drawn from.
        build: Returns a fresh compiled model, seeded (the same initial weights every call).
        fit: Returns ``model.fit``'s keyword arguments; called once per side, so callbacks
            and generators are fresh. ``shuffle=False`` and ``verbose=0`` are added unless set.
        options: tfscale-only keyword arguments for ``tfscale.fit``.
        checks: What must hold between the reference run and tfscale's (reference first).
            None means the exact-parity checks (weights, History, iterations).
        weights_rtol: Tolerance of the default weight check.
        history_rtol: Tolerance of the default History check.
        known_difference: Why tfscale's result legitimately differs from one device's
            (an inherent difference or a Keras quirk); None for an exact-parity case.
        xfail: A bug of tfscale's this case shows (the case is expected to fail, strictly).
        reference_fit: Overrides ``fit`` for the reference side only (e.g. a case whose
            reference needs a different but equivalent call).
        reference_build: Overrides ``build`` for the reference side only.
        procedure: Trains a built model with ``train(model, **arguments)`` (``model.fit`` or
            ``tfscale.fit``) and returns the History to compare; None calls ``train`` once
            with ``fit()``. Cases with several fits (recompile, fine-tuning, resuming) use it.
    """

    name: str
    source: str
    build: Callable[[], Any]
    fit: Callable[[], dict[str, Any]]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    checks: Sequence[Check] | None = None
    weights_rtol: float = WEIGHTS_RTOL
    history_rtol: float = HISTORY_RTOL
    known_difference: str | None = None
    xfail: str | None = None
    reference_fit: Callable[[], dict[str, Any]] | None = None
    reference_build: Callable[[], Any] | None = None
    procedure: Callable[[Any, Train, dict[str, Any]], Any] | None = None


# -- checks ---------------------------------------------------------------------------------------
def flat_weights(model: Any) -> list[np.ndarray]:
    """The model's weights (non-trainable included), as float64 arrays."""
    return [np.asarray(w, dtype=np.float64) for w in model.get_weights()]


def same_weights(rtol: float = WEIGHTS_RTOL) -> Check:
    """Final weights within ``rtol`` (max-norm relative, per array)."""

    def check(expected: Run, got: Run) -> None:
        difference = relative_difference(flat_weights(got.model), flat_weights(expected.model))
        assert difference <= rtol, f"weights differ by {difference:.3g} (allowed {rtol:g})"
        if got.initial_weights:  # a subclassed model may be built by the fit itself
            moved = relative_difference(got.model.get_weights(), got.initial_weights)
            assert moved > 0.0, "the weights did not change: nothing was trained"

    return check


def same_history(rtol: float = HISTORY_RTOL, skip: Sequence[str] = ()) -> Check:
    """The same History keys and epochs, each key's values within ``rtol``."""

    def check(expected: Run, got: Run) -> None:
        assert sorted(got.history.history) == sorted(expected.history.history)
        assert got.history.epoch == expected.history.epoch
        for key, values in expected.history.history.items():
            if key in skip:
                continue
            difference = relative_difference(
                np.asarray(got.history.history[key], dtype=np.float64),
                np.asarray(values, dtype=np.float64),
            )
            assert difference <= rtol, f"History[{key!r}] differs by {difference:.3g}"

    return check


def same_iterations(expected: Run, got: Run) -> None:
    """The same number of optimizer updates."""
    assert got.iterations == expected.iterations, (got.iterations, expected.iterations)


def exact_checks(case: Case) -> list[Check]:
    """The exact-parity checks with the case's tolerances."""
    return [same_weights(case.weights_rtol), same_history(case.history_rtol), same_iterations]


# -- running ------------------------------------------------------------------------------------
def _arguments(make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    arguments = dict(make())
    arguments.setdefault("shuffle", False)
    arguments.setdefault("verbose", 0)
    return arguments


def _train(case: Case, model: Any, train: Train, arguments: dict[str, Any]) -> Any:
    if case.procedure is None:
        return train(model, **arguments)
    return case.procedure(model, train, arguments)


def _reference_model(case: Case) -> Any:
    """The reference side's model, built (on logical CPU 0), not trained."""
    with tf.device("/device:CPU:0"):
        return (case.reference_build or case.build)()


def run_reference(case: Case) -> Run:
    """``model.fit`` of the case on one device (logical CPU 0)."""
    model = _reference_model(case)
    initial = [w.copy() for w in model.get_weights()]
    with tf.device("/device:CPU:0"):
        arguments = _arguments(case.reference_fit or case.fit)
        history = _train(case, model, lambda m, **kw: m.fit(**kw), arguments)
    return Run(model, history, arguments, initial)


def reference_initial_weights(case: Case) -> list[np.ndarray]:
    """The initial weights :func:`run_reference` starts from: its model built, not trained."""
    return [w.copy() for w in _reference_model(case).get_weights()]


def run_tfscale(
    case: Case,
    strategy: tf.distribute.Strategy,
    initial: list[np.ndarray] | None,
    prepared: bool = False,
) -> Run:
    """``tfscale.fit`` of the case under ``strategy``, from ``initial`` weights if given.

    With ``prepared``, the other one line instead: ``tfscale.prepare(model, strategy)`` (with
    the case's options), then the model's own ``model.fit``.
    """
    model = case.build()
    if initial:
        model.set_weights(initial)
    start = [w.copy() for w in model.get_weights()]
    arguments = _arguments(case.fit)

    def train(model: Any, **kwargs: Any) -> Any:
        if prepared:
            return tfscale.prepare(model, strategy, **case.options).fit(**kwargs)
        return tfscale.fit(model, strategy=strategy, **kwargs, **case.options)

    history = _train(case, model, train, arguments)
    return Run(model, history, arguments, start)


def param(case: Case, full: tuple[str, ...] = ()) -> Any:
    """The case as a pytest parameter named after it (a strict xfail where it shows a bug);
    with ``full``, a ``make test-full`` case naming those ``make test`` equivalents."""
    import pytest

    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    if full:
        marks.append(pytest.mark.full(*full))
    return pytest.param(case, id=case.name, marks=marks)


def tiered(case: Case, full: dict[str, str], test: str) -> Any:
    """``case`` as ``test``'s parameter: in ``make test-full`` where ``full`` names its
    ``make test`` equivalent (a case of ``test``, or a node id), else in ``make test``."""
    from ..helpers import equivalent_id

    if case.name not in full:
        return param(case)
    return param(case, full=(equivalent_id(full[case.name], test, full),))


def run_case(
    case: Case,
    strategy: tf.distribute.Strategy,
    prepared: bool = False,
    expected: Run | None = None,
) -> tuple[Run, Run]:
    """Trains the case on one device and under ``strategy`` and applies its checks.

    Args:
        case: The case.
        strategy: tfscale's side's strategy.
        prepared: tfscale's side is ``tfscale.prepare`` + ``model.fit`` (else ``tfscale.fit``).
        expected: The case's reference run, if already trained (:func:`run_reference`).

    Returns:
        The reference run and tfscale's.
    """
    expected = expected or run_reference(case)
    got = run_tfscale(case, strategy, expected.initial_weights, prepared)
    for check in case.checks if case.checks is not None else exact_checks(case):
        check(expected, got)
    return expected, got
