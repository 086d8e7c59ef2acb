"""Every attribute tfscale replaces in Keras, TensorFlow or a user's object, declared once.

Each replacement is an assumption about another project's code, so each is listed in
:data:`INTERCEPTIONS` with what it replaces, for how long, why, and the upstream issue behind
it, and made only through this module's functions (``tests/interop/test_registry.py`` fails
on code elsewhere that replaces an attribute of a foreign object). Three lifetimes:

- ``object``: one object only (a model's class, an optimizer's ``apply``), for as long as
  tfscale holds it: :func:`replace`, :func:`give_class`.
- ``trace``: one object while a step is traced, undone after: :func:`replace` /
  :func:`restore`.
- ``while-needed``: a function of a Keras or TensorFlow class or module, process-wide but
  only while something holds it (:func:`install` returns the release; the last release
  puts the original back). Each installed attribute is one dispatcher over the layers
  installed on it (in order), so two tfscale features wrapping the same function compose
  and leave in any order. The layers read a per-thread context (``contextvars``) rather
  than being swapped in and out around a call, so that two threads never see each
  other's setting.
- ``child``: in a process tfscale started to run a user's script (a launched worker, a
  profiled or doctored script), installed for that process's life by its documented
  contract, with :func:`install` as well.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "INTERCEPTIONS",
    "Interception",
    "give_class",
    "install",
    "installed",
    "replace",
    "restore",
]

Lifetime = Literal["object", "trace", "while-needed", "child"]


@dataclass(frozen=True)
class Interception:
    """One kind of attribute replacement tfscale makes.

    Attributes:
        key: How the code names it.
        target: The object or class whose attributes are replaced.
        attributes: The attribute names it may replace.
        lifetime: How long a replacement stays (see the module doc).
        why: What breaks without it.
        upstream: The upstream issue or source behind it, where there is one.
    """

    key: str
    target: str
    attributes: tuple[str, ...]
    lifetime: Lifetime
    why: str
    upstream: str = ""


INTERCEPTIONS: tuple[Interception, ...] = (
    Interception(
        "model-class",
        "a prepared keras.Model",
        ("__class__",),
        "object",
        "a subclass of the model's own class with tfscale's step functions, symbolic build, "
        "compute_loss and get_metrics_result above the model's methods and Keras's fit with "
        "tfscale's input handling below them (training/modelclass.py): KerasHub's task models "
        "run their preprocessor in their own fit",
    ),
    Interception(
        "model-state",
        "a prepared keras.Model or keras.optimizers.Optimizer",
        ("_tfscale", "_tfscale_update", "_tfscale_loop", "_tfscale_sharded"),
        "object",
        "tfscale's own state of the object (no Keras code reads it), in the instance so that "
        "it lives and dies with the object",
    ),
    Interception(
        "compiled-functions",
        "a keras.Model",
        ("train_function", "test_function", "predict_function"),
        "object",
        "Keras's contract: make_train_function stores the function it makes on the model, and "
        "fit calls model.train_function; a model moved over devices drops its old ones",
    ),
    Interception(
        "optimizer-apply",
        "a prepared keras.optimizers.Optimizer",
        ("apply", "scale_loss"),
        "object",
        "the distributed update (training/optimizer.py): one all-reduce of count-weighted "
        "gradients, clipping after it, accumulation, finiteness over all replicas; "
        "scale_loss (which Keras's train_step calls on every loss) gives a loss-scaled or "
        "float8 model's backward pass one device's magnitudes",
    ),
    Interception(
        "optimizer-all-reduce-off",
        "a prepared Keras TensorFlow optimizer",
        ("_all_reduce_sum_gradients",),
        "object",
        "Keras 3 sums gradients over replicas inside apply and has no switch to turn it off; "
        "tfscale has already reduced them",
        "keras-team/keras#19308",
    ),
    Interception(
        "multi-optimizer-build",
        "a keras.optimizers.MultiOptimizer (Keras 3.15)",
        ("build",),
        "object",
        "sub-optimizers chosen by a function as it builds must be built for the strategy "
        "('Mixing different tf.distribute.Strategy objects')",
    ),
    Interception(
        "sharded-optimizer",
        "an optimizer with shard_optimizer_state=True",
        ("build", "save_own_variables", "load_own_variables", "_trackable_children"),
        "object",
        "its slots are shards, one per replica (training/sharding.py): build makes the shards, "
        "and checkpoints and Keras weights files hold the whole slots under the unsharded "
        "optimizer's keys, so they restore on any replica count",
    ),
    Interception(
        "seed-generator",
        "a keras.random.SeedGenerator of a prepared model",
        ("next",),
        "object",
        "Keras hands every replica the same seed; folding the replica id in makes dropout "
        "masks independent per replica",
    ),
    Interception(
        "loop-model-build",
        "the unbuilt keras.Model of a prepared custom loop",
        ("build",),
        "object",
        "variables created inside the first replica step fail with the collective all-reduce "
        "(\"You must feed a value for placeholder tensor 'cond/.../Placeholder_1'\"); built "
        "from cross-replica context instead",
    ),
    Interception(
        "remat-call",
        "each weighted leaf layer of a model trained with remat=True",
        ("call",),
        "trace",
        "keras.RematScope fails in a tf.function on layers called with keyword arguments",
        "keras-team/keras#21207",
    ),
    Interception(
        "collective-setup",
        "TensorFlow's eager context (uninitialized)",
        ("_collective_ops_server_def", "_coordination_service_config"),
        "object",
        "when MultiWorkerMirroredStrategy cannot start its gRPC server the context keeps both "
        "and every later op retries that server, so no fallback strategy could run",
    ),
    Interception(
        "collective-initial-values",
        "a MultiWorkerMirroredStrategy's extended object (several workers)",
        ("_get_variable_creator_initial_value",),
        "object",
        "its workers broadcast each new variable's initial value with a collective that "
        "carries bool, float16/32/64 and int32/64 only: a bfloat16 or int8 (QLoRA) model "
        "could not be created; such values travel cast to a dtype that holds them exactly",
    ),
    Interception(
        "all-reduce-switch",
        "keras.src.backend.tensorflow.optimizer.TFOptimizer",
        ("_all_reduce_sum_gradients",),
        "while-needed",
        "an optimizer tfscale did not prepare, applied inside tfscale's step (a GAN's second "
        "optimizer), gets tfscale's all-reduce in the thread tracing that step only",
        "keras-team/keras#19308",
    ),
    Interception(
        "loss-scaling-switch",
        "keras.src.losses.loss",
        (
            "scale_loss_for_distribution",
            "unscale_loss_for_distribution",
            "reduce_values",
            "reduce_weighted_values",
        ),
        "while-needed",
        "Keras divides losses by the replica count, which an uneven batch split weighs "
        "wrongly; tfscale weighs by example counts, so losses are per-replica means in the "
        "thread tracing tfscale's step (a sum, a sample-weighted or a masked mean made one: "
        "times the batch's examples, weights or unmasked entries over the replica's)",
        "tensorflow/tensorflow#42446",
    ),
    Interception(
        "load-balancing",
        "keras_hub.src.models.*_decoder modules (Mixtral, QwenMoe, Qwen3Moe, Qwen3.5-MoE)",
        ("compute_load_balancing_loss",),
        "while-needed",
        "a mixture-of-experts layer's load-balancing loss is a product of two means over the "
        "batch's tokens: with global_load_balancing=True it reads every replica's router "
        "logits in the thread tracing tfscale's step, so that it is the whole batch's, as on "
        "one device (each replica's own share otherwise, as under Keras's own fit)",
    ),
    Interception(
        "replica-losses",
        "keras.src.layers.layer.Layer",
        ("add_loss", "_get_own_losses", "_clear_losses"),
        "while-needed",
        "a layer's added losses are one list that MirroredStrategy's replica threads share; "
        "where a merge_call sits in the forward pass (a synchronized BatchNormalization, "
        "global_load_balancing) a replica cleared another's losses (a wrong gradient) or "
        "read them too (a wrong reported loss): each replica's own list in the thread "
        "tracing tfscale's step",
    ),
    Interception(
        "atomic-updates",
        "keras.Variable (TensorFlow backend)",
        ("assign_add", "assign_sub"),
        "while-needed",
        "Keras's assign_add is a read then a write: concurrent updates on a parameter server "
        "were lost (144 of 256 examples counted); the backing variable's own op in the thread "
        "tracing tfscale's parameter-server step",
    ),
    Interception(
        "gradient-watch",
        "tf.GradientTape",
        ("gradient",),
        "while-needed",
        "a prepared custom loop computes its loss in the user's code: the tape's target is "
        "where tfscale sees how the loss was reduced (training/conventions.py); TensorFlow "
        "has no public hook; held while a prepared loop lives",
    ),
    Interception(
        "reduction-watch",
        "keras.src.losses.loss and tf.nn",
        ("scale_loss_for_distribution", "compute_average_loss", "scale_regularization_loss"),
        "while-needed",
        "which reduction produced a custom loop's loss decides its replica weighting; held "
        "while a prepared loop lives",
    ),
    Interception(
        "device-turns",
        "tf.distribute's distributed datasets and iterators (input_lib), tf.function's Function",
        ("__iter__", "get_next", "get_next_as_optional", "__call__"),
        "while-needed",
        "TensorFlow cannot read two distributed inputs over the same devices at once (two "
        "threads got each other's batches or hung in MultiDeviceIterator get_next, "
        "TensorFlow alone): making and reading one, and each call of a tf.function whose "
        "trace reads one, take the strategy's turn (training/turns.py); held while a "
        "prepared loop lives",
    ),
    Interception(
        "script-watch",
        "tf.distribute.Strategy, keras.Model, keras.optimizers.Optimizer, "
        "tf.distribute.MirroredStrategy, tfscale, tf.function's Function",
        ("__init__", "run", "fit", "apply", "__call__"),
        "child",
        "the child running a user's script under doctor --script, tfscale profile or a "
        "launched worker watches the strategies it builds and runs, its fits (profile adds "
        "its callback, a strict worker stops a fit under no strategy), whether it updated "
        "(a worker that trained nothing fails), its step functions (profiled custom loops), "
        "and with one replica places every MirroredStrategy on one device",
    ),
)

_DECLARED = {interception.key: interception for interception in INTERCEPTIONS}
_LOCK = threading.RLock()


def _declared(key: str, attribute: str, lifetimes: tuple[Lifetime, ...]) -> None:
    interception = _DECLARED.get(key)
    if interception is None or attribute not in interception.attributes:
        raise AssertionError(f"undeclared interception {key!r} of {attribute!r}: declare it")
    if interception.lifetime not in lifetimes:
        raise AssertionError(f"{key!r} is declared {interception.lifetime!r}, not {lifetimes}")


def replace(key: str, obj: Any, attribute: str, value: Any) -> None:
    """Sets ``attribute`` on one object only (its ``__dict__``), bypassing Keras's tracking
    ``__setattr__``, which would wrap a function or list it as a dependency to save."""
    _declared(key, attribute, ("object", "trace"))
    obj.__dict__[attribute] = value


def restore(key: str, obj: Any, attribute: str) -> None:
    """Undoes :func:`replace`: the object's class attribute shows through again."""
    _declared(key, attribute, ("object", "trace"))
    obj.__dict__.pop(attribute, None)


