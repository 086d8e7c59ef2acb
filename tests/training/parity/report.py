"""Prints the parity figures docs/training.md quotes: cases, exact passes, known differences.

Run from the repository root (it trains every case, a few minutes on 2 CPU cores)::

    PYTHONPATH=src python -m tests.training.parity.report

``--list`` prints the registry without training; ``--kerashub`` trains the KerasHub cases
(``kerashub_cases.py``; KerasHub installed) by both one lines and prints each one's largest
weight difference from one device's ``model.fit``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfscale

tfscale.use_virtual_devices(4)  # as tests/conftest.py: before TensorFlow starts

from tfscale.testing import mirrored_on_cpus  # noqa: E402

from . import CASES  # noqa: E402
from .registry import Case, run_case, run_reference  # noqa: E402


def _outcome(case: Case, train: bool) -> str:
    if not train:
        return "listed"
    try:
        run_case(case, mirrored_on_cpus(2))
    except Exception as error:  # a failing case is reported, not raised
        traceback.print_exc(limit=1, file=sys.stderr)
        return f"FAILED ({type(error).__name__}: {str(error)[:120]})"
    return "ok"


def kerashub() -> int:
    """Trains each KerasHub case by ``tfscale.fit`` and by ``tfscale.prepare`` +
    ``model.fit`` over 2 replicas and prints the largest per-variable relative difference
    from one device's weights (attention key biases left out, as the checks do).

    Returns:
        0 when every run passes its case's checks, else 1.
    """
    from .kerashub_cases import CASES as KERASHUB_CASES
    from .sparse_cases import variable_differences

    failed = 0
    print("KerasHub models over 2 replicas against one-device model.fit (weights, per variable)")
    for case in KERASHUB_CASES:
        expected = run_reference(case)
        cells = []
        for prepared in (False, True):
            try:
                _, got = run_case(case, mirrored_on_cpus(2), prepared, expected)
                worst = max(variable_differences(got.model, expected.model).values())
                cells.append(f"{worst:.1e}")
            except Exception as error:  # a failing run is reported, not raised
                failed += 1
                cells.append(f"FAILED ({type(error).__name__}: {str(error)[:100]})")
        bound = f"(<= {case.weights_rtol:g})"
        print(f"  {case.name:32s} fit {cells[0]:>8s}  prepare {cells[1]:>8s}  {bound}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Trains (or lists) every case and prints the figures.

    Returns:
        0 when every case behaves as the registry says (exact, documented difference or
        strictly expected failure), else 1.
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--list", action="store_true", help="list the cases, train nothing")
    parser.add_argument("--kerashub", action="store_true", help="the KerasHub cases only")
    args = parser.parse_args(argv)
    if args.kerashub:
        return kerashub()
    start = time.monotonic()
    exact, known, bugs, wrong = [], [], [], []
    for case in CASES:
        outcome = _outcome(case, not args.list)
        passed = outcome in ("ok", "listed")
        if case.xfail:
            (bugs if not passed or args.list else wrong).append((case, "XPASS" if passed else ""))
        elif case.known_difference:
            (known if passed else wrong).append((case, outcome))
        else:
            (exact if passed else wrong).append((case, outcome))
    state = " (as registered, not run)" if args.list else ""
    print(f"tfscale.fit over 2 replicas against one-device model.fit: {len(CASES)} cases{state}")
    print(f"  exact parity (weights 1e-4, History 1e-4, iterations): {len(exact)}")
    print(f"  known differences, each asserted: {len(known)}")
    for case, _ in known:
        print(f"    - {case.name}: {case.known_difference}")
    print(f"  open bugs (xfail, strict): {len(bugs)}")
    for case, _ in bugs:
        print(f"    - {case.name}: {case.xfail}")
    if wrong:
        print(f"  NOT as registered: {len(wrong)}")
        for case, outcome in wrong:
            print(f"    - {case.name}: {outcome}")
    if not args.list:
        print(f"  ({time.monotonic() - start:.0f} s)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
