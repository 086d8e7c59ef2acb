"""Loss conventions of custom training loops: how a replica's loss relates to one device's.

In a custom loop the user's code computes the loss each replica differentiates, and the
ways it is written differ by a factor that depends on the replica count. With N replicas
and B examples in the global batch (``c_r`` of them on replica r), what one device
computes with the same code on the whole batch is a weighted sum ``sum_r beta_r * g_r`` of
the replicas' gradients ``g_r``:

=====================================  =================  ===============  ==============
the loss a replica differentiates      kind               beta_r           weight, count
=====================================  =================  ===============  ==============
``tf.reduce_mean(per_example)``        ``MEAN``           ``c_r / B``      ``c_r g``, c_r
Keras ``Loss`` object (mean; Keras     ``SCALED_MEAN``    ``N c_r / B``    ``N c_r g``, c_r
divides it by N itself)                                                    (eager: ``N g``,
                                                                           1: no count)
``tf.nn.compute_average_loss(v)``      ``SCALED_MEAN``    ``N c_r / B``    ``N c_r g``, c_r
``compute_average_loss(v, global_``    ``GLOBAL``         ``1``            ``g``, 1/N
``batch_size=G)``,
``tf.nn.scale_regularization_loss``
a per-example vector, a                ``SUM``            ``1``            ``g``, 1/(N k)
``reduce_sum`` of one
=====================================  =================  ===============  ==============

The distributed update all-reduces ``weight * g`` and the count and divides (``optimizer.py``),
so every row gives one device's update, uneven splits and accumulation over k batches
included (a ``SUM`` is one device's sum over all k batches' examples; the other kinds are
means, averaged over the k batches by their examples).

tfscale does not guess which kind a loss is. It sees the loss: every call of
``tape.gradient`` in a replica of a loop prepared by :func:`tfscale.prepare_loop` hands
its target here (``internals.watch_gradient_targets``), and the loss reductions that
divide by the replica count (Keras's ``scale_loss_for_distribution``,
``tf.nn.compute_average_loss``, ``tf.nn.scale_regularization_loss``) record their outputs
(``internals.watch_loss_reductions``). The target is split into its added terms (through
``Identity``, ``Cast`` and ``AddV2``/``AddN``); each term must be one of the rows above,
known by what produced it, and all terms must agree. Anything else, a sum divided by a
constant by hand, a Keras mean plus unscaled ``model.losses``, a scalar of an eager step,
is a loss tfscale cannot tell, and the loop is refused before its first update
(:class:`~tfscale.errors.TrainingError` naming the terms and the fix, ``loss=``),
because a wrong guess would silently scale the update by N or 1/N.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import tensorflow as tf

from tfscale.errors import TrainingError, explain

__all__ = [
    "DECLARED",
    "Declared",
    "Kind",
    "Term",
    "Weighting",
    "classify",
    "computed_from",
    "forget_recorded",
    "on_reduction",
    "record_reduction",
    "record_scaled",
    "recorded",
    "sums_over_examples",
    "weighting",
]

Declared = Literal["auto", "mean", "global", "sum"]
DECLARED: tuple[str, ...] = ("auto", "mean", "global", "sum")


class Kind(enum.Enum):
    """How a loss term relates to one device's (see the module docstring)."""

    MEAN = "a per-replica mean (tf.reduce_mean of per-example losses, as on one device)"
    SCALED_MEAN = "a mean divided by the replica count (a Keras Loss object, compute_average_loss)"
    GLOBAL = "a loss divided by the global batch (compute_average_loss with global_batch_size)"
    SUM = "a per-example vector or a sum over examples"


@dataclass(frozen=True)
class Term:
    """One added term of a loss, as tfscale recognized it.

    Attributes:
        kind: Its :class:`Kind`, or None where tfscale cannot tell.
        count: Examples the term averages (MEAN, SCALED_MEAN), as float32, if known.
        what: What produced it, for error messages.
    """

    kind: Kind | None
    count: tf.Tensor | None
    what: str


