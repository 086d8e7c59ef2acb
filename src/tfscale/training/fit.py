"""``tfscale.fit``: ``model.fit``'s call, with tfscale's correct update on every replica.

``tfscale.fit(model, ...)`` takes ``model.fit``'s arguments with their meaning, prepares the
model (``prepare.py``) and lets Keras run the loop, so data adapters, epochs, callbacks,
validation and History are Keras's own. What it adds around that loop: tfscale's options,
checkpoints that resume mid-epoch, a stop with the update number on a non-finite loss, a
progress bar on the chief worker only, ``dataset_fn`` inputs, and ParameterServerStrategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import warnings
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.strategy.current import num_workers
from tfscale.training.callbacks import ExactSteps, is_chief, watches_batches
from tfscale.training.checkpoint import (
    CheckpointCallback,
    CheckpointConfig,
    SavedPosition,
    saved_position,
)
from tfscale.training.checks import (
    check_batch_size,
    check_checkpoint_dir,
    check_inputs,
    check_pipeline_batches,
    check_steps,
    check_validation,
    check_validation_freq,
    python_int,
)
from tfscale.training.coordinator import (
    fit_with_coordinator,
    is_parameter_server,
    refuse_unsupported,
)
from tfscale.training.data import agreed_seed, finite_length, plan_inputs
from tfscale.training.options import Entry, Options, resolve_strategy
from tfscale.training.prepare import check_model, prepare_model
from tfscale.training.shorthand import takes_options

__all__ = [
    "AUTO_MIN_STEPS",
    "AUTO_STEPS_PER_EXECUTION",
    "TfscaleFit",
    "auto_steps_per_execution",
    "fit",
]


@functools.cache
def _defaults() -> dict[str, Any]:
    """``fit``'s default of each argument."""
    return {name: p.default for name, p in inspect.signature(fit).parameters.items()}


@functools.cache
def _keras_fit() -> dict[str, Any]:
    """``keras.Model.fit``'s arguments and their defaults, read from Keras (TfscaleFit.planned
    reads the call's arguments by name)."""
    parameters = inspect.signature(keras.Model.fit).parameters
    return {name: p.default for name, p in parameters.items() if name != "self"}


def _checkpoint_config(checkpoint_dir: Any) -> CheckpointConfig | None:
    if checkpoint_dir is None or isinstance(checkpoint_dir, CheckpointConfig):
        return checkpoint_dir
    return CheckpointConfig(str(checkpoint_dir))


