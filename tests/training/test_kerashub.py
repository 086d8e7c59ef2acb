"""KerasHub 0.32 task models (``parity/kerashub_cases.py``: BERT and ViT classifiers, GPT-2 and
Llama 3 causal LMs, a BART sequence-to-sequence LM, a BERT masked LM, a BERT classifier with
its preprocessor fed raw strings, GPT-2 fine-tuned with LoRA then asked to ``generate``, and
with QLoRA (int8 weights); SGD and Adam) trained over 2 logical CPUs by both one
lines, ``tfscale.fit(model, x, y, ...)`` and ``tfscale.prepare(model)`` + ``model.fit(x, y,
...)``, against one device's ``model.fit`` of a fresh identical model (SGD as is, Adam with
dense embedding gradients: docs/training.md, "Sparse gradients"). KerasHub's ``fit`` is its
own (``PipelineModel.fit`` builds the dataset and maps the preprocessor), so these tests hold
tfscale to what that ``fit`` gets on one device. KerasHub's RetinaNet object detector divides
its loss by a count over the batch each replica sees: its tests assert that difference and the
subclass docs/training.md gives for it ("Losses normalized over the batch").

KerasHub 0.32 needs Keras >= 3.15 and Python >= 3.11 and is installed without its
tensorflow-text's ``tensorflow`` dependency (the Makefile's ``venv``); where it is missing
(``make test-lowest``'s Keras 3.10) these tests are skipped, saying why.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import tfscale

pytestmark = [pytest.mark.tf, pytest.mark.xdist_group("kerashub")]

if tuple(int(part) for part in keras.__version__.split(".")[:2]) < (3, 15):
    pytest.skip(
        f"KerasHub 0.32 needs Keras >= 3.15, not {keras.__version__}", allow_module_level=True
    )
pytest.importorskip(
    "keras_hub",
    reason="KerasHub is not installed: `make venv` installs it (tests/README.md)",
)

from .helpers import launch, strategy_for  # noqa: E402
from .parity.kerashub_cases import (  # noqa: E402
    CASES,
    DETECTION_CASES,
    MOE_CASES,
    generated,
    next_tokens,
)
from .parity.registry import Case, Run, param, run_case, run_reference  # noqa: E402

_BY_NAME = {case.name: case for case in [*CASES, *MOE_CASES]}


@functools.cache
def _reference(name: str) -> Run:
    """One device's run of a case, trained once for both one lines."""
    return run_reference(_BY_NAME[name])


_FIT_TEST = "tests/training/test_kerashub.py::test_tfscale_fit_matches_one_device_model_fit"
_PREPARE_TEST = (
    "tests/training/test_kerashub.py::test_prepare_then_model_fit_matches_one_device_model_fit"
)
# One model of each kind in `make test` (#41): a classifier with a boolean padding mask (BERT)
# and a causal LM over token sequences (GPT-2) by tfscale.fit with Adam; of the models whose own
# methods differ from Keras's fit, the preprocessor's (strings in) by tfscale.fit and LoRA's
# (generate after the fit) by the other line, prepare + model.fit. Each other case takes its
# kind's fit, update and input paths: it runs in `make test-full`, naming its kind's case.
_KIND = {
    "bert_classifier": "bert_classifier",
    "vit_classifier": "bert_classifier",
    "bert_masked_lm": "bert_classifier",
    "gpt2_causal_lm": "gpt2_causal_lm",
    "llama3_causal_lm": "gpt2_causal_lm",
    "bart_seq2seq_lm": "gpt2_causal_lm",
    "gpt2_qlora": "gpt2_lora_generate",
    "bert_preprocessor_strings": "bert_preprocessor_strings",
    "gpt2_lora_generate": "gpt2_lora_generate",
}
# The kinds `make test` trains by prepare + model.fit rather than by tfscale.fit (both lines
# reach Keras's fit through the same prepared class).
_PREPARED_KINDS = ("gpt2_lora_generate",)


def _model(case: Case) -> str:
    return case.name.removesuffix("_sgd").removesuffix("_adam")


