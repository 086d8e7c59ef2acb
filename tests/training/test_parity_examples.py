"""The parity suite, cases from keras-io examples and guides (as ``test_parity.py``), and a
subset of all cases across 2 worker processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from .helpers import run_workers, strategy_for
from .parity import KERAS_IO_CASES
from .parity.registry import Case, run_case, tiered

pytestmark = [pytest.mark.tf, pytest.mark.slow]

TESTS = Path(__file__).resolve().parents[1]


_TEST = "tests/training/test_parity_examples.py::test_tfscale_fit_matches_one_device_model_fit"
_PARITY = "tests/training/test_parity.py::test_tfscale_fit_matches_one_device_model_fit"
_KERAS_FEATURES = "tests/training/test_keras_features.py::"
# As test_parity.FULL: each case below takes the path of the `make test` case it names and
# runs in `make test-full` (and `make test-next`).
FULL = {
    "captcha_ocr_add_loss_per_example": "endpoint_layer_add_loss",
    "bidirectional_gru_text_classification": "lstm_text_classification",
    "masked_token_loss": "masked_language_model_summed_loss",
    "mnist_convnet": "conv_autoencoder",
    "auc_precision_recall_metrics": f"{_PARITY}[custom_compute_loss_with_x]",
    "custom_metric_true_positives": f"{_PARITY}[custom_compute_loss_with_x]",
    "batchnorm_per_replica_statistics": "batchnorm_synchronized",
    "tf_data_seeded_shuffle_fixed_order": "tf_data_seeded_shuffle",
    "validation_freq": "tf_data_with_validation_dataset",
    "validation_batch_size": "tf_data_with_validation_dataset",
    "mnist_mlp_validation_split": f"{_PARITY}[fit_flow_arrays]",
    "loss_scale_optimizer_no_overflow": "loss_scale_optimizer_mixed_float16",
    "transfer_learning_freeze_then_fine_tune": f"{_PARITY}[fit_flow_arrays]",
    "initial_epoch": f"{_PARITY}[callback_methods_keys]",
    "custom_train_step_sample_weight": "sample_weight",
    "steps_per_epoch_iterator_continues": f"{_PARITY}[python_generator]",
    "py_dataset": f"{_PARITY}[python_generator]",
    "gradient_accumulation_sgd": "gradient_accumulation_adam",
    # One case of each feature stays in `make test` (#41), as in test_parity.FULL: mixed
    # precision, a loss summed over the batch, sample and class weights, a random layer. The
    # paths above that named one of these cases name their feature's case in turn.
    "loss_scale_optimizer_mixed_float16": "mixed_bfloat16_policy",
    "multi_input_multi_output_loss_weights": "sample_weight",
    "transformer_block": "masked_language_model_summed_loss",
    "lstm_text_classification": "masked_language_model_summed_loss",
    "tf_data_seeded_shuffle": f"{_PARITY}[fit_flow_arrays]",
    "tf_data_with_validation_dataset": f"{_PARITY}[fit_flow_arrays]",
    "structured_data_preprocessing_layers": f"{_PARITY}[fit_flow_arrays]",
    "conv_autoencoder": f"{_PARITY}[fit_flow_arrays]",
    "vae_train_step_x_only": f"{_PARITY}[custom_compute_loss_with_x]",
    "custom_compute_loss": f"{_PARITY}[custom_compute_loss_with_x]",
    "gan_two_optimizers_no_call": f"{_PARITY}[multi_optimizer_in_loss_scale_optimizer]",
    "endpoint_layer_add_loss": (
        f"{_KERAS_FEATURES}test_step_and_loss_overrides_give_one_device_weights_and_history"
        "[add_loss-of-a-Loss]"
    ),
    "batchnorm_synchronized": (
        f"{_KERAS_FEATURES}test_sync_batchnorm_normalizes_with_the_global_batch_as_one_device"
    ),
    "gradient_accumulation_adam": "tests/training/test_equivalence.py::"
    "test_accumulating_k_micro_batches_equals_one_batch_of_k_times_b[2-adam]",
}


@pytest.mark.parametrize("case", [tiered(case, FULL, _TEST) for case in KERAS_IO_CASES])
def test_tfscale_fit_matches_one_device_model_fit(case: Case) -> None:
    run_case(case, strategy_for(2))


# -- the same cases across 2 worker processes ----------------------------------------------------
# The cases whose code path differs across workers run in `make test`: arrays sharded by
# worker (EpochOrder's share of each worker), validation, a dataset of unknown length read
# with get_next_as_optional, and sparse gradients gathered across workers (the reference: one
# device, dense gradients).
MULTIWORKER_CASES = (
    "fit_flow_arrays",
    "fit_with_val_split",
    "steps_per_epoch_infinite_dataset",
    "transformer_classifier_adam",
)
# The others take the same paths across workers as on 2 logical CPUs in the test process, where
# `make test` runs each one's feature (its equivalent, as in FULL); `make test-full` runs them
# in the test process and across workers. The
# other sparse-aware optimizers (RMSprop, Adagrad, Nadam, Lion) share the embeddings' gather
# and are each checked on 2 replicas in the test process (tests/training/test_sparse_updates.py).
_IN_PROCESS = {
    "loss_weights_dict_outputs": f"{_TEST}[sample_weight]",
    "custom_compute_loss": f"{_PARITY}[custom_compute_loss_with_x]",
    "class_weight": f"{_TEST}[class_weight]",
    "early_stopping_min_delta": f"{_PARITY}[callback_methods_keys]",
    "gradient_accumulation_adam": FULL["gradient_accumulation_adam"],
    "token_and_position_embedding_adamw": (
        "tests/training/test_sparse_updates.py::"
        "test_two_replicas_give_the_dense_gradients_update_of_one_device"
        "[token_and_position_embedding_adamw]"
    ),
}
MULTIWORKER_FULL_CASES = tuple(_IN_PROCESS)
_FULL = pytest.mark.full(*_IN_PROCESS.values())

# Worker 0 runs the registry's own runner: the one-device model.fit reference in its process
# (no state of the parent's earlier cases), then tfscale.fit over the cluster from the
# reference's initial weights, then the case's checks; it reports each case's outcome. Worker 1
# trains the same tfscale.fit from the same initial weights (the reference model built, not
# trained: a second reference would be a redundant training) and reports its weights, which
# MultiWorkerMirrored keeps equal to worker 0's.
_WORKER = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
from training.parity import CASES, SPARSE_CASES
from training.parity.registry import run_case, run_tfscale, reference_initial_weights

cases = {case.name: case for case in [*CASES, *SPARSE_CASES]}
chief = strategy.cluster_resolver.task_id == 0
outcome, weights = {}, {}
for name in sys.argv[3].split(","):
    if not chief:
        got = run_tfscale(cases[name], strategy, reference_initial_weights(cases[name]))
        outcome[name] = {"ok": True, "iterations": got.iterations}
        weights.update({f"{name}/{i}": w for i, w in enumerate(got.model.get_weights())})
        continue
    try:
        expected, got = run_case(cases[name], strategy)
        outcome[name] = {"ok": True, "iterations": got.iterations}
    except AssertionError as error:
        outcome[name] = {"ok": False, "why": str(error)}
        got = None
    if got is not None:
        weights.update({f"{name}/{i}": w for i, w in enumerate(got.model.get_weights())})
with open(sys.argv[1] + ".json", "w") as handle:
    json.dump(outcome, handle)
np.savez(sys.argv[1] + ".npz", **weights)
"""


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "cases",
    [
        pytest.param(MULTIWORKER_CASES, id="paths_across_workers"),
        pytest.param(MULTIWORKER_FULL_CASES, id="the_others", marks=_FULL),
    ],
)
def test_cases_across_two_worker_processes_match_one_device(
    tmp_path: Path, cases: tuple[str, ...]
) -> None:
    """Cases trained by 2 worker processes (MultiWorkerMirroredStrategy, one CPU each):
    worker 0's checked against one-device model.fit with the case's own checks, worker 1's
    weights equal to worker 0's."""
    run_workers(_WORKER, [str(tmp_path / "w"), str(TESTS), ",".join(cases)])
    chief = json.loads((tmp_path / "w0.json").read_text())
    assert sorted(chief) == sorted(cases)
    failed = {name: o["why"] for name, o in chief.items() if not o["ok"]}
    assert not failed, f"worker 0: {failed}"
    other = json.loads((tmp_path / "w1.json").read_text())
    assert other == chief  # the same updates on both workers
    assert all(o["iterations"] > 0 for o in chief.values())
    with np.load(tmp_path / "w0.npz") as first, np.load(tmp_path / "w1.npz") as second:
        assert sorted(first.files) == sorted(second.files)
        assert {key.split("/")[0] for key in first.files} == set(cases)
        for key in first.files:
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)
