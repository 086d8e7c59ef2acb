"""What ``tfscale.fit`` checks before any work: each problem knowable up front becomes a
``TrainingError`` saying what was received, what is allowed and how to fix it, instead of a
silent no-op, a raw TensorFlow error mid-epoch, or an error after the first epoch."""

from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np
import tensorflow as tf

from tfscale.errors import TrainingError, explain

__all__ = [
    "check_batch_size",
    "check_checkpoint_dir",
    "check_global_clipnorm",
    "check_inputs",
    "check_load_balancing",
    "check_pipeline_batches",
    "check_validation",
    "no_load_balancing_loss",
    "python_int",
]


def python_int(value: Any) -> Any:
    """A NumPy integer as a Python ``int`` (``model.fit`` takes both); any other value as it
    is, for the checks to judge."""
    if isinstance(value, np.integer):
        return int(value)
    return value


def check_global_clipnorm(global_clipnorm: Any, clipnorm: Any = None) -> float | None:
    """``global_clipnorm`` as a float (None: no clipping); the old name refused.

    tfscale clips the all-reduced gradient by its global norm, which Keras calls
    ``global_clipnorm``; Keras's ``clipnorm`` clips each variable's gradient on its own. The
    option was called ``clipnorm``: it is refused rather than given Keras's meaning, which
    would change what an existing call does without a word.

    Raises:
        TrainingError: ``clipnorm`` given, or ``global_clipnorm`` not a positive number.
    """
    if clipnorm is not None:
        raise TrainingError(
            explain(
                "clipnorm= is not a tfscale option: tfscale clips the all-reduced gradient by "
                "its global norm, which Keras calls global_clipnorm (Keras's clipnorm clips "
                "each variable's gradient on its own).",
                received=f"clipnorm={clipnorm!r}",
                allowed="global_clipnorm=<float > 0>, or clipnorm on the optimizer",
                fix=f"global_clipnorm={clipnorm!r} to clip by the global norm, or compile "
                f"with keras.optimizers.Adam(clipnorm={clipnorm!r}) to clip each variable "
                "(tfscale applies the optimizer's clipping to the all-reduced gradient)",
            )
        )
    if global_clipnorm is None:
        return None
    if (
        isinstance(global_clipnorm, (bool, np.bool_))
        or not isinstance(global_clipnorm, (int, float, np.integer, np.floating))
        or not global_clipnorm > 0
    ):
        raise TrainingError(
            explain(
                "global_clipnorm must be positive.",
                received=f"global_clipnorm={global_clipnorm!r}",
                allowed="a float > 0, or None for no clipping",
            )
        )
    return float(global_clipnorm)


def check_batch_size(name: str, value: object) -> None:
    """``batch_size`` / ``validation_batch_size``: None or a positive integer."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise TrainingError(
            explain(
                f"{name} must be a positive integer: the GLOBAL examples of one step.",
                received=f"{name}={value!r}",
                allowed="None (32 for arrays) or an int >= 1",
                fix=f"{name}=64",
            )
        )


def check_steps(name: str, value: object) -> None:
    """``steps_per_epoch`` / ``validation_steps``: None or a positive integer. Keras reads 0
    as None: ``steps_per_epoch=0`` trained a whole epoch."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise TrainingError(
            explain(
                f"{name} must be a positive integer (Keras would read {value!r} as None and "
                "run until the data ends).",
                received=f"{name}={value!r}",
                allowed="None (until the data ends) or an int >= 1",
                fix=f"{name}=None",
            )
        )


def check_validation_freq(value: object) -> None:
    """``validation_freq``: every N epochs (N >= 1), or the epochs (1-based) to validate
    after. Keras fails on 0 with a bare ``ZeroDivisionError`` after the first epoch."""
    epochs = list(value) if isinstance(value, (list, tuple, set, frozenset, range)) else [value]
    if not epochs or any(
        isinstance(e, bool) or not isinstance(e, (int, np.integer)) or e < 1 for e in epochs
    ):
        raise TrainingError(
            explain(
                "validation_freq says after which epochs to validate.",
                received=f"validation_freq={value!r}",
                allowed="an int N >= 1 (every N epochs) or a list of epochs, each >= 1 "
                "(counted from 1)",
                fix="validation_freq=1",
            )
        )