def give_class(key: str, obj: Any, cls: type) -> None:
    """Makes ``obj`` an object of ``cls``, a subclass made of its own class."""
    _declared(key, "__class__", ("object",))
    if type(obj) not in cls.__mro__:  # a subclass of the object's own class only
        raise AssertionError(f"{cls!r} is not made of {type(obj)!r}")
    object.__setattr__(obj, "__class__", cls)


Layer = Callable[[Callable[..., Any]], Callable[..., Any]]


class _Installed:
    """One replaced attribute: the original, the layers over it, the dispatcher in its place."""

    def __init__(self, owner: Any, attribute: str) -> None:
        self.owner = owner
        self.attribute = attribute
        # An inherited method is wrapped on the owner and deleted there afterwards, so that
        # the owner inherits again (Keras's TensorFlow Variable inherits assign_add).
        self.own = attribute in vars(owner)
        self.original = getattr(owner, attribute) if not self.own else vars(owner)[attribute]
        self.holds: list[tuple[object, Layer]] = []  # (token, layer) per install
        self.order: list[Layer] = []  # each held layer once, in the order first installed
        self.composed: Callable[..., Any] = self.original

    def hold(self, token: object, layer: Layer) -> None:
        self.holds.append((token, layer))
        if not any(layer is other for other in self.order):
            self.order.append(layer)
        self.compose()

    def drop(self, token: object) -> bool:
        """Releases one hold; whether it was held."""
        dropped = [hold for hold in self.holds if hold[0] is token]
        if not dropped:
            return False
        self.holds = [hold for hold in self.holds if hold[0] is not token]
        layer = dropped[0][1]
        if not any(held is layer for _, held in self.holds):
            self.order = [other for other in self.order if other is not layer]
        self.compose()
        return True

    def compose(self) -> None:
        function = self.original
        for layer in self.order:
            function = layer(function)
        self.composed = function