@dataclass(frozen=True)
class Weighting:
    """What the distributed update multiplies a replica's gradient by, and the example
    count it adds to the total the reduced gradient is divided by.

    Attributes:
        weight: The gradient's multiplier (float32 scalar).
        count: This replica's share of the total (float32 scalar).
        kind: The loss's kind.
    """

    weight: tf.Tensor
    count: tf.Tensor
    kind: Kind


_LOCAL = threading.local()


def _recorded() -> dict[Any, Any]:
    found = getattr(_LOCAL, "reductions", None)
    if found is None:
        found = _LOCAL.reductions = {}
    return found


def _in_replica() -> bool:
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def record_reduction(output: Any, term: Term) -> None:
    """Remembers, in this replica's thread, that ``output`` is a loss of ``term``'s kind."""
    if not _in_replica():
        return
    _remember(output, term)


# Reductions recorded per thread and not yet consumed by a gradient: a bound, because an
# eager loop that computes losses under strategy.run without differentiating them (an
# evaluation step on MultiWorkerMirrored's main thread) would otherwise keep every tensor.
_KEPT = 256


def _remember(output: Any, value: Any) -> None:
    try:
        key = output.ref()
    except (AttributeError, TypeError):
        return
    found = _recorded()
    found[key] = value
    while len(found) > _KEPT:
        del found[next(iter(found))]


def recorded(output: Any) -> Any:
    """The term recorded for ``output`` (or the loss it scales), if any."""
    try:
        return _recorded().get(output.ref())
    except (AttributeError, TypeError):
        return None


def record_scaled(output: Any, loss: Any) -> None:
    """Remembers that ``output`` is ``loss`` times a loss scale (``LossScaleOptimizer``'s
    ``scale_loss``, which unscales the gradients itself), or ``loss`` passed on (a prepared
    model's ``compute_loss``, 0 on a replica without examples): its kind is ``loss``'s."""
    if not _in_replica():
        return
    _remember(output, loss)


def _graph_of(tensor: Any) -> Any:
    try:
        return tensor.graph
    except AttributeError:  # an EagerTensor (a loop run eagerly under strategy.run)
        return None


def forget_recorded(gradient_of: Any = None) -> None:
    """Drops this thread's recorded reductions after a gradient has consumed them.

    Given the differentiated loss, keeps those of its graph: a step can compute several
    losses before it differentiates any (a GAN's two tapes: the generator's gradient comes
    before the discriminator's, whose loss was recorded with it), and each is consumed by
    its own gradient. The rest (earlier traces' tensors) are dropped, as everything is
    without it.
    """
    if gradient_of is None:
        _LOCAL.reductions = {}
        return
    graph = _graph_of(gradient_of)
    found = _recorded()
    for key in [k for k in found if _graph_of(k.deref()) is not graph]:
        del found[key]


_PASS_THROUGH = {"Identity", "Cast"}
_ADD = {"AddV2", "Add", "AddN"}


def _size(tensor: tf.Tensor) -> tf.Tensor:
    return tf.cast(tf.size(tensor), tf.float32)


def _terms(target: Any, depth: int = 0) -> list[Term]:
    """The added terms of a scalar graph tensor, each recognized or not."""
    known = recorded(target)
    if isinstance(known, Term):
        return [known]
    if known is not None:  # a loss-scaled loss: the kind of the loss before scaling
        return _terms(known, depth + 1)
    op = getattr(target, "op", None)
    if op is None or depth > 64:
        return [Term(None, None, "a scalar computed eagerly (outside tf.function)")]
    if op.type in _PASS_THROUGH:
        return _terms(op.inputs[0], depth + 1)
    if op.type in _ADD:
        return [term for value in op.inputs for term in _terms(value, depth + 1)]
    if op.type == "Mean" and target.shape.rank == 0:
        return [Term(Kind.MEAN, _size(op.inputs[0]), "tf.reduce_mean")]
    if op.type == "Sum" and target.shape.rank == 0:
        return [Term(Kind.SUM, None, "tf.reduce_sum")]
    return [Term(None, None, f"the output of a {op.type} op ({op.name})")]


