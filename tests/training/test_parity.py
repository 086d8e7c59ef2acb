"""The parity suite: every case of ``tests/training/parity`` trained by ``tfscale.fit`` over 2
logical CPUs (MirroredStrategy) against one-device ``model.fit`` (see ``parity/registry.py``
for what is compared and with which tolerance)."""

from __future__ import annotations

import pytest

from .helpers import strategy_for
from .parity import CASES
from .parity.registry import Case, run_case


def _param(case: Case) -> object:
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_tfscale_fit_matches_one_device_model_fit(case: Case) -> None:
    run_case(case, strategy_for(2))
