"""``tfscale.fit``: train a compiled Keras model on every device, correctly, with one call."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfscale.errors import TfscaleWarning, TrainingError, explain
from tfscale.training.callbacks import make_callbacks, wants_batch_logs, wants_timings
from tfscale.training.checkpoint import CheckpointConfig, Checkpointer, TrainingCounters
from tfscale.training.coordinator import fit_with_coordinator, is_parameter_server
from tfscale.training.data import InputPipeline, make_input
from tfscale.training.precision import resolve_precision
from tfscale.training.trainer import Trainer, _check_model

__all__ = ["fit", "resolve_strategy"]


def resolve_strategy(model: Any, strategy: tf.distribute.Strategy | None) -> Any:
    """The strategy to train with: explicit, else the current scope's, else the model's,
    else ``tfscale.choose_strategy()`` (the default strategy while that is unavailable)."""
    if strategy is not None:
        return strategy
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    own = getattr(model, "_distribute_strategy", None)
    if own is not None:
        return own
    try:
        from tfscale.strategy import choose_strategy
    except ImportError:
        return tf.distribute.get_strategy()
    return choose_strategy().strategy


def _ensure_scope(model: Any, strategy: tf.distribute.Strategy) -> Any:
    """Returns a model whose variables ``strategy`` distributes, repairing it if needed."""
    outside = [
        v
        for v in model.variables
        if not strategy.extended.variable_created_in_scope(getattr(v, "value", v))
    ]
    if not outside:
        return model
    try:
        from tfscale.scope import fix_scope
    except ImportError:
        raise TrainingError(
            explain(
                f"{len(outside)} variables of the model were created outside the strategy's "
                f"scope (first: {outside[0].path}).",
                received=f"model {model.name!r} built outside strategy.scope()",
                fix="build and compile it inside the scope:\n"
                "    with strategy.scope():\n"
                "        model = build_model()",
            )
        ) from None
    warnings.warn(
        f"{len(outside)} variables of model {model.name!r} were created outside the "
        "strategy's scope; tfscale.fit trains a copy rebuilt in the scope (fix_scope) and "
        "copies its weights back. Build the model inside strategy.scope() to avoid this.",
        TfscaleWarning,
        stacklevel=3,
    )
    return fix_scope(model, strategy)


def _checkpoint_config(checkpoint_dir: Any) -> CheckpointConfig | None:
    if checkpoint_dir is None or isinstance(checkpoint_dir, CheckpointConfig):
        return checkpoint_dir
    return CheckpointConfig(str(checkpoint_dir))


def _steps_per_epoch(
    steps_per_epoch: int | None, pipeline: InputPipeline, accumulation_steps: int
) -> int | None:
    if steps_per_epoch is not None:
        if isinstance(steps_per_epoch, bool) or int(steps_per_epoch) < 1:
            raise TrainingError(
                explain(
                    "steps_per_epoch must be a positive integer (optimizer updates).",
                    received=steps_per_epoch,
                    allowed="None or an int >= 1",
                )
            )
        return int(steps_per_epoch)
    if pipeline.batches_per_epoch is None:
        return None
    return math.ceil(pipeline.batches_per_epoch / accumulation_steps)


def fit(
    model: Any,
    data: Any,
    *,
    epochs: int = 1,
    batch_size: int | None = None,
    steps_per_epoch: int | None = None,
    accumulation_steps: int = 1,
    steps_per_execution: int = 1,
    mixed_precision: str | None = None,
    clipnorm: float | None = None,
    remat: bool = False,
    jit_compile: bool = False,
    validation_data: Any = None,
    callbacks: Sequence[Any] | None = None,
    checkpoint_dir: str | CheckpointConfig | None = None,
    strategy: tf.distribute.Strategy | None = None,
    verbose: int | str = "auto",
) -> keras.callbacks.History:
    """Trains a compiled Keras model over every replica of a strategy.

    The result equals training on one device with the same global batch: each update
    is the mean gradient over all its examples, all-reduced once per update, clipped by
    the global norm after the all-reduce, and applied once.

    Args:
        model: A compiled Keras model (its optimizer, loss and metrics are used).
        data: A ``tf.data.Dataset`` (batched, or unbatched with ``batch_size``), a tuple
            ``(x, y)`` / ``(x, y, sample_weight)`` of arrays (shuffled per epoch with a fixed
            seed), or ``dataset_fn(input_context)`` returning per-replica batches.
        epochs: Epochs to train (a resumed run continues up to this number).
        batch_size: GLOBAL examples of one micro-step (arrays default to 32).
        steps_per_epoch: Optimizer updates per epoch; None is one pass over the data.
        accumulation_steps: Micro-batches per optimizer update; the update's batch is
            ``batch_size * accumulation_steps``.
        steps_per_execution: Updates per compiled-function call.
        mixed_precision: None, ``"bf16"`` or ``"fp16"`` (dynamic loss scaling).
        clipnorm: Clip the all-reduced gradient to this global norm.
        remat: Recompute activations in the backward pass to save memory.
        jit_compile: Compile each replica's forward and backward pass with XLA.
        validation_data: Data as for ``data``, evaluated on all replicas after each epoch.
        callbacks: Keras callbacks.
        checkpoint_dir: Folder (or :class:`CheckpointConfig`) to save to every epoch and
            every N updates, and to resume from.
        strategy: The strategy; None takes the current scope's, the model's, or
            ``tfscale.choose_strategy()``.
        verbose: ``"auto"``/1 progress bar, 2 one line per epoch, 0 silent (chief only).

    Returns:
        The ``keras.callbacks.History`` of the run.

    Raises:
        TrainingError: The model is not compiled, the global batch does not split over the
            replicas, a setting is invalid or the data cannot be read.
        NonFiniteLossError: The loss became NaN or infinite (the step number is given).
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise TrainingError(
            explain("epochs must be a positive integer.", received=epochs, allowed="int >= 1")
        )
    user_model = model
    strategy = resolve_strategy(model, strategy)
    config = _checkpoint_config(checkpoint_dir)
    if is_parameter_server(strategy):
        return fit_with_coordinator(
            model,
            data,
            strategy=strategy,
            epochs=epochs,
            batch_size=batch_size,
            steps_per_epoch=steps_per_epoch,
            callbacks=callbacks,
            checkpoint_dir=None if config is None else config.directory,
            verbose=verbose,
            accumulation_steps=accumulation_steps,
            steps_per_execution=steps_per_execution,
            mixed_precision=mixed_precision,
            clipnorm=clipnorm,
            remat=remat,
            jit_compile=jit_compile,
            validation_data=validation_data,
        )
    precision = resolve_precision(mixed_precision)
    Trainer._validate_counts(accumulation_steps, steps_per_execution)
    _check_model(user_model)
    model = _ensure_scope(user_model, strategy)
    pipeline = make_input(
        data, batch_size=batch_size, strategy=strategy, steps_per_epoch=steps_per_epoch
    )
    trainer = Trainer(
        model,
        strategy,
        sample_batch=pipeline.sample(),
        precision=precision,
        accumulation_steps=accumulation_steps,
        steps_per_execution=steps_per_execution,
        clipnorm=clipnorm,
        remat=remat,
        jit_compile=jit_compile,
        nominal_batch=pipeline.global_batch,
    )
    validation = None
    if validation_data is not None:
        validation = make_input(validation_data, batch_size=batch_size, strategy=strategy)
    steps = _steps_per_epoch(steps_per_epoch, pipeline, accumulation_steps)
    callback_list = make_callbacks(
        callbacks, model=model, strategy=strategy, verbose=verbose, epochs=epochs, steps=steps
    )
    trainer.record_timings = wants_timings(callback_list.callbacks)
    with strategy.scope():
        counters = TrainingCounters()
    checkpointer = None
    if config is not None:
        extra = {} if trainer.loss_scale is None else {"loss_scale": trainer.loss_scale.scale}
        checkpointer = Checkpointer(
            config,
            strategy,
            model=model,
            optimizer=trainer.optimizer,
            epoch=counters.epoch,
            step=counters.step,
            batches_in_epoch=counters.batches_in_epoch,
            **extra,
        )
        checkpointer.restore()
    _run(trainer, pipeline, validation, callback_list, counters, checkpointer, epochs, steps)
    if model is not user_model:
        user_model.set_weights(model.get_weights())
    history: keras.callbacks.History = callback_list._history
    return history