def classify(target: Any, declared: Declared = "auto") -> list[Term]:
    """The terms of the loss ``target`` of ``tape.gradient`` (see the module docstring).

    ``declared`` other than ``"auto"`` states the kind of the whole loss.
    """
    if declared == "mean":
        return [Term(Kind.MEAN, None, 'loss="mean"')]
    if declared == "global":
        return [Term(Kind.GLOBAL, None, 'loss="global"')]
    if declared == "sum":
        return [Term(Kind.SUM, None, 'loss="sum"')]
    targets = tf.nest.flatten(target)
    terms: list[Term] = []
    for each in targets:
        shape = getattr(each, "shape", None)
        if shape is not None and shape.rank is not None and shape.rank > 0:
            terms.append(Term(Kind.SUM, None, "a per-example loss vector"))
        else:
            terms.extend(_terms(each))
    return terms


def _refuse(terms: Sequence[Term], problem: str) -> TrainingError:
    shown = "; ".join(f"{t.what}: {t.kind.value if t.kind else 'not recognized'}" for t in terms)
    return TrainingError(
        explain(
            problem,
            received=shown,
            allowed="one kind for the whole loss: a per-example vector; a Keras Loss object "
            "(its mean); tf.reduce_mean of per-example losses; tf.nn.compute_average_loss "
            "(+ tf.nn.scale_regularization_loss)",
            fix="return the per-example losses to tape.gradient, or compute the loss with "
            "one of those; or state what the loss is: tfscale.prepare_loop(..., "
            'loss="mean") for a per-replica mean written as on one device (model.losses '
            'added as they are), loss="global" for a loss already divided by the global '
            'batch (by hand: tf.reduce_sum(per_example) / GLOBAL_BATCH_SIZE), loss="sum" '
            "for a sum over the replica's examples.",
        )
    )


def weighting(terms: Sequence[Term], replicas: int, accumulation_steps: int) -> Weighting:
    """One replica's :class:`Weighting` for a loss made of ``terms``.

    Raises:
        TrainingError: A term tfscale cannot tell, or terms of kinds that disagree.
    """
    unknown = [t for t in terms if t.kind is None]
    if unknown:
        raise _refuse(
            terms,
            "tfscale cannot tell how this custom loop's loss is scaled over replicas, so it "
            "cannot make the update one device's (a wrong guess changes it N-fold).",
        )
    kinds = {t.kind for t in terms}
    if kinds <= {Kind.SCALED_MEAN, Kind.GLOBAL} and Kind.GLOBAL in kinds:
        # Both are ready to be summed over replicas: the tutorial's compute_average_loss
        # plus scale_regularization_loss (for an even split; one device's exactly).
        kinds = {Kind.GLOBAL}
    if len(kinds) != 1:
        raise _refuse(
            terms,
            "The terms of this custom loop's loss are scaled differently over replicas "
            "(one device's loss adds them as they are), so no single weighting makes the "
            "update one device's.",
        )
    kind = kinds.pop()
    assert kind is not None  # unknown terms were refused above
    n = float(replicas)
    counts = [t.count for t in terms if t.count is not None]
    count = counts[0] if counts else None
    one = tf.constant(1.0)
    if kind is Kind.MEAN:
        if count is None:
            return Weighting(one, one, kind)  # equal weights: exact for an even split
        return Weighting(count, count, kind)
    if kind is Kind.SCALED_MEAN:
        if count is None:
            return Weighting(tf.constant(n), one, kind)
        return Weighting(count * n, count, kind)
    if kind is Kind.GLOBAL:
        return Weighting(one, tf.constant(1.0 / n), kind)
    return Weighting(one, tf.constant(1.0 / (n * accumulation_steps)), kind)


