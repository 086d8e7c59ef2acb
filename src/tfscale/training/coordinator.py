"""``tfscale.fit`` under ParameterServerStrategy: a ClusterCoordinator training loop.

Under ParameterServerStrategy the chief does not train: it creates the variables on the
``ps`` tasks and schedules step functions on the ``worker`` tasks, which run them
asynchronously, each on batches of its own copy of the dataset::

    chief:     reset metrics ─► schedule(step) x steps_per_epoch ─► join() ─► metrics' results
               = epoch logs ─► checkpoint
    worker i:  next(batch) ─► model.train_step: forward, loss, optimizer.apply, metric
               updates, all on the variables on ps
    ps j:      holds a slice of the variables (the model's, the optimizer's, the metrics')

Each scheduled step is the model's own ``train_step`` (#25.2), as in Keras 2's ``model.fit``
under this strategy: ``compute_loss`` and ``train_step`` overrides, ``add_loss``, several
outputs with their loss weights and the compiled metrics run as on one device. The
variables the step creates lazily on one device (the model's, the compiled loss's and
metrics', the optimizer's) are created before the first step, on the ``ps`` tasks
(``internals.symbolic_build``), so the metrics accumulate there over every worker's steps
(each update one atomic op: Keras's read-then-write ``assign_add`` lost updates of concurrent
workers, ``internals.atomic_variable_updates``) and each epoch's logs are their results,
read by the chief after ``join()``. A step that
cannot be traced for the workers (it creates variables, or uses an optimizer that is not
built) is refused before any update with a TrainingError naming the override.

The custom-loop core (``loop.py``, ``optimizer.DistributedUpdate``) is not used here: what it
adds is the synchronous update (example-weighted gradients, one all-reduce over replicas,
clipping and finiteness after it), and an asynchronous worker's step has nothing to reduce
with; each step is one device's, applied by Keras's own optimizer to the ps variables.

With one worker the scheduled steps run one after the other and the result equals one
device's (tested to 0.0 difference). With several, updates are asynchronous, so the result
does not equal a single-device run step for step (that is what the synchronous strategies
are for); it trains the same model on the same data.

Each ``tfscale.fit`` argument is honoured (``HONOURED``) or, set to a value that uses it,
refused before any work with a TrainingError naming it and its fix
(:func:`refuse_unsupported`): the options that need a synchronous all-reduce, validation,
``class_weight``, and any argument ``fit`` gains before this loop learns it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.interop import internals
from tfscale.training.adopt import adopt
from tfscale.training.options import Entry, Options, option_fields, spec

__all__ = [
    "HONOURED",
    "fit_with_coordinator",
    "is_parameter_server",
    "refuse_unsupported",
    "unsupported_options",
]

#: The ``tfscale.fit`` arguments this loop acts on: these, ``options=`` itself, and the
#: options whose ``Spec.entries`` include ``Entry.PARAMETER_SERVER`` (none yet). Every other
#: one is refused, before any work, when set to a value that uses it
#: (``unsupported_options``), so an argument added to ``tfscale.fit`` is refused here until
#: this loop honours it.
HONOURED = frozenset(
    {
        "model", "x", "y", "sample_weight", "data", "strategy", "batch_size", "epochs",
        "initial_epoch", "steps_per_epoch", "shuffle", "callbacks", "verbose",
        "checkpoint_dir", "options",
    }
    | {f.name for f in option_fields() if Entry.PARAMETER_SERVER in spec(f.name).entries}
)  # fmt: skip

_SYNCHRONOUS = (
    "drop it: it needs a synchronous step (all-reduced gradients, one loss scale, one global "
    "norm), which the asynchronous workers do not take; or train synchronously with "
    "MultiWorkerMirroredStrategy (tfscale launch -n N without --ps)"
)
_VALIDATION = (
    "drop it: the coordinator loop runs no validation pass; evaluate the trained model "
    "afterwards, or train with MultiWorkerMirroredStrategy (tfscale launch -n N without "
    "--ps), where validation works"
)

# How to do without an option (Options' fields) this loop does not honour, beyond dropping it.
_OPTION_HINTS = {
    "global_clipnorm": "; to clip each worker's gradient, give the optimizer Keras's own "
    "global_clipnorm (keras.optimizers.SGD(0.01, global_clipnorm=1.0))",
}

# Refused argument -> (the values that leave it unused, how to do without it): fit's own
# arguments, then every option this loop does not honour (from Options' fields).
_REFUSED: Mapping[str, tuple[tuple[object, ...], str]] = {
    "validation_split": ((0, 0.0), _VALIDATION),
    "validation_data": ((None,), _VALIDATION),
    "validation_steps": ((None,), _VALIDATION),
    "validation_batch_size": ((None,), _VALIDATION),
    "validation_freq": ((1,), _VALIDATION),
    "class_weight": (
        (None,),
        "weight each example instead: sample_weight=np.array([class_weight[int(c)] for c in y])",
    ),
    "steps_per_execution": ((None, 1), _SYNCHRONOUS),
    "clipnorm": ((None,), "drop it (see tfscale.fit's global_clipnorm)"),
    **{
        f.name: (spec(f.name).unused, _SYNCHRONOUS + _OPTION_HINTS.get(f.name, ""))
        for f in option_fields()
        if f.name not in HONOURED
    },
}
_NOT_YET = (
    "drop it: the coordinator loop (tfscale/training/coordinator.py) does not pass it on; "
    "or train with MultiWorkerMirroredStrategy (tfscale launch -n N without --ps)"
)


def _unused(value: object, values: Sequence[object]) -> bool:
    # Identity first: arrays and datasets do not compare with ==; numbers compare by value.
    return any(value is v or (_scalar(value) and _scalar(v) and value == v) for v in values)


def _scalar(value: object) -> bool:
    return isinstance(value, (bool, int, float, np.generic))


def _limits(arguments: Mapping[str, object]) -> dict[str, str]:
    """Honoured arguments given a value this loop cannot honour, with the fix."""
    limits = {}
    if arguments.get("shuffle") == "batch":
        limits["shuffle"] = "pass shuffle=True (each worker shuffles its copy of the arrays)"
    if getattr(arguments.get("checkpoint_dir"), "every_steps", None) is not None:
        limits["checkpoint_dir"] = (
            "the coordinator loop saves at epoch ends only: pass the folder as a string, or "
            "CheckpointConfig(folder, every_steps=None)"
        )
    if arguments.get("sample_weight") is not None and arguments.get("y") is None:
        limits["sample_weight"] = (
            "with a dataset, put the weights in it: batches of (x, y, sample_weight)"
        )
    return limits


def _expanded(arguments: Mapping[str, object]) -> dict[str, object]:
    """``arguments`` with an ``options=`` :class:`Options` replaced by its fields, so that
    each option is judged (and named) on its own; a field left unused there keeps the value
    given by its own name."""
    given = dict(arguments)
    options = given.pop("options", None)
    if not isinstance(options, Options):
        return given
    for each in option_fields():
        value = getattr(options, each.name)
        if each.name not in given or not _unused(value, spec(each.name).unused):
            given[each.name] = value
    return given


def unsupported_options(
    options: Mapping[str, object], defaults: Mapping[str, object] | None = None
) -> list[str]:
    """The names of ``fit`` arguments set to values this loop cannot honour.

    Args:
        options: ``tfscale.fit``'s arguments by name (some or all); an ``options`` entry
            (a :class:`tfscale.Options`) stands for its fields.
        defaults: ``tfscale.fit``'s defaults, which say "unused" for an argument this
            module does not know yet (None otherwise).
    """
    options = _expanded(options)
    limits = _limits(options)
    refused = []
    for name, value in options.items():
        if name in HONOURED:
            if name in limits:
                refused.append(name)
            continue
        unused, _ = _REFUSED.get(name, ((None if defaults is None else defaults.get(name),), ""))
        if not _unused(value, unused):
            refused.append(name)
    return refused


def refuse_unsupported(
    options: Mapping[str, object], defaults: Mapping[str, object] | None = None
) -> None:
    """Raises, before any work, for every argument :func:`unsupported_options` names.

    Raises:
        TrainingError: Naming each such argument with its fix.
    """
    options = _expanded(options)
    refused = unsupported_options(options, defaults)
    if not refused:
        return
    limits = _limits(options)
    fixes = "".join(
        f"\n    {name}: {limits.get(name) or _REFUSED.get(name, ((), _NOT_YET))[1]}"
        for name in refused
    )
    raise TrainingError(
        explain(
            "tfscale.fit under ParameterServerStrategy trains asynchronously and does not "
            f"support: {', '.join(refused)}.",
            received=", ".join(f"{name}={_short(options[name])}" for name in refused),
            allowed=", ".join(sorted(HONOURED)) + " (x: arrays, a tf.data.Dataset or a "
            "dataset_fn; checkpoints at epoch ends)",
            fix="for each argument:" + fixes,
        )
    )


def _short(value: object) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"<{type(value).__name__} of shape {tuple(shape)}>"
    if isinstance(value, (tuple, list)) and any(hasattr(v, "shape") for v in value):
        return f"<{type(value).__name__} of {len(value)} arrays>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_parameter_server(strategy: Any) -> bool:
    """True for ``tf.distribute.ParameterServerStrategy`` (and its experimental alias)."""
    return any(c.__name__.startswith("ParameterServerStrategy") for c in type(strategy).__mro__)


def fit_with_coordinator(
    model: Any,
    data: Any,
    *,
    strategy: Any,
    epochs: int = 1,
    batch_size: int | None = None,
    steps_per_epoch: int | None = None,
    callbacks: Sequence[Any] | None = None,
    checkpoint_dir: str | None = None,
    verbose: int | str = "auto",
    initial_epoch: int = 0,
    shuffle: bool | str = True,
    max_to_keep: int = 2,
    **options: object,
) -> keras.callbacks.History:
    """Trains a compiled model through a ClusterCoordinator (see the module docstring).

    Args:
        model: A compiled Keras model; its own ``train_step`` runs on the workers. One
            built (or trained, or loaded) outside ``strategy.scope()`` has its variables
            moved onto the ps tasks first (``adopt``).
        data: ``(x, y)`` or ``(x, y, sample_weight)`` arrays (each worker shuffles its own
            copy with a different seed), a batched ``tf.data.Dataset`` (repeated), or
            ``dataset_fn(input_context)`` returning batches (repeated by the caller).
        strategy: The ParameterServerStrategy.
        epochs: Epochs; each is ``steps_per_epoch`` scheduled steps spread over workers.
        batch_size: Examples per step (per worker step; arrays default to 32).
        steps_per_epoch: Steps per epoch; for arrays defaults to one pass over the data.
        callbacks: Keras callbacks; they see epoch begin and end (steps run asynchronously).
        checkpoint_dir: Folder to save to after each epoch and to resume from.
        verbose: 0 silent, otherwise one line per epoch.
        initial_epoch: The epoch to start at (a restored checkpoint's, if later).
        shuffle: False reads the arrays in order; True shuffles each worker's copy.
        max_to_keep: Checkpoints kept in ``checkpoint_dir``.
        **options: Other ``tfscale.fit`` arguments, ``options=tfscale.Options(...)``
            included; any set to a value this loop cannot honour raises
            (:func:`unsupported_options`).

    Returns:
        The History: each epoch's ``model.get_metrics_result()`` (``loss``, the compiled
        metrics, each output's loss), over every step of the epoch on every worker.

    Raises:
        TrainingError: An option this loop does not support, a model that is not compiled,
            a ``train_step`` that cannot run on the workers, or data it cannot read.
    """
    refuse_unsupported(
        {"shuffle": shuffle, "y": data[1] if isinstance(data, (tuple, list)) else None, **options}
    )
    _check_compiled(model)
    make_dataset, steps, element_spec = _input(data, batch_size, steps_per_epoch, strategy, shuffle)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    optimizer = model.optimizer
    # A model built (or trained, or loaded) outside the scope: its variables move to the ps
    # tasks, as under the other strategies.
    adopt(model, strategy)
    with strategy.scope():
        # What the step would otherwise create in its first trace, on a worker: the model's,
        # the compiled loss's and metrics' and the optimizer's variables.
        internals.symbolic_build(model, element_spec)
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfscale_epoch")
    _check_optimizers_built(model)
    manager = None
    if checkpoint_dir:
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch_var)
        manager = tf.train.CheckpointManager(checkpoint, checkpoint_dir, max_to_keep=max_to_keep)
        if manager.latest_checkpoint:
            checkpoint.restore(manager.latest_checkpoint)
    iterator = iter(coordinator.create_per_worker_dataset(make_dataset))
    step = _step_function(model, strategy)
    history = keras.callbacks.History()
    callback_list = keras.callbacks.CallbackList(
        [*list(callbacks or []), history], model=model, epochs=epochs, steps=steps, verbose=0
    )
    callback_list.on_train_begin()
    for epoch in range(max(initial_epoch, int(epoch_var.numpy())), epochs):
        callback_list.on_epoch_begin(epoch)
        model.reset_metrics()
        _schedule(coordinator, step, iterator, model, steps)
        coordinator.join()
        logs = _logs(model)
        epoch_var.assign(epoch + 1)
        if manager is not None:
            manager.save(checkpoint_number=epoch + 1)
        if verbose:
            shown = " - ".join(f"{k}: {v:.6g}" for k, v in logs.items())
            print(f"Epoch {epoch + 1}/{epochs} - {steps} steps - {shown}")
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end()
    return history


def _logs(model: Any) -> dict[str, float]:
    """The epoch's logs: the model's metrics (on the ps tasks), as floats."""
    return {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items()}


def _check_compiled(model: Any) -> None:
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise TrainingError(
            explain(
                "tfscale.fit needs a compiled model (optimizer, and a loss unless the model "
                "computes its own).",
                received=f"model {getattr(model, 'name', model)!r} without an optimizer",
                fix="with strategy.scope():\n        model.compile(optimizer='adam', loss='mse')",
            )
        )


def _check_optimizers_built(model: Any) -> None:
    """Refuses optimizers held by the model that are not built: the step would build them
    on a worker, where variables cannot be created."""
    unbuilt = [
        name
        for name, value in vars(model).items()
        if isinstance(value, keras.optimizers.Optimizer)
        and value is not model.optimizer
        and not value.built
    ]
    if unbuilt:
        raise TrainingError(
            explain(
                f"{type(model).__name__}.train_step may use optimizers that are not built; "
                "under ParameterServerStrategy their variables cannot be created inside a "
                "step, which runs on a worker.",
                received=", ".join(f"self.{name} (not built)" for name in unbuilt),
                allowed="optimizers built before tfscale.fit, inside strategy.scope()",
                fix="with strategy.scope():\n        "
                + "\n        ".join(f"model.{n}.build(<its variables>)" for n in unbuilt),
            )
        )


def _input(
    data: Any,
    batch_size: int | None,
    steps_per_epoch: int | None,
    strategy: Any,
    shuffle: bool | str = True,
) -> tuple[Any, int, Any]:
    """What ``create_per_worker_dataset`` takes (a dataset function or a dataset), the number
    of steps in an epoch and one batch's spec (what the model's variables are built from
    before the first step)."""
    if isinstance(data, (tuple, list)) and len(data) in (2, 3):
        # x and y may be dicts or lists (several inputs or outputs), as in Keras's fit.
        arrays = internals.lists_to_tuples(tf.nest.map_structure(np.asarray, tuple(data)))
        count = len(tf.nest.flatten(arrays)[0])
        batch = batch_size or 32
        if count < batch:
            raise TrainingError(
                explain(
                    "There are fewer examples than one batch.",
                    received=count,
                    allowed=f">= batch_size ({batch})",
                    fix="lower batch_size.",
                )
            )

        def from_arrays() -> tf.data.Dataset:
            dataset = tf.data.Dataset.from_tensor_slices(arrays)
            # Unseeded: every worker shuffles its copy differently. Repeated forever: the
            # coordinator decides how many batches make an epoch (TF's PS guide).
            if shuffle:
                dataset = dataset.shuffle(count, seed=None, reshuffle_each_iteration=True)
            return dataset.repeat().batch(batch, drop_remainder=True).prefetch(2)

        spec = tf.nest.map_structure(
            lambda a: tf.TensorSpec((batch, *a.shape[1:]), tf.as_dtype(a.dtype)), arrays
        )
        return from_arrays, steps_per_epoch or count // batch, spec
    if isinstance(data, tf.data.Dataset):
        steps = steps_per_epoch or _finite_cardinality(data)
        # The dataset itself, which the coordinator rebuilds on each worker from its graph:
        # a function returning it would capture the chief's dataset, which a worker cannot
        # read ("Failed copying input tensor ... Unable to parse tensor proto").
        return data.repeat(), steps, data.element_spec
    if callable(data):
        if not steps_per_epoch:
            raise TrainingError(
                explain(
                    "A dataset_fn needs steps_per_epoch under ParameterServerStrategy.",
                    received="steps_per_epoch=None",
                    allowed="an int >= 1",
                    fix="pass steps_per_epoch and make dataset_fn repeat its data.",
                )
            )
        # The spec of one worker's batches; the chief only builds the pipeline, reads nothing.
        spec = data(tf.distribute.InputContext()).element_spec
        return (lambda: strategy.distribute_datasets_from_function(data)), steps_per_epoch, spec
    raise TrainingError(
        explain(
            "tfscale.fit cannot read this data under ParameterServerStrategy.",
            received=type(data).__name__,
            allowed="(x, y) arrays, a tf.data.Dataset or dataset_fn(input_context)",
        )
    )


def _finite_cardinality(dataset: tf.data.Dataset) -> int:
    count = int(dataset.cardinality().numpy())
    if count < 1:
        raise TrainingError(
            explain(
                "The dataset's length is unknown or infinite.",
                received=count,
                allowed="a finite dataset, or steps_per_epoch",
                fix="pass steps_per_epoch.",
            )
        )
    return count


def _step_function(model: Any, strategy: Any) -> Any:
    """The scheduled function: one batch through the model's own ``train_step``.

    Its outputs (the metrics' results at that step) are not returned: the epoch's logs are
    read from the metrics once all its steps are done.
    """

    def replica_step(data: Any) -> None:
        # Metrics and optimizer.iterations live on the ps and every worker updates them:
        # each update one atomic op, or concurrent steps lose some (internals).
        with internals.atomic_variable_updates():
            model.train_step(data)

    @tf.function
    def step(iterator: Any) -> None:
        strategy.run(replica_step, args=(next(iterator),))

    return step


def _schedule(coordinator: Any, step: Any, iterator: Any, model: Any, steps: int) -> None:
    """Schedules an epoch's steps; a train_step that cannot be traced for the workers is
    refused (the first schedule traces it, before any step runs)."""
    try:
        coordinator.schedule(step, args=(iterator,))
    except TrainingError:
        raise
    except Exception as error:  # the trace's error, whatever its type: re-raised explained
        owner = type(model).__name__
        overridden = [
            name
            for name in ("train_step", "compute_loss", "compute_metrics")
            if not internals.uses_default_step(model, name)
        ]
        raise TrainingError(
            explain(
                f"{owner}.train_step cannot run under ParameterServerStrategy: tracing it "
                "for the workers failed.",
                received=f"{type(error).__name__}: {str(error)[:600]}"
                + (f" (overridden: {', '.join(overridden)})" if overridden else ""),
                allowed="a train_step that creates no variables inside the step and uses "
                "only optimizers and metrics built before tfscale.fit",
                fix="create every variable (optimizers, metrics, layers) before tfscale.fit, "
                "inside strategy.scope(); or train with MultiWorkerMirroredStrategy "
                "(tfscale launch -n N without --ps)",
            )
        ) from error
    for _ in range(steps - 1):
        coordinator.schedule(step, args=(iterator,))