def _arrays(value: Any) -> list[np.ndarray]:
    return [a for a in tf.nest.flatten(value) if isinstance(a, (np.ndarray, tf.Tensor))]


def _length(value: Any) -> int | None:
    arrays = _arrays(value)
    if not arrays:
        return None
    shape = arrays[0].shape
    return None if not len(shape) or shape[0] is None else int(shape[0])


def _string_inputs(model: Any) -> bool:
    inputs = getattr(model, "inputs", None) or []
    return any(tf.as_dtype(getattr(i, "dtype", "float32")) == tf.string for i in inputs)


def check_inputs(
    model: Any, x: Any, y: Any, validation_split: float, validation_data: Any = None
) -> None:
    """Empty data, unbatched datasets, text in a numeric model, a validation split out of
    range.

    Raises:
        TrainingError: The first problem found.
    """
    if isinstance(validation_split, bool) or not 0.0 <= float(validation_split) < 1.0:
        raise TrainingError(
            explain(
                "validation_split is the fraction of the arrays kept for validation.",
                received=f"validation_split={validation_split!r}",
                allowed="a float in [0, 1)",
            )
        )
    if isinstance(x, tf.data.Dataset) and int(x.cardinality()) == 0:
        raise TrainingError(
            explain(
                "The dataset is empty: there is nothing to train on.",
                received="a tf.data.Dataset with cardinality 0",
                fix="check the dataset's source and any filter(), take() or shard() on it",
            )
        )
    if _length(x) == 0 or (x is not None and y is not None and _length(y) == 0):
        raise TrainingError(
            explain(
                "The arrays hold no examples: there is nothing to train on.",
                received=f"x with {_length(x)} examples",
                allowed="at least one example",
            )
        )
    check_batched(model, x=x, validation_data=validation_data)
    check_labels(model, y=y, validation_data=validation_data)
    texts = [a for a in _arrays(x) if np.asarray(a).dtype.kind in "USO"]
    if texts and not _string_inputs(model):
        raise TrainingError(
            explain(
                f"x holds text ({texts[0].dtype} array) but model {model.name!r} has no string "
                "input, so no layer can read it.",
                received=f"an array of dtype {texts[0].dtype}, shape {tuple(texts[0].shape)}",
                allowed="numbers, or text for a model whose input is keras.Input(dtype='string') "
                "(e.g. followed by keras.layers.TextVectorization)",
                fix="vectorize first: ids = keras.layers.TextVectorization(...)(texts), or put "
                "the TextVectorization layer inside the model",
            )
        )


def _sparse_classes(model: Any) -> tuple[int, Any] | None:
    """``(classes, ignore_class)`` when the model's one loss is a sparse categorical
    cross-entropy on its one output, whose width is known; None otherwise."""
    loss = getattr(model, "loss", None)
    name = loss if isinstance(loss, str) else getattr(loss, "name", getattr(loss, "__name__", ""))
    outputs = getattr(model, "outputs", None) or []
    if name != "sparse_categorical_crossentropy" or len(outputs) != 1:
        return None
    classes = outputs[0].shape[-1]
    return None if classes is None else (int(classes), getattr(loss, "ignore_class", None))


def check_labels(model: Any, **labels: Any) -> None:
    """Integer label arrays outside a sparse categorical model's classes (``y`` and
    ``validation_data``'s labels, by argument name).

    TensorFlow's CPU kernel stops at the first step with an error buried in a graph
    traceback; its GPU kernel does not check, and the loss is NaN or wrong.

    Raises:
        TrainingError: Labels below 0 or at least the number of classes.
    """
    found = _sparse_classes(model)
    if found is None:
        return
    classes, ignored = found
    for name, value in labels.items():
        if name == "validation_data":
            held = isinstance(value, (tuple, list)) and len(value) > 1
            value = value[1] if held else None
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu" or not value.size:
            continue
        kept = value[value != ignored] if ignored is not None else value
        if not kept.size or (kept.min() >= 0 and kept.max() < classes):
            continue
        outside = int(np.count_nonzero((kept < 0) | (kept >= classes)))
        raise TrainingError(
            explain(
                f"{name} holds labels outside the model's {classes} classes: a sparse "
                f"categorical cross-entropy needs each label in 0..{classes - 1} (on a GPU "
                "TensorFlow does not check, and the loss is NaN or wrong).",
                received=f"labels from {kept.min()} to {kept.max()} ({outside} of "
                f"{kept.size} outside 0..{classes - 1})",
                allowed=f"integers 0..{classes - 1}"
                + ("" if ignored is None else f", and ignore_class={ignored}"),
                fix=f"labels counted from 1: y - 1; {int(kept.max()) + 1} classes: a last "
                f"layer of {int(kept.max()) + 1} units; one-hot labels: "
                "loss='categorical_crossentropy'",
            )
        )