_INSTALLED: dict[tuple[int, str], _Installed] = {}


def _dispatcher(installed: _Installed) -> Callable[..., Any]:
    def dispatcher(*args: Any, **kwargs: Any) -> Any:
        return installed.composed(*args, **kwargs)

    functools.update_wrapper(dispatcher, installed.original)
    dispatcher.tfscale_installed = installed  # type: ignore[attr-defined]
    try:  # tfscale's Python runs at trace time: AutoGraph must not convert it
        import tensorflow as tf

        return tf.autograph.experimental.do_not_convert(dispatcher)  # type: ignore[no-any-return]
    except ImportError:  # pragma: no cover - every while-needed owner is TensorFlow's or Keras's
        return dispatcher


def install(key: str, owner: Any, attribute: str, layer: Layer) -> Callable[[], None]:
    """Wraps ``owner.attribute`` with ``layer`` (``layer(next_function) -> function``) until
    the returned release is called; the last release puts the original back.

    The same ``layer`` object installed twice on one attribute is held twice and composed
    once. Layers compose in the order they were first installed.
    """
    _declared(key, attribute, ("while-needed", "child"))
    token = object()
    with _LOCK:
        slot = (id(owner), attribute)
        installed = _INSTALLED.get(slot)
        if installed is None:
            installed = _Installed(owner, attribute)
            _INSTALLED[slot] = installed
            setattr(owner, attribute, _dispatcher(installed))
        installed.hold(token, layer)

    def release() -> None:
        with _LOCK:
            if not installed.drop(token):
                return
            if not installed.holds:
                if installed.own:
                    setattr(owner, attribute, installed.original)
                else:
                    delattr(owner, attribute)
                del _INSTALLED[slot]

    return release


def installed() -> list[tuple[Any, str, int]]:
    """What is installed now: ``(owner, attribute, layers)`` for each replaced attribute."""
    with _LOCK:
        return [(i.owner, i.attribute, len(i.holds)) for i in _INSTALLED.values()]
