"""``tfscale.prepare_loop``: a custom ``GradientTape`` loop's update made one device's.

One added line after the model and its optimizer exist::

    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.Adam()
    tfscale.prepare_loop(model, optimizer)            # the one added line

    @tf.function
    def train(batch):
        return strategy.run(step, args=(batch,))      # step: tape, loss, apply_gradients

The loop stays the user's. ``prepare_loop`` puts the optimizer on the same distributed
update ``tfscale.fit`` uses (``optimizer.py``: example-weighted gradients, one all-reduce,
clipping after it, finiteness over all replicas, accumulation), and supplies what
``tfscale.fit``'s step function supplies there, the replica's weighting, from the loss the
loop differentiates (``conventions.py``)::

    replica r:  tape.gradient(loss, vars) --- watcher: classify(loss) -> Weighting(w, c)
                optimizer.apply_gradients  --- DistributedUpdate.apply(StepContext(w, c))
                   w * g, c --ONE all-reduce--> sum(w g) / sum(c) -> clip -> finite? apply

An optimizer not yet built is built by its first ``apply``, eagerly in the strategy's scope
(``DistributedUpdate._build_lazily``), instead of inside the replica step, where Keras's
lazy build fails under the collective all-reduce.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.interop import internals, registry
from tfscale.training import conventions, turns
from tfscale.training.adopt import adopt, keras_accumulation_steps
from tfscale.training.conventions import DECLARED, Declared, Weighting
from tfscale.training.optimizer import (
    DistributedUpdate,
    StepContext,
    distributed_update,
    step_in_progress,
)
from tfscale.training.options import Entry, Options, decide, resolve_strategy
from tfscale.training.shorthand import takes_options

__all__ = ["LoopState", "loop_state", "prepare_loop", "prepared_sources", "register_loop"]

_LOCAL = threading.local()
_LOOPS: list[weakref.ref[LoopState]] = []
_LOOPS_LOCK = threading.Lock()


def _pending() -> dict[int, Weighting | TrainingError]:
    found = getattr(_LOCAL, "pending", None)
    if found is None:
        found = _LOCAL.pending = {}
    return found


class LoopState:
    """One prepared custom loop: its model, optimizer update and declared loss convention.

    Attributes:
        model: The model whose trainable variables the loop differentiates.
        update: The optimizer's :class:`DistributedUpdate`.
        loss: The declared loss convention (``"auto"``: recognized from the loss).
    """

    def __init__(self, model: Any, update: DistributedUpdate, loss: Declared) -> None:
        self.model = model
        self.update = update
        self.loss = loss

    def owns(self, sources: Any) -> bool:
        """Whether ``tape.gradient``'s sources include the model's trainable variables."""
        wanted = {id(v) for v in self.model.trainable_variables}
        return any(id(v) in wanted for v in tf.nest.flatten(sources))

    def on_gradient(self, target: Any) -> None:
        """Classifies the loss of a ``tape.gradient`` in this replica (trace time)."""
        context = tf.distribute.get_replica_context()
        replicas = 1 if context is None else int(context.num_replicas_in_sync)
        steps = self.update.accumulation_steps
        terms = conventions.classify(target, self.loss)
        pending: Weighting | TrainingError
        if replicas == 1 and steps == 1 and any(t.kind is None for t in terms):
            # One replica and one batch per update: every convention is one device's.
            one = tf.constant(1.0)
            pending = Weighting(one, one, conventions.Kind.MEAN)
        else:
            try:
                pending = conventions.weighting(terms, replicas, steps)
            except TrainingError as error:
                # Raised by the optimizer's apply, not here: a gradient the loop does not
                # apply with this optimizer (an analysis, another model's update) is no error.
                pending = error
        _pending()[id(self.update)] = pending

    def step_for(self, update: DistributedUpdate, variables: list[Any]) -> StepContext:
        """The :class:`StepContext` of this replica's ``apply`` (consumes the weighting)."""
        weighting = _pending().pop(id(update), None)
        if isinstance(weighting, TrainingError):
            raise weighting
        if weighting is None:
            context = tf.distribute.get_replica_context()
            replicas = 1 if context is None else int(context.num_replicas_in_sync)
            if self.loss != "auto":
                terms = conventions.classify(None, self.loss)
                weighting = conventions.weighting(terms, replicas, update.accumulation_steps)
            elif replicas == 1 and update.accumulation_steps == 1:
                one = tf.constant(1.0)  # one device's update whatever the loss
                weighting = Weighting(one, one, conventions.Kind.MEAN)
            else:
                raise TrainingError(
                    explain(
                        "The optimizer prepared by tfscale.prepare_loop applied gradients that "
                        "tfscale did not see computed (no tape.gradient of the model's "
                        "variables in this replica step), so it cannot tell how they are "
                        "scaled over replicas.",
                        received=f"{type(update.optimizer).__name__}.apply for "
                        f"{len(variables)} variables",
                        fix="compute the gradients with tf.GradientTape().gradient(loss, "
                        "model.trainable_variables) in the function strategy.run runs, or "
                        'state the loss: tfscale.prepare_loop(model, optimizer, loss="mean")',
                    )
                )
        assert isinstance(weighting, Weighting)
        return StepContext(weighting.count, weight=weighting.weight)