def check_batched(model: Any, **data: Any) -> None:
    """Datasets among ``data`` (by argument name) that yield single examples, not batches
    (``tfscale.fit``, and a prepared model's ``model.fit``).

    Raises:
        TrainingError: The first such dataset.
    """
    for name, value in data.items():
        if isinstance(value, tf.data.Dataset) and _unbatched(model, value):
            spec = tf.nest.map_structure(lambda s: tuple(s.shape), value.element_spec)
            raise TrainingError(
                explain(
                    f"The {name} dataset yields single examples, not batches: under a "
                    "strategy each batch is split over the replicas along its first "
                    "dimension, which these elements do not have (TensorFlow fails with a "
                    "bare IndexError; on one device the model gets examples of the wrong "
                    "rank).",
                    received=f"elements of shape {spec}",
                    allowed="a batched dataset: every element a batch of examples",
                    fix="batch it with the global batch size: dataset.batch(64)",
                )
            )


def _unbatched(model: Any, dataset: tf.data.Dataset) -> bool:
    """Whether a dataset's elements are single examples: a scalar component (a batch has a
    batch dimension), or the features of a one-input model one rank short of its input."""
    specs = [s for s in tf.nest.flatten(dataset.element_spec) if isinstance(s, tf.TensorSpec)]
    if any(s.shape.rank == 0 for s in specs):
        return True
    spec = dataset.element_spec
    features = tf.nest.flatten(spec[0] if isinstance(spec, tuple) else spec)
    inputs = getattr(model, "inputs", None) or []
    if len(inputs) != 1 or len(features) != 1 or not isinstance(features[0], tf.TensorSpec):
        return False
    rank = features[0].shape.rank
    return rank is not None and rank == len(inputs[0].shape) - 1


def _input_shapes(inputs: Any) -> list[tuple[Any, ...]] | None:
    """Shapes after the batch dimension of every input array (or dataset input)."""
    if isinstance(inputs, tf.data.Dataset):
        spec = inputs.element_spec
        first = spec[0] if isinstance(spec, tuple) else spec
        return [tuple(s.shape[1:]) for s in tf.nest.flatten(first)]
    arrays = _arrays(inputs)
    return [tuple(np.shape(a)[1:]) for a in arrays] if arrays else None


def check_validation(x: Any, validation_data: Any) -> None:
    """Validation inputs whose feature shapes differ from the training inputs' (which Keras
    would only find after the first epoch).

    Raises:
        TrainingError: The shapes differ.
    """
    if validation_data is None:
        return
    train = _input_shapes(x)
    held_inputs = validation_data
    if isinstance(validation_data, (tuple, list)) and validation_data:
        held_inputs = validation_data[0]  # (x_val, y_val[, sample_weight])
    held = _input_shapes(held_inputs)
    if train is None or held is None or len(train) != len(held):
        return
    for left, right in zip(train, held, strict=True):
        known = all(a is not None and b is not None for a, b in zip(left, right, strict=False))
        if len(left) != len(right) or (known and left != right):
            raise TrainingError(
                explain(
                    "validation_data's inputs do not have the training inputs' shape, so "
                    "validation would fail after the first epoch.",
                    received=f"training inputs of shape (batch, {', '.join(map(str, left))}), "
                    f"validation inputs of shape (batch, {', '.join(map(str, right))})",
                    allowed="the same shape after the batch dimension",
                    fix="pass validation_data=(x_val, y_val) preprocessed like x",
                )
            )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