def _from_data(data: Any, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
    """Reads the ``data=`` alias of tfscale's first API: ``(x, y[, sample_weight])``, a
    dataset, or ``dataset_fn``."""
    if data is None:
        return x, y, sample_weight
    if x is not None or y is not None or sample_weight is not None:
        raise TrainingError(
            explain(
                "data= is an alias of x (and y, sample_weight); both were given.",
                received=f"data={type(data).__name__} and x/y/sample_weight",
                fix="pass either tfscale.fit(model, x, y, ...) or tfscale.fit(model, data=...)",
            )
        )
    if isinstance(data, (tuple, list)) and 2 <= len(data) <= 3:
        parts = [*list(data), None]
        return parts[0], parts[1], parts[2]
    return data, None, None


def _check_epochs(epochs: object, initial_epoch: object) -> None:
    for name, value, low in (("epochs", epochs, 0), ("initial_epoch", initial_epoch, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise TrainingError(
                explain(
                    f"{name} must be an integer >= {low}.",
                    received=f"{name}={value!r}",
                    allowed=f"an int >= {low}",
                )
            )


def _data_seed(resumed: SavedPosition | None) -> int:
    """The seed of the arrays' per-epoch order: the resumed run's, else a new one (from
    NumPy's global generator, which ``keras.utils.set_random_seed`` seeds)."""
    if resumed is not None and resumed.data_seed is not None:
        return resumed.data_seed
    return int(np.random.randint(2**31 - 1))


def _check_input(x: Any, steps_per_epoch: int | None) -> None:
    """Refuses inputs Keras would fail on late or never finish with."""
    if isinstance(x, (str, bytes, os.PathLike)):
        raise TrainingError(
            explain(
                "tfscale.fit cannot read this data: it is a file name, not the data.",
                received=repr(x),
                allowed="arrays, dicts of arrays, a tf.data.Dataset, a generator, a "
                "keras.utils.PyDataset, or dataset_fn(input_context)",
                fix="load it first, e.g. tf.data.experimental.make_csv_dataset(path, 32)",
            )
        )
    if (
        isinstance(x, tf.data.Dataset)
        and steps_per_epoch is None
        and int(x.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
    ):
        raise TrainingError(
            explain(
                "The dataset repeats forever, so an epoch would never end.",
                received="a dataset with infinite cardinality and steps_per_epoch=None",
                fix="pass steps_per_epoch=N (steps per epoch), or drop .repeat()",
            )
        )


@contextlib.contextmanager
def _expected_end_of_data(config: CheckpointConfig | None, unknown_length: bool) -> Iterator[None]:
    """Keras warns that "your input ran out of data" whenever an epoch ends because the data
    ended. Here that is expected: a resumed epoch ends early (its first batches were trained
    before the interruption), and a multi-worker ``dataset_fn`` hides its length."""
    resuming = config is not None and tf.train.latest_checkpoint(config.directory) is not None
    if not resuming and not unknown_length:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        yield


@contextlib.contextmanager
def _steps_per_execution(model: Any, value: int | None) -> Iterator[None]:
    """Runs ``value`` steps per call of the train function for this call only."""
    if value is None:
        yield
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TrainingError(
            explain(
                "steps_per_execution must be a positive integer.",
                received=f"steps_per_execution={value!r}",
                allowed="an int >= 1, or None for compile()'s value",
            )
        )
    saved = model.steps_per_execution
    model.steps_per_execution = value
    try:
        yield
    finally:
        model.steps_per_execution = saved


# Steps per call of the train function when nothing watches batches (#26): a call costs
# Keras's loop and its callbacks ~0.3 ms in Python, a third of a small model's step on a CPU.
AUTO_STEPS_PER_EXECUTION = 16
# ... and only in a fit of at least this many steps: tracing the call's while loop costs a
# small model on 2 replicas about 0.05 CPU-s more than one step per call, which the loop's
# fewer calls win back between 64 and 128 steps (benchmarks/fit_cost.py --steps-per-call, two
# runs: 0.59 vs 0.64 CPU-s at 16 steps, 0.68 vs 0.69 at 64, 0.77-0.83 vs 0.76-0.79 at 128). A
# shorter fit (a sweep's, a TaskPool's) would pay for a loop it does not use.
AUTO_MIN_STEPS = 128


def auto_steps_per_execution(
    model: Any,
    strategy: tf.distribute.Strategy,
    callbacks: Sequence[Any],
    verbose: int | str,
    fit_arguments: dict[str, Any],
    checkpointing: bool,
    epochs: int,
) -> int | None:
    """Steps per train function call for a fit given no ``steps_per_execution``: None keeps
    compile()'s; :data:`AUTO_STEPS_PER_EXECUTION` where running several steps per call
    changes nothing but the time and the fit runs at least :data:`AUTO_MIN_STEPS` steps.

    Keras calls the batch hooks of callbacks once per call, so several steps per call are
    invisible exactly when: compile() left it at 1; no callback overrides a batch hook
    (:func:`~tfscale.training.callbacks.watches_batches`); no progress bar is drawn per batch
    (``verbose`` 0 or 2); no step checkpoint is due mid-call (no ``checkpoint_dir``); and
    each epoch's length is known, so that its last call runs exactly the steps left
    (``ExactSteps``): a dataset's own length, or ``steps_per_epoch`` over an input of
    unknown length (tfscale's arrays, a generator, a repeated dataset). It stays at 1 with
    validation (Keras's evaluation runs whole calls, so ``validation_steps`` would not be
    exact), on several workers, and eagerly; and at 1 for a fit of fewer than
    :data:`AUTO_MIN_STEPS` steps over its ``epochs`` (the epochs this call runs), whose
    while loop would cost more to trace than its fewer calls save.
    """
    if int(model.steps_per_execution) != 1 or getattr(model, "run_eagerly", False):
        return None
    if checkpointing or num_workers(strategy) != 1 or verbose not in (0, 2):
        return None
    if fit_arguments.get("validation_data") is not None or fit_arguments.get("validation_split"):
        return None
    # An epoch's length: steps_per_epoch over an input of unknown length, or a dataset's own.
    # Both known is refused: Keras counts whole calls against the dataset's length and would
    # start each epoch on a new iterator instead of continuing (keras-io's "steps_per_epoch on
    # a dataset", tests/training/parity).
    given = fit_arguments.get("steps_per_epoch")
    length = finite_length(fit_arguments.get("x"))
    if bool(given) == (length is not None):
        return None
    if epochs * int(given or length or 0) < AUTO_MIN_STEPS:
        return None
    if any(watches_batches(callback) for callback in callbacks):
        return None
    return AUTO_STEPS_PER_EXECUTION


@takes_options(Entry.FIT)
def fit(
    model: Any,
    x: Any = None,
    y: Any = None,
    batch_size: int | None = None,
    epochs: int = 1,
    verbose: int | str = "auto",
    callbacks: Sequence[Any] | None = None,
    validation_split: float = 0.0,
    validation_data: Any = None,
    shuffle: bool | str = True,
    class_weight: dict[int, float] | None = None,
    sample_weight: Any = None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: int = 1,
    *,
    data: Any = None,
    strategy: tf.distribute.Strategy | None = None,
    steps_per_execution: int | None = None,
    checkpoint_dir: str | CheckpointConfig | None = None,
    options: Options,
) -> keras.callbacks.History:
    """Trains a compiled Keras model over every replica of a strategy, as ``model.fit`` would
    on one device.

    Every argument up to ``validation_freq`` is ``keras.Model.fit``'s, with its meaning
    (arrays, dicts, ``tf.data``, generators, ``keras.utils.PyDataset``, x-only inputs; Keras
    runs the loop). ``x`` may also be ``dataset_fn(input_context)`` returning per-replica
    batches. Each update is the mean gradient over all its examples, all-reduced once,
    clipped by the global norm after the all-reduce and applied by the model's optimizer.

    Args:
        model: A compiled Keras model, built inside or outside the strategy's scope; it
            (and its optimizer) holds the trained state afterwards.
        x: Inputs, as ``model.fit``; or ``dataset_fn``.
        y: Targets, as ``model.fit``.
        batch_size: GLOBAL examples per step (per micro-batch with accumulation).
        epochs: As ``model.fit``.
        verbose: As ``model.fit``; only the chief worker prints.
        callbacks: Keras callbacks; they see ``model.fit``'s protocol.
        validation_split: As ``model.fit``.
        validation_data: As ``model.fit`` (evaluated on all replicas).
        shuffle: As ``model.fit``.
        class_weight: As ``model.fit``.
        sample_weight: As ``model.fit``.
        initial_epoch: As ``model.fit``.
        steps_per_epoch: As ``model.fit`` (steps are batches; with accumulation an update
            takes ``accumulation_steps`` of them).
        validation_steps: As ``model.fit``.
        validation_batch_size: As ``model.fit``.
        validation_freq: As ``model.fit``.
        data: The first tfscale API's input, an alias: ``(x, y[, sample_weight])``, a
            dataset or ``dataset_fn``.
        strategy: The strategy; None takes the current scope's, the model's own, or
            ``tfscale.choose_strategy()``.
        steps_per_execution: Steps per compiled call for this fit; None keeps compile()'s,
            or runs :data:`AUTO_STEPS_PER_EXECUTION` where that changes nothing but the
            time (no callback watches batches, no validation, at least
            :data:`AUTO_MIN_STEPS` steps: see :func:`auto_steps_per_execution`); 1 runs one
            step per call. An argument of
            this run, as ``checkpoint_dir``, rather than an option of the update: not in
            :class:`tfscale.Options`.
        checkpoint_dir: Folder (or :class:`CheckpointConfig`) to save to every epoch and
            every N steps, and to resume from, mid-epoch included.

    Returns:
        The ``keras.callbacks.History`` of the run.

    Raises:
        TrainingError: The model is not compiled, or an argument is invalid (the message
            says which and how to fix it); also a ``ValueError``, as Keras's.
        NonFiniteLossError: The loss became NaN or infinite (the update number is given);
            with a ``keras.callbacks.TerminateOnNaN`` among the callbacks, training stops
            instead and the History is returned.
    """
    arguments = dict(locals())  # every argument by name, for ParameterServerStrategy's check
    # NumPy integers are taken wherever model.fit takes them.
    (
        batch_size, epochs, initial_epoch, steps_per_epoch, validation_steps,
        validation_batch_size, validation_freq, verbose, steps_per_execution,
    ) = (
        python_int(value) for value in (
            batch_size, epochs, initial_epoch, steps_per_epoch, validation_steps,
            validation_batch_size, validation_freq, verbose, steps_per_execution,
        )
    )  # fmt: skip
    _check_epochs(epochs, initial_epoch)
    x, y, sample_weight = _from_data(data, x, y, sample_weight)
    check_model(model)
    check_batch_size("batch_size", batch_size)
    check_batch_size("validation_batch_size", validation_batch_size)
    check_steps("steps_per_epoch", steps_per_epoch)
    check_steps("validation_steps", validation_steps)
    check_validation_freq(validation_freq)
    strategy = resolve_strategy(model, strategy)
    parameter_server = is_parameter_server(strategy)
    if parameter_server:
        # Every argument the coordinator loop does not honour is refused here, by name,
        # before any work (the checkpoint folder is not even created); each option in
        # options= by its own name (coordinator.refuse_unsupported).
        arguments.update(x=x, y=y, sample_weight=sample_weight)
        refuse_unsupported(arguments, _defaults())
    config = _checkpoint_config(checkpoint_dir)
    if config is not None:
        check_checkpoint_dir(config.directory)
    if parameter_server:
        return fit_with_coordinator(
            model,
            x if y is None else (x, y) if sample_weight is None else (x, y, sample_weight),
            strategy=strategy,
            epochs=epochs,
            batch_size=batch_size,
            steps_per_epoch=steps_per_epoch,
            callbacks=callbacks,
            checkpoint_dir=None if config is None else config.directory,
            verbose=verbose,
            initial_epoch=initial_epoch,
            shuffle=shuffle,
            max_to_keep=2 if config is None else config.max_to_keep,
        )
    state = prepare_model(model, strategy, options)
    resumed = None if config is None else saved_position(config.directory)
    seed = agreed_seed(_data_seed(resumed), strategy)
    callback_list = list(callbacks or [])
    # A callback that asks for them (tfscale.ProfileCallback) reads the train function's
    # per-call fetch and step seconds.
    state.time_steps(any(getattr(c, "tfscale_wants_timings", False) for c in callback_list))
    # The prepared model's fit adds the non-finite guard (callbacks.guarded).
    callback_list.append(ExactSteps())
    if config is not None:
        callback_list.insert(0, CheckpointCallback(config, strategy, data_seed=seed))
    if not is_chief(strategy):
        verbose = 0
    # The model's own fit gets the call as the user made it (KerasHub's task models run their
    # preprocessor there); tfscale's input handling happens where Keras's does, in the fit
    # the model's reaches (modelclass.Below -> Prepared.keras_fit -> TfscaleFit.planned).
    state.request = TfscaleFit(
        strategy=strategy,
        config=config,
        resumed=resumed,
        seed=seed,
        epochs=epochs,
        steps_per_execution=steps_per_execution,
    )
    try:
        history: keras.callbacks.History = model.fit(
            x=x,
            y=y,
            batch_size=batch_size,
            epochs=epochs,
            verbose=verbose,
            callbacks=callback_list,
            validation_split=validation_split,
            validation_data=validation_data,
            shuffle=shuffle,
            class_weight=class_weight,
            sample_weight=sample_weight,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq,
        )
    finally:
        state.request = None  # a model fit that never reached Keras's fit leaves none behind
    return history


@dataclasses.dataclass
class TfscaleFit:
    """``tfscale.fit``'s input handling, applied to the arguments of the Keras-level ``fit``
    it reaches (``prepare.FitRequest``): for a model that does not override ``fit`` these are
    the user's own; for one that does (KerasHub's preprocessing ``fit``), what its ``fit``
    hands Keras."""

    strategy: tf.distribute.Strategy
    config: CheckpointConfig | None
    resumed: SavedPosition | None
    seed: int
    epochs: int
    steps_per_execution: int | None

    @contextlib.contextmanager
    def planned(self, model: Any, arguments: MutableMapping[str, Any]) -> Iterator[None]:
        """Checks Keras ``fit``'s data arguments and replaces them by tfscale's plan
        (``data.plan_inputs``), in place; held while Keras's ``fit`` runs."""
        named = {name: arguments.get(name, default) for name, default in _keras_fit().items()}
        x, y, validation_data = named["x"], named["y"], named["validation_data"]
        batch_size, steps_per_epoch = named["batch_size"], named["steps_per_epoch"]
        _check_input(x, steps_per_epoch)
        check_inputs(model, x, y, named["validation_split"], validation_data)
        check_validation(x, validation_data)
        check_pipeline_batches(model, x, batch_size)
        if isinstance(validation_data, (tuple, list)) and validation_data:
            validation_batch = named["validation_batch_size"] or batch_size
            check_pipeline_batches(model, validation_data[0], validation_batch)
        elif validation_data is not None:
            check_pipeline_batches(model, validation_data, None)
        initial_epoch = named["initial_epoch"]
        first_epoch = (
            initial_epoch if self.resumed is None else max(initial_epoch, self.resumed.epoch)
        )
        inputs = plan_inputs(
            x=x,
            y=y,
            sample_weight=named["sample_weight"],
            batch_size=batch_size,
            shuffle=named["shuffle"],
            steps_per_epoch=steps_per_epoch,
            validation_split=named["validation_split"],
            validation_data=validation_data,
            validation_steps=named["validation_steps"],
            validation_batch_size=named["validation_batch_size"],
            epochs=range(first_epoch, named["epochs"]),
            seed=self.seed,
            strategy=self.strategy,
            resumable=self.config is not None,
            class_weight=named["class_weight"],
        )
        arguments.update(inputs.fit)
        steps_per_execution = self.steps_per_execution
        if steps_per_execution is None:
            steps_per_execution = auto_steps_per_execution(
                model,
                self.strategy,
                list(named["callbacks"] or []),
                named["verbose"],
                inputs.fit,
                self.config is not None,
                named["epochs"] - first_epoch,
            )
        with (
            _steps_per_execution(model, steps_per_execution),
            _expected_end_of_data(self.config, inputs.unknown_length),
        ):
            yield
