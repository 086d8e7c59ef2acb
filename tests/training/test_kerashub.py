"""KerasHub 0.32 task models (``parity/kerashub_cases.py``: BERT and ViT classifiers, GPT-2 and
Llama 3 causal LMs, a BERT classifier with its preprocessor fed raw strings, GPT-2 fine-tuned
with LoRA then asked to ``generate``; SGD and Adam) trained over 2 logical CPUs by both one
lines, ``tfscale.fit(model, x, y, ...)`` and ``tfscale.prepare(model)`` + ``model.fit(x, y,
...)``, against one device's ``model.fit`` of a fresh identical model (SGD as is, Adam with
dense embedding gradients: docs/training.md, "Sparse gradients"). KerasHub's ``fit`` is its
own (``PipelineModel.fit`` builds the dataset and maps the preprocessor), so these tests hold
tfscale to what that ``fit`` gets on one device.

KerasHub 0.32 needs Keras >= 3.15 and Python >= 3.11 and is installed without its
tensorflow-text's ``tensorflow`` dependency (the Makefile's ``venv``); where it is missing
(``make test-lowest``'s Keras 3.10) these tests are skipped, saying why.
"""

from __future__ import annotations

import functools

import keras
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.xdist_group("kerashub")]

if tuple(int(part) for part in keras.__version__.split(".")[:2]) < (3, 15):
    pytest.skip(
        f"KerasHub 0.32 needs Keras >= 3.15, not {keras.__version__}", allow_module_level=True
    )
pytest.importorskip(
    "keras_hub",
    reason="KerasHub is not installed: `make venv` installs it (tests/README.md)",
)

from .helpers import strategy_for  # noqa: E402
from .parity.kerashub_cases import CASES  # noqa: E402
from .parity.registry import Case, Run, param, run_case, run_reference  # noqa: E402

_BY_NAME = {case.name: case for case in CASES}


@functools.cache
def _reference(name: str) -> Run:
    """One device's run of a case, trained once for both one lines."""
    return run_reference(_BY_NAME[name])


@pytest.mark.parametrize("case", [param(case) for case in CASES])
def test_tfscale_fit_matches_one_device_model_fit(case: Case) -> None:
    run_case(case, strategy_for(2), expected=_reference(case.name))


@pytest.mark.parametrize("case", [param(case) for case in CASES])
def test_prepare_then_model_fit_matches_one_device_model_fit(case: Case) -> None:
    run_case(case, strategy_for(2), prepared=True, expected=_reference(case.name))