def check_checkpoint_dir(directory: str) -> None:
    """Proves ``directory`` can hold checkpoints: creates it (and the folders above it) and
    a file in it, which is removed again.

    Permission bits do not prove a folder writable (root passes ``os.access`` on ``/proc``,
    a read-only mount, a full disk); the first save would only fail after the first epoch
    or ``every_steps`` updates, with TensorFlow's raw ``NotFoundError``. Writing through
    ``tf.io.gfile`` tries the file system the checkpoint will use (``gs://`` included).

    Raises:
        TrainingError: The folder cannot hold checkpoints (it names the folder).
    """
    remote = "://" in directory
    path = directory if remote else os.path.abspath(directory)
    if not remote:
        probe = path
        while not os.path.exists(probe):
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        if os.path.exists(probe) and not os.path.isdir(probe):
            raise TrainingError(
                explain(
                    f"checkpoint_dir {path} cannot be created: "
                    + ("it is a file." if probe == path else f"{probe} is a file."),
                    received=f"checkpoint_dir={directory!r}",
                    allowed="a folder (created if missing) under existing folders",
                    fix="choose another folder, e.g. checkpoint_dir='ckpt/'",
                )
            )
        if not os.access(probe, os.W_OK | os.X_OK):
            raise TrainingError(
                explain(
                    f"checkpoint_dir {path} cannot be written: {probe} is not writable by "
                    "this user.",
                    received=f"checkpoint_dir={directory!r}",
                    fix="choose a folder you can write, or fix its permissions",
                )
            )
    created = not tf.io.gfile.exists(path)
    test_file = f"{path.rstrip('/')}/.tfscale-write-test-{uuid.uuid4().hex}"
    try:
        tf.io.gfile.makedirs(path)
        with tf.io.gfile.GFile(test_file, "w") as handle:
            handle.write("tfscale checks that checkpoints can be written here\n")
        tf.io.gfile.remove(test_file)
    except (OSError, tf.errors.OpError) as error:
        raise TrainingError(
            explain(
                f"checkpoint_dir {path} cannot be "
                + ("created." if created and not tf.io.gfile.isdir(path) else "written."),
                received=f"checkpoint_dir={directory!r}: {_first_line(error)}",
                allowed="a folder this process can create and write files in",
                fix="choose a folder on a writable disk, e.g. checkpoint_dir='ckpt/'",
            )
        ) from None


def check_pipeline_batches(model: Any, x: Any, batch_size: int | None) -> None:
    """A pipelined model's micro-batches against the batches ``fit`` will give it.

    Raises:
        PartitionError: ``microbatches`` does not divide a batch (the last one included),
            where the batches are known before training.
    """
    check = getattr(model, "check_batches", None)
    if not callable(check):
        return
    if isinstance(x, tf.data.Dataset):
        first = tf.nest.flatten(x.element_spec)[0]
        static = first.shape[0] if first.shape.rank else None
        if static is not None:
            check(int(static))
        return
    examples = _length(x)
    if examples is not None:
        check(32 if batch_size is None else int(batch_size), examples)


def check_load_balancing(global_load_balancing: bool, jit_compile: bool) -> None:
    """``global_load_balancing=True`` against the step it will be trained in.

    Raises:
        TrainingError: The step is compiled with XLA (no gather can run in it).
    """
    if global_load_balancing and jit_compile:
        raise TrainingError(
            explain(
                "global_load_balancing=True gathers each mixture-of-experts layer's router "
                "logits over the replicas inside the step, and no collective can run inside "
                "the step tfscale compiles with XLA.",
                received="global_load_balancing=True with jit_compile=True",
                fix="train with jit_compile=False, or without global_load_balancing (each "
                "replica then balances its own share of the batch, as Keras's own fit does).",
            )
        )


def no_load_balancing_loss(model: Any) -> TrainingError:
    """The error for a train step traced with ``global_load_balancing=True`` in which no
    layer computed KerasHub's load-balancing loss: the option would change nothing."""
    return TrainingError(
        explain(
            "global_load_balancing=True computes the load-balancing loss of KerasHub's "
            "mixture-of-experts layers over the whole batch; no layer of this model "
            "computed one in its train step, so it would change nothing.",
            received=f"global_load_balancing=True for {type(model).__name__} "
            f"{getattr(model, 'name', '')!r}",
            allowed="a model with KerasHub's Mixtral, QwenMoe, Qwen3Moe or Qwen3.5-MoE "
            "layers (keras_hub.models.MixtralBackbone, ...)",
            fix="drop global_load_balancing; for a mixture-of-experts layer of your own, "
            "compute its load-balancing loss from tfscale.gather_batch(router_logits).",
        )
    )