def _argument(args: Any, kwargs: dict[str, Any], index: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def on_reduction(name: str, output: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """Records a loss reduction's output with its kind (``internals.watch_loss_reductions``)."""
    if not _in_replica():
        return
    if name == "keras_scale":
        # Keras's reduce_values divides the sum by the examples (divide_no_nan(sum, count))
        # and hands the mean to scale_loss_for_distribution: in a graph the count is that
        # op's divisor, which weighs an uneven split as one device's mean does.
        mean = _argument(args, kwargs, 0, "value")
        op = getattr(mean, "op", None)
        count = None
        if op is not None and op.type == "DivNoNan" and len(op.inputs) == 2:
            count = tf.cast(op.inputs[1], tf.float32)
        # Returned as it came (one replica, or replica_count_scaling_off in this thread):
        # a plain mean.
        kind = Kind.MEAN if output is mean else Kind.SCALED_MEAN
        record_reduction(output, Term(kind, count, "a Keras Loss object's mean"))
    elif name == "scale_regularization_loss":
        record_reduction(output, Term(Kind.GLOBAL, None, "tf.nn.scale_regularization_loss"))
    elif name == "compute_average_loss":
        if _argument(args, kwargs, 2, "global_batch_size") is not None:
            term = Term(Kind.GLOBAL, None, "tf.nn.compute_average_loss(global_batch_size=...)")
        else:
            per_example = tf.convert_to_tensor(_argument(args, kwargs, 0, "per_example_loss"))
            count = tf.cast(tf.shape(per_example)[0], tf.float32)
            term = Term(Kind.SCALED_MEAN, count, "tf.nn.compute_average_loss")
        record_reduction(output, term)


# -- Model.fit: the sums over the examples in compute_loss's loss ------------------------------
# Divisions a sum passes through when the divisor is a constant; how deep the walk goes.
_SCALE_DIVIDE = {"RealDiv", "DivNoNan", "Div", "TrueDiv"}
_WALK_LIMIT = 64
# Ops an input walk visits at most when it checks that a summed tensor comes from the data.
_ANCESTRY_LIMIT = 20_000


def sums_over_examples(loss: Any, data: Any) -> list[tuple[Any, float]]:
    """The terms of ``loss`` that sum over the replica's examples, each with the constant
    the loss multiplies it by.

    ``loss`` is the scalar ``compute_loss`` (the model's own or Keras's) returned in a replica
    of tfscale's step, where losses are weighed as per-replica means; ``data`` is the step's
    ``(x, y, sample_weight)``. keras-io's masked language model returns
    ``keras.ops.sum(loss_fn(y, y_pred, sample_weight))`` (a ``Loss`` with
    ``reduction=None``): one device's gradient is the batch's sum, and weighed as a mean
    each replica's sum gave one device's update divided by N. Recognized, as in a custom
    loop (``classify``): a ``Sum`` to a scalar of a tensor whose leading dimension is the
    batch's and which is computed from the data, through ``Identity``, ``Cast``, additions,
    subtractions, negation and a sum of a list of losses (``keras.ops.sum([...])``: ``Sum``
    of ``Pack``) term by term, and through multiplication or division by a constant where
    the batch's size is unknown while tracing (the usual case). Where it is known, a
    constant may be that size (``keras.ops.shape(y)[0]`` is a Python number then: a mean
    written by hand), so a scaled sum is left as it was. Anything else (a
    ``tf.reduce_mean``, a Keras ``Loss`` object's result, a sum divided by a count the step
    computes) is a mean, as before. Keras's own ``compute_loss`` sums each ``add_loss`` value
    (``_aggregate_additional_loss``): a layer's ``add_loss`` of per-example losses (keras-io's
    captcha OCR ``CTCLayer``) is such a sum, and is found the same way.
    """
    if getattr(loss, "op", None) is None or loss.shape.rank != 0:
        return []  # eager, or not a scalar
    flat = [t for t in tf.nest.flatten(data) if getattr(t, "op", None) is not None]
    if not flat:
        return []
    found: list[tuple[Any, float]] = []
    _collect_sums(loss, 1.0, flat, found, 0, scaled=_batch_size(flat) is None)
    return found


def _batch_size(data: list[Any]) -> int | None:
    """The replica's batch size where it is known while tracing (the data's leading
    dimension), else None."""
    shape = data[0].shape
    return None if not shape.rank else shape[0]


def _constant(tensor: Any) -> float | None:
    value = tf.get_static_value(tensor)
    if value is None or getattr(value, "size", 1) != 1:
        return None
    return float(value.reshape(()) if hasattr(value, "reshape") else value)


def _collect_sums(
    tensor: Any,
    factor: float,
    data: list[Any],
    found: list[tuple[Any, float]],
    depth: int,
    *,
    scaled: bool,
) -> None:
    """Appends the sums over the examples ``tensor`` adds up to ``found`` (see
    ``sums_over_examples``); ``scaled``: through constant factors too."""
    op = getattr(tensor, "op", None)
    if op is None or depth > _WALK_LIMIT:
        return
    kind, inputs = op.type, list(op.inputs)

    def walk(value: Any, by: float) -> None:
        _collect_sums(value, by, data, found, depth + 1, scaled=scaled)

    if kind in _PASS_THROUGH:
        walk(inputs[0], factor)
    elif kind in _ADD:
        for value in inputs:
            walk(value, factor)
    elif kind == "Sub":
        walk(inputs[0], factor)
        walk(inputs[1], -factor)
    elif kind == "Neg":
        walk(inputs[0], -factor)
    elif kind == "Mul" and scaled:
        for value, other in ((inputs[0], inputs[1]), (inputs[1], inputs[0])):
            constant = _constant(other)
            if constant is not None:
                walk(value, factor * constant)
                break
    elif kind in _SCALE_DIVIDE and scaled:
        constant = _constant(inputs[1])
        if constant:
            walk(inputs[0], factor / constant)
    elif kind == "Sum" and tensor.shape.rank == 0:
        summed = inputs[0]
        if summed.shape.rank == 0:  # Keras sums each add_loss value, a scalar one too
            walk(summed, factor)
        elif summed.op.type == "Pack":  # keras.ops.sum of a list: each element a term
            for value in summed.op.inputs:
                if value.shape.rank == 0:
                    walk(value, factor)
                elif _over_examples(value, data):
                    found.append((tf.reduce_sum(value), factor))
        elif _over_examples(summed, data):
            found.append((tensor, factor))


def _over_examples(summed: Any, data: list[Any]) -> bool:
    """Whether ``summed`` holds one value (or more) per example of the replica's batch: its
    leading dimension is the data's, and it is computed from the data."""
    shape = summed.shape
    if shape.rank is None or shape.rank == 0:
        return False
    batch = _batch_size(data)
    if shape[0] != batch:
        return False
    if batch is None:
        return True  # a dimension unknown while tracing: the batch's
    return _computed_from(summed, data)


def _computed_from(tensor: Any, data: list[Any]) -> bool:
    wanted = {id(t.op) for t in data}
    return computed_from(tensor, lambda op: id(op) in wanted)


def computed_from(tensor: Any, source: Callable[[Any], bool]) -> bool:
    """Whether an op ``source`` picks is among the ops ``tensor`` is computed from (itself
    included), searched through at most ``_ANCESTRY_LIMIT`` ops."""
    seen: set[int] = set()
    stack = [tensor.op]
    while stack and len(seen) < _ANCESTRY_LIMIT:
        op = stack.pop()
        if source(op):
            return True
        if id(op) in seen:
            continue
        seen.add(id(op))
        stack.extend(value.op for value in op.inputs)
    return False