def _kind_case(case: Case) -> str:
    """The ``make test`` node id of the case's kind: its model of that kind with Adam, by
    ``tfscale.fit`` or (:data:`_PREPARED_KINDS`) by ``prepare``. SGD differs from Adam only in
    the optimizer's own step, which the parity suite's SGD cases cover on other models."""
    kind = _KIND[_model(case)]
    return f"{_PREPARE_TEST if kind in _PREPARED_KINDS else _FIT_TEST}[{kind}_adam]"


def _fit_param(case: Case) -> Any:
    """The case as ``tfscale.fit``'s: in ``make test`` where it is its kind's case, else in
    ``make test-full``, naming it."""
    if _kind_case(case) == f"{_FIT_TEST}[{case.name}]":
        return param(case)
    return pytest.param(case, id=case.name, marks=pytest.mark.full(_kind_case(case)))


@pytest.mark.parametrize("case", [_fit_param(case) for case in CASES])
def test_tfscale_fit_matches_one_device_model_fit(case: Case) -> None:
    run_case(case, strategy_for(2), expected=_reference(case.name))


def _prepared_param(case: Case) -> Any:
    """The case as prepare + model.fit's: in ``make test`` where it is its kind's case, else
    in ``make test-full``, naming it."""
    if _kind_case(case) == f"{_PREPARE_TEST}[{case.name}]":
        return param(case)
    return pytest.param(case, id=case.name, marks=pytest.mark.full(_kind_case(case)))


@pytest.mark.parametrize("case", [_prepared_param(case) for case in CASES])
def test_prepare_then_model_fit_matches_one_device_model_fit(case: Case) -> None:
    run_case(case, strategy_for(2), prepared=True, expected=_reference(case.name))


# -- across 2 worker processes -------------------------------------------------------------------
_JOB = Path(__file__).parent / "data" / "kerashub_job.py"
# Every model by the one line tfscale.fit, two by prepare + model.fit too; SGD and Adam.
LAUNCHED = (
    "bert_classifier_sgd:fit",
    "gpt2_causal_lm_adam:fit",
    "llama3_causal_lm_adam:fit",
    "vit_classifier_sgd:fit",
    "bert_preprocessor_strings_adam:fit",
    "gpt2_lora_generate_adam:fit",
    "gpt2_causal_lm_adam:prepare",
    "bert_preprocessor_strings_adam:prepare",
    "bart_seq2seq_lm_adam:fit",
    "bert_masked_lm_sgd:fit",
    "gpt2_qlora_adam:fit",
    "mixtral_global_sgd:fit",
)


def _launched(folder: Path, runs: tuple[str, ...]) -> list[dict[str, dict[str, object]]]:
    launch(_JOB, [str(folder), ",".join(runs)], timeout=420)
    return [json.loads((folder / f"worker{i}.json").read_text()) for i in range(2)]


@pytest.mark.multiprocess
@pytest.mark.slow
# make test keeps each model by the one line on 2 logical CPUs, and a dataset input across 2
# workers in the parity suite's 2-worker group (the path a KerasHub fit takes there).
@pytest.mark.full(
    f"{_FIT_TEST}[gpt2_causal_lm_adam]",
    "tests/training/test_parity_examples.py::"
    "test_cases_across_two_worker_processes_match_one_device[paths_across_workers]",
)
def test_models_under_tfscale_launch_give_one_device_weights(tmp_path: Path) -> None:
    """``tfscale launch -n 2`` (MultiWorkerMirroredStrategy, 2 processes on 127.0.0.1): both
    workers end with the same weights, which pass the case's checks against one device's
    ``model.fit``; the LoRA model's ``generate`` in each worker gives the reference's tokens."""
    reports = _launched(tmp_path, LAUNCHED)
    failed = {
        f"{run} (worker {i})": r[run]["error"]
        for i, r in enumerate(reports)
        for run in r
        if "error" in r[run]
    }
    assert not failed, failed
    for run in LAUNCHED:
        name, mode = run.split(":")
        case, expected = _BY_NAME[name], _reference(name)
        with (
            np.load(tmp_path / f"{name}-{mode}-0.npz") as first,
            np.load(tmp_path / f"{name}-{mode}-1.npz") as second,
        ):
            weights = [first[f"arr_{i}"] for i in range(len(first.files))]
            for i, array in enumerate(weights):
                np.testing.assert_array_equal(second[f"arr_{i}"], array, err_msg=run)
        assert reports[0][run] == reports[1][run], run
        # The worker's trained weights in a fresh build of the case's model, checked as the
        # in-process runs are (weights, History, updates, and generate where the case has it).
        model = case.build()
        model.set_weights(weights)
        model.optimizer.iterations.assign(reports[0][run]["iterations"])
        history = keras.callbacks.History()
        history.history, history.epoch = reports[0][run]["history"], reports[0][run]["epoch"]
        got = Run(model, history, {}, expected.initial_weights)
        for check in case.checks or ():
            check(expected, got)
        if "generated" in reports[0][run]:
            np.testing.assert_array_equal(reports[0][run]["generated"], generated(expected.model))