def _live_loops() -> list[LoopState]:
    with _LOOPS_LOCK:
        alive = [(ref, ref()) for ref in _LOOPS]
        _LOOPS[:] = [ref for ref, state in alive if state is not None]
        return [state for _, state in alive if state is not None]


def _on_gradient(target: Any, sources: Any) -> None:
    """``tape.gradient`` anywhere: in a replica of a prepared loop, classify its loss."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return
    if step_in_progress():
        return  # tfscale's own step (fit, prepare): losses there are per-replica means
    classified = False
    for state in _live_loops():
        if state.owns(sources):
            state.on_gradient(target)
            classified = True
    if classified:
        conventions.forget_recorded(gradient_of=target)


def _build_outside_steps(model: Any, strategy: tf.distribute.Strategy) -> None:
    """Makes a model that builds on its first call build eagerly, in the scope.

    A model without an ``Input`` (the tutorial's ``Sequential``) creates its variables in
    the first replica step. Variables created inside a ``tf.function`` are initialized
    through a ``cond`` around the whole function (``fn_with_cond``), and with the
    collective all-reduce (MultiWorkerMirroredStrategy; MirroredStrategy on CPUs) its first
    step fails: "You must feed a value for placeholder tensor 'cond/.../Placeholder_1'".
    Building from cross-replica context (``merge_call``) under ``tf.init_scope`` creates
    them as ``model.build`` before the loop would have; Keras's initializers need no data.
    """
    build = model.build

    # functools.wraps keeps build's signature, from which Keras's __call__ picks the
    # shapes it passes (keras/src/layers/layer.py, update_shapes_dict_for_target_fn).
    @functools.wraps(build)
    @tf.autograph.experimental.do_not_convert
    def outside_steps(*args: Any, **kwargs: Any) -> Any:
        context = tf.distribute.get_replica_context()
        if context is None or tf.executing_eagerly() or not tf.distribute.has_strategy():
            return build(*args, **kwargs)

        def eager(_: tf.distribute.Strategy) -> None:
            with tf.init_scope(), strategy.scope():
                if not model.built:
                    build(*args, **kwargs)

        context.merge_call(eager)
        return None

    registry.replace("loop-model-build", model, "build", outside_steps)


def prepared_sources(sources: Any) -> bool:
    """Whether ``tape.gradient``'s sources are a model prepared by :func:`prepare_loop`."""
    return any(state.owns(sources) for state in _live_loops())


def loop_state(optimizer: Any) -> LoopState | None:
    """The :class:`LoopState` an optimizer was prepared with, or None."""
    state = optimizer.__dict__.get("_tfscale_loop")
    return state if isinstance(state, LoopState) else None


def _check(model: Any, optimizer: Any, loss: object) -> None:
    if not isinstance(model, keras.Model):
        raise TrainingError(
            explain(
                "tfscale.prepare_loop needs the Keras model the loop differentiates.",
                received=type(model).__name__,
                allowed="a keras.Model (built or not, compiled or not)",
                fix="tfscale.prepare_loop(model, optimizer)",
            )
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TrainingError(
            explain(
                "tfscale.prepare_loop needs the Keras optimizer the loop applies gradients with.",
                received=type(optimizer).__name__,
                allowed="a keras.optimizers.Optimizer (a LossScaleOptimizer included), or "
                "None for a compiled model's own",
                fix="tfscale.prepare_loop(model, optimizer)",
            )
        )
    if loss not in DECLARED:
        raise TrainingError(
            explain(
                "Unknown loss convention.",
                received=f"loss={loss!r}",
                allowed=", ".join(repr(d) for d in DECLARED),
                fix='leave loss="auto": tfscale recognizes the loss, or refuses it by name',
            )
        )
    steps = keras_accumulation_steps(optimizer)
    if steps:
        raise TrainingError(
            explain(
                "The optimizer has Keras's gradient_accumulation_steps set; under "
                "MirroredStrategy it fails with a merge_call RuntimeError.",
                received=f"gradient_accumulation_steps={steps}",
                fix="remove it and pass tfscale.prepare_loop(model, optimizer, "
                f"accumulation_steps={steps})",
            )
        )


@takes_options(Entry.PREPARE_LOOP)
def prepare_loop(
    model: Any,
    optimizer: Any = None,
    strategy: tf.distribute.Strategy | None = None,
    *,
    loss: Declared = "auto",
    options: Options,
) -> Any:
    """Makes a custom training loop's ``optimizer.apply_gradients`` one device's update.

    After it, each ``apply_gradients`` (or ``apply``) the loop makes inside
    ``strategy.run`` applies the gradient one device would compute with the same code on
    the whole global batch: the replicas' gradients weighed by how the loss was written
    (see ``loss``), all-reduced once, clipped after the all-reduce, and applied only if
    finite on every replica.

    Args:
        model: The Keras model whose ``trainable_variables`` the loop differentiates.
        optimizer: The optimizer the loop applies gradients with (None: ``model.optimizer``).
            Built here if the model is built, else on its first ``apply``, in the scope.
        strategy: The strategy the loop runs under; None takes the current scope's or the
            model's own.
        loss: How the loss the loop differentiates relates to one device's. ``"auto"``
            recognizes a per-example vector, a Keras ``Loss`` object's mean,
            ``tf.reduce_mean`` of per-example losses, ``tf.nn.compute_average_loss`` (with
            ``tf.nn.scale_regularization_loss``), and refuses anything else before the first
            update; ``"mean"``: a per-replica mean written as on one device; ``"global"``:
            already divided by the global batch; ``"sum"``: a sum over the replica's examples.

    Returns:
        The optimizer (the same object, prepared in place).

    Raises:
        TrainingError: An argument tfscale cannot use (the message says which and the fix).
    """
    optimizer = getattr(model, "optimizer", None) if optimizer is None else optimizer
    _check(model, optimizer, loss)
    accumulation_steps = options.accumulation_steps
    strategy = resolve_strategy(model, strategy)
    # The loop's optimizer too: created outside the scope and held by no compiled model, it
    # would be built for the default strategy ("Mixing different tf.distribute.Strategy
    # objects" at its first variable).
    adopt(model, strategy, [optimizer])
    if not model.built:
        _build_outside_steps(model, strategy)
    update = distributed_update(optimizer, strategy)
    if options.shard_optimizer_state:
        update.shard_state()  # before the build, which then creates shards, not whole slots
    if not optimizer.built and model.built and model.trainable_variables:
        with strategy.scope():
            optimizer.build(model.trainable_variables)
    update.accumulation_steps = accumulation_steps
    update.options = decide(options)
    if accumulation_steps > 1 and optimizer.built:
        update.build_accumulators(internals.optimizer_trainable_variables(optimizer))
    register_loop(model, update, loss)
    return optimizer


def register_loop(model: Any, update: DistributedUpdate, loss: Declared = "auto") -> LoopState:
    """Makes ``update`` weigh the gradients of a custom loop over ``model`` by its loss.

    Used by :func:`prepare_loop` and by ``tfscale.prepare`` (a prepared model's optimizer
    in a custom loop gets the same update); inside tfscale's own step functions the step's
    context wins.
    """
    state = LoopState(model, update, loss)
    update.loop_step = state.step_for
    registry.replace("model-state", update.optimizer, "_tfscale_loop", state)
    with _LOOPS_LOCK:
        # A second preparation of the same optimizer replaces the first's state.
        _LOOPS[:] = [ref for ref in _LOOPS if getattr(ref(), "update", update) is not update]
        _LOOPS.append(weakref.ref(state))
    # The watches on the tape and the loss reductions, the turns of the loop's input and
    # steps on the strategy's devices (turns.py) and each replica thread's own added losses
    # are held while this loop lives: once no prepared loop is left, TensorFlow's and Keras's
    # own functions are back in place.
    releases = [
        internals.watch_gradient_targets(_on_gradient),
        internals.watch_loss_reductions(conventions.on_reduction),
        turns.take_turns(),
        internals.losses_per_thread(),
    ]
    weakref.finalize(state, _release_all, releases)
    return state


def _release_all(releases: list[Callable[[], None]]) -> None:
    for release in releases:
        release()
