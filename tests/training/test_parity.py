"""The parity suite, cases from Keras's own trainer, model and callback tests: each trained by
``tfscale.fit`` over 2 logical CPUs (MirroredStrategy) against one-device ``model.fit`` (see
``parity/registry.py`` for what is compared and with which tolerance). The keras-io cases and
the worker-process run are in ``test_parity_examples.py`` (two files, so that ``make test``'s
two pytest processes share the suite)."""

from __future__ import annotations

import pytest

from .helpers import strategy_for
from .parity import CALLBACK_CASES, TRAINER_CASES
from .parity.registry import Case, run_case, tiered

pytestmark = [pytest.mark.tf, pytest.mark.slow]


_TEST = "tests/training/test_parity.py::test_tfscale_fit_matches_one_device_model_fit"
_EXAMPLES = "tests/training/test_parity_examples.py::test_tfscale_fit_matches_one_device_model_fit"
# `make test` runs one case of each path through tfscale (#41); each case below takes the path
# of the `make test` case it names (a case name here, or a node id) and runs in `make test-full`
# (and in `make test-next`, which runs the whole suite).
FULL = {
    # Keras's data adapters: arrays, a dataset, a generator; a short or uneven batch.
    "fit_flow_steps_per_epoch": "fit_flow_arrays",
    "fit_with_data_adapter_dataset": "fit_flow_arrays",
    "steps_per_epoch_infinite_dataset": "python_generator",
    "odd_global_batch": "uneven_last_batch",
    "steps_per_execution_steps_per_epoch": "steps_per_execution_steps_count",
    # compile()'s losses and the loss function's path (compute_loss).
    "loss_weights_list_outputs": f"{_EXAMPLES}[sample_weight]",
    "loss_weights_dict_outputs": f"{_EXAMPLES}[sample_weight]",
    "partial_loss_partial_label": "custom_compute_loss_with_x",
    "internal_only_loss": "custom_compute_loss_with_x",
    "metric_update_in_compute_loss": "metric_tracking_weighted",
    # The model's build and call.
    "nested_inputs_dict": "symbolic_build_subclassed",
    "training_arg": "symbolic_build_subclassed",
    "jit_compile": "tests/training/test_xla.py::"
    "test_jit_trains_to_the_weights_of_keras_one_device_jit[2-conv]",
    "recompile": "second_fit_continues",
    "multi_optimizer_callable": "multi_optimizer_in_loss_scale_optimizer",
    "multi_optimizer_map": "multi_optimizer_in_loss_scale_optimizer",
    "validation_infinite_generator": "fit_with_val_split",
    # Callbacks: what they read and write, at epoch and batch boundaries.
    "early_stopping_start_from_epoch": "early_stopping_restore_best_weights",
    "early_stopping_baseline": "early_stopping_restore_best_weights",
    "early_stopping_min_delta": "early_stopping_restore_best_weights",
    "early_stopping_with_steps_per_epoch": "early_stopping_restore_best_weights",
    "callback_sets_weights_at_epoch_begin": "early_stopping_restore_best_weights",
    "callback_reads_weights_at_epoch_end": "early_stopping_restore_best_weights",
    "reduce_lr_on_plateau_cooldown_min_lr": "reduce_lr_on_plateau",
    "learning_rate_scheduler": "reduce_lr_on_plateau",
    "model_checkpoint_save_best_only": "backup_and_restore_resume",
    "model_checkpoint_every_epoch": "backup_and_restore_resume",
    "csv_logger": "callback_methods_keys",
    "tensorboard_epoch_scalars": "callback_methods_keys",
    "history_and_progbar_logger": "callback_methods_keys",
    "history_params": "callback_methods_keys",
    "lambda_callback_event_order": "callback_methods_keys",
    "callbacks_update_state_at_batch_boundary": "stop_loop_in_batch_hook",
    "terminate_on_nan": "stop_loop_in_batch_hook",
    "swap_ema_weights_on_epoch": "tests/training/test_keras_features.py::"
    "test_use_ema_is_finalized_and_swap_ema_weights_validates_with_the_averages",
    "swap_ema_weights_for_evaluation": "tests/training/test_keras_features.py::"
    "test_use_ema_is_finalized_and_swap_ema_weights_validates_with_the_averages",
    # One case of each feature stays in `make test` (#41's cut to 60% of its CPU): the data
    # adapters (arrays, a generator, an uneven last batch), the loss path (compute_loss), the
    # callbacks (their methods and keys), the symbolic build, an optimizer's update. The
    # paths above that named one of these name their feature's case in turn.
    "fit_with_val_split": "fit_flow_arrays",
    "second_fit_continues": "fit_flow_arrays",
    "steps_per_execution_steps_count": "tests/training/test_steps_per_call.py::"
    "test_several_steps_per_call_give_one_devices_weights_history_and_updates[arrays]",
    "metric_tracking_weighted": "custom_compute_loss_with_x",
    "fit_with_custom_train_step": "custom_compute_loss_with_x",
    "constraints_are_applied": "multi_optimizer_in_loss_scale_optimizer",
    "early_stopping_restore_best_weights": "callback_methods_keys",
    "reduce_lr_on_plateau": "callback_methods_keys",
    "backup_and_restore_resume": "callback_methods_keys",
    "stop_loop_in_batch_hook": "callback_methods_keys",
}


@pytest.mark.parametrize(
    "case", [tiered(case, FULL, _TEST) for case in [*TRAINER_CASES, *CALLBACK_CASES]]
)
def test_tfscale_fit_matches_one_device_model_fit(case: Case) -> None:
    run_case(case, strategy_for(2))