def _run(
    trainer: Trainer,
    pipeline: InputPipeline,
    validation: InputPipeline | None,
    callbacks: keras.callbacks.CallbackList,
    counters: TrainingCounters,
    checkpointer: Checkpointer | None,
    epochs: int,
    steps: int | None,
) -> None:
    model = trainer.model
    model.stop_training = False
    step = last_saved = trainer.updates = int(counters.step.numpy())
    first_epoch = int(counters.epoch.numpy())
    skip = int(counters.batches_in_epoch.numpy())

    def save(epoch_done: int, batches: int) -> None:
        # Counters are plain Python ints in the loop (no eager op per step) until a save.
        counters.step.assign(step)
        counters.epoch.assign(epoch_done)
        counters.batches_in_epoch.assign(batches)
        if checkpointer is not None:
            checkpointer.save(step)

    callbacks.on_train_begin()
    k = trainer.accumulation_steps
    batch_logs_wanted = wants_batch_logs(callbacks.callbacks)
    for epoch in range(first_epoch, epochs):
        callbacks.on_epoch_begin(epoch)
        trainer.reset()
        iterator = iter(pipeline.distributed(epoch, skip))
        done_in_epoch, batches, skip = skip // k, skip, 0
        logs: dict[str, Any] = {}
        called = False  # epoch logs once the train function ran (as before)
        while steps is None or done_in_epoch < steps:
            want = trainer.steps_per_execution
            if steps is not None:
                want = min(want, steps - done_in_epoch)
            callbacks.on_train_batch_begin(done_in_epoch)
            done, exhausted, logs = trainer.train(iterator, want, logs=batch_logs_wanted)
            called = True
            done_in_epoch += done
            batches += done * k
            step += done
            if done:
                batch_logs = dict(logs)
                if trainer.record_timings and trainer.timings:
                    batch_logs["fetch_seconds"] = trainer.timings[-1].fetch_seconds
                    batch_logs["step_seconds"] = trainer.timings[-1].step_seconds
                callbacks.on_train_batch_end(done_in_epoch - 1, batch_logs)
            if checkpointer is not None and checkpointer.due(step, last_saved):
                save(epoch, batches)
                last_saved = step
            if exhausted or model.stop_training:
                break
        epoch_logs = trainer.epoch_logs() if called else {}
        if validation is not None:
            val = trainer.evaluate(validation.distributed(0))
            epoch_logs.update({f"val_{name}": value for name, value in val.items()})
        save(epoch + 1, 0)
        last_saved = step
        callbacks.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    callbacks.on_train_end()
