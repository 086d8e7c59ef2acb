"""The parity suite, cases from Keras's own trainer, model and callback tests: each trained by
``tfscale.fit`` over 2 logical CPUs (MirroredStrategy) against one-device ``model.fit`` (see
``parity/registry.py`` for what is compared and with which tolerance). The keras-io cases and
the worker-process run are in ``test_parity_examples.py`` (two files, so that ``make test``'s
two pytest processes share the suite)."""

from __future__ import annotations

import pytest

from .helpers import strategy_for
from .parity import CALLBACK_CASES, TRAINER_CASES
from .parity.registry import Case, param, run_case

pytestmark = [pytest.mark.tf, pytest.mark.slow]


@pytest.mark.parametrize("case", [param(case) for case in [*TRAINER_CASES, *CALLBACK_CASES]])
def test_tfscale_fit_matches_one_device_model_fit(case: Case) -> None:
    run_case(case, strategy_for(2))