# -- mixture of experts --------------------------------------------------------------------------
_MOE_TEST = (
    "tests/training/test_kerashub.py::"
    "test_mixture_of_experts_balances_the_whole_batch_with_global_load_balancing"
)


def _moe_param(case: Case) -> Any:
    """``make test`` runs Mixtral balanced over the whole batch (by both one lines); Qwen3-MoE
    (the same KerasHub loss function, wrapped the same way) and the per-replica known
    difference run in ``make test-full``, naming it."""
    if case.name == "mixtral_global_sgd":
        return param(case)
    return pytest.param(
        case, id=case.name, marks=pytest.mark.full(f"{_MOE_TEST}[mixtral_global_sgd]")
    )


@pytest.mark.parametrize("case", [_moe_param(case) for case in MOE_CASES])
def test_mixture_of_experts_balances_the_whole_batch_with_global_load_balancing(case: Case) -> None:
    """KerasHub's Mixtral and Qwen3-MoE add a load-balancing loss over the tokens of the
    batch each replica is given: with ``global_load_balancing=True`` every replica gathers the
    replicas' router logits and the update, loss and History are one device's, on batches
    split unevenly (4 + 3) too; without it the weights differ (the known difference). The
    Mixtral case by ``tfscale.prepare`` + ``model.fit`` too, and across 2 launched workers
    (``LAUNCHED``)."""
    expected, _ = run_case(case, strategy_for(2))
    if case.name == "mixtral_global_sgd":
        run_case(case, strategy_for(2), prepared=True, expected=expected)


def test_global_load_balancing_is_refused_without_experts_and_under_xla() -> None:
    """Refused before the first update: for a model none of whose layers computes KerasHub's
    load-balancing loss (found as its train step is traced: the option would change
    nothing), and with XLA (found before any work)."""
    model = _BY_NAME["gpt2_causal_lm_sgd"].build()
    with pytest.raises(tfscale.TrainingError, match=r"in its train step, so it would change"):
        tfscale.fit(model, *next_tokens()[:2], strategy=strategy_for(2), global_load_balancing=True)
    assert int(model.optimizer.iterations.numpy()) == 0
    model = MOE_CASES[0].build()
    with pytest.raises(tfscale.TrainingError, match="no collective can run inside"):
        tfscale.fit(
            model, *next_tokens()[:2], strategy=strategy_for(2), global_load_balancing=True,
            jit_compile=True,
        )  # fmt: skip
    assert int(model.optimizer.iterations.numpy()) == 0


# -- a loss normalized over the batch ------------------------------------------------------------
_RETINANET_TEST = (
    "tests/training/test_kerashub.py::"
    "test_retinanets_loss_is_one_devices_once_normalized_by_the_batchs_count"
)


def _detection_param(case: Case) -> Any:
    """``make test`` runs the normalization over the whole batch; the known difference of
    RetinaNet's own runs in ``make test-full``, naming it (the same model and fit)."""
    if case.name == "retinanet_batch_count_sgd":
        return param(case)
    return pytest.param(
        case, id=case.name, marks=pytest.mark.full(f"{_RETINANET_TEST}[retinanet_batch_count_sgd]")
    )


@pytest.mark.parametrize("case", [_detection_param(case) for case in DETECTION_CASES])
def test_retinanets_loss_is_one_devices_once_normalized_by_the_batchs_count(case: Case) -> None:
    """KerasHub's RetinaNet divides its summed loss by the positive anchors of the batch it is
    given: under 2 replicas each divides by its own share's, and the update is not one
    device's (asserted as the known difference); divided by the whole batch's count
    (``BatchCountRetinaNet``, docs/training.md "Losses normalized over the batch") it is."""
    run_case(case, strategy_for(2))
