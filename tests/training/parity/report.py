"""Prints the parity figures docs/training.md quotes: cases, exact passes, known differences.

Run from the repository root (it trains every case, a few minutes on 2 CPU cores)::

    PYTHONPATH=src python -m tests.training.parity.report

``--list`` prints the registry without training.
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
from .registry import Case, run_case  # noqa: E402


def _outcome(case: Case, train: bool) -> str:
    if not train:
        return "listed"
    try:
        run_case(case, mirrored_on_cpus(2))
    except Exception as error:  # a failing case is reported, not raised
        traceback.print_exc(limit=1, file=sys.stderr)
        return f"FAILED ({type(error).__name__}: {str(error)[:120]})"
    return "ok"


def main(argv: list[str] | None = None) -> int:
    """Trains (or lists) every case and prints the figures.

    Returns:
        0 when every case behaves as the registry says (exact, documented difference or
        strictly expected failure), else 1.
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--list", action="store_true", help="list the cases, train nothing")
    args = parser.parse_args(argv)
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
