"""The class of a prepared model: the model's own class, with tfscale's methods on both sides.

``prepare`` gives the model object (the same object: the user keeps their reference) a class
made once per model class, as Horovod's ``DistributedOptimizer`` subclasses the user's
optimizer class instead of patching it. Its method resolution order::

    Prepared<GPT2CausalLM>   (this module's ``Around``)
      make_train_function, make_test_function, _maybe_symbolic_build, compute_loss,
      get_metrics_result: tfscale's, around the model's own
    GPT2CausalLM ... PipelineModel
      the model's own methods: KerasHub's ``fit`` runs its preprocessor and builds a dataset
    Below
      fit: what the model's own ``fit`` reaches with ``super().fit(...)``, that is, Keras's
      own ``fit`` with tfscale's input handling (``Prepared.keras_fit``)
    keras.Model, Trainer, Layer ...

So a model's overridable methods get what Keras would hand them (KerasHub's ``fit`` sees the
user's ``x``, ``y`` and ``batch_size``), and tfscale works below them, where Keras's own input
handling is. An object of this class that was never prepared (``clone_model`` of a prepared
model makes one) behaves as its model class: every method defers to the next class when the
object has no tfscale state.

The class keeps the model class's name, module and Keras registered name, so ``summary()``,
``repr`` and saving (``model.save`` records the class by name) read as without tfscale, and a
saved model loads as the model class.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import keras

from tfscale.interop import internals, registry

__all__ = ["State", "give_prepared_class", "model_class", "prepared_class", "state_of"]

_STATE = "_tfscale"  # the instance attribute holding the model's Prepared


class State(Protocol):
    """What the prepared class asks of the model's tfscale state (``prepare.Prepared``)."""

    def make_function(self, kind: str, force: bool) -> Any: ...

    def symbolic_build(self, iterator: Any, data_batch: Any) -> Any: ...

    def compute_loss(
        self, own: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...

    def get_metrics_result(self, own: Callable[[], Any]) -> Any: ...

    def keras_fit(
        self, own: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...


def state_of(model: Any) -> Any:
    """The model's tfscale state (a ``prepare.Prepared``), or None where it was never
    prepared."""
    return model.__dict__.get(_STATE) if hasattr(model, "__dict__") else None


class Around:
    """tfscale's methods above the model's own: each wraps what the model's class does."""

    def make_train_function(self, force: bool = False) -> Any:
        state = state_of(self)
        if state is None:
            return super().make_train_function(force)  # type: ignore[misc]
        return state.make_function("train", force)

    def make_test_function(self, force: bool = False) -> Any:
        state = state_of(self)
        if state is None:
            return super().make_test_function(force)  # type: ignore[misc]
        return state.make_function("test", force)

    def _maybe_symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        state = state_of(self)
        if state is None:
            return super()._maybe_symbolic_build(iterator, data_batch)  # type: ignore[misc]
        return state.symbolic_build(iterator, data_batch)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        own: Callable[..., Any] = super().compute_loss  # type: ignore[misc]
        state = state_of(self)
        if state is None:
            return own(*args, **kwargs)
        return state.compute_loss(own, args, kwargs)

    def get_metrics_result(self) -> Any:
        own: Callable[..., Any] = super().get_metrics_result  # type: ignore[misc]
        state = state_of(self)
        return own() if state is None else state.get_metrics_result(own)


class Below(keras.Model):  # type: ignore[misc]
    """tfscale's ``fit`` below the model's own: Keras's ``fit`` as the model's class calls it."""

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        # The function, not the bound method: call_by_name binds the call's arguments by name.
        own: Callable[..., Any] = super().fit.__func__  # type: ignore[attr-defined]
        state = state_of(self)
        if state is None:
            return own(self, *args, **kwargs)
        return state.keras_fit(own, args, kwargs)


_CLASSES: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()
_CLASSES_LOCK = threading.Lock()


def model_class(model: Any) -> type:
    """The model's own class: what ``type(model)`` was before ``prepare``."""
    cls = type(model)
    return cls.__dict__.get("_tfscale_model_class", cls)  # type: ignore[no-any-return]


def prepared_class(cls: type) -> type:
    """The prepared class of model class ``cls`` (made once per class, then reused)."""
    cls = cls.__dict__.get("_tfscale_model_class", cls)
    with _CLASSES_LOCK:
        made = _CLASSES.get(cls)
        if made is None:
            # A class deriving from keras.Model directly has Below in its place: keras.Model
            # before Below would make no consistent order.
            bases = (Around, Below) if cls is keras.Model else (Around, cls, Below)
            made = type(
                cls.__name__,
                bases,
                {
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                    "__doc__": cls.__doc__,
                    "_tfscale_model_class": cls,
                },
            )
            internals.register_same_name(made, cls)
            _CLASSES[cls] = made
    return made


def give_prepared_class(model: Any, state: State) -> None:
    """Makes ``model`` an object of its prepared class, holding ``state``."""
    registry.replace("model-state", model, _STATE, state)
    made = prepared_class(type(model))
    if type(model) is not made:
        registry.give_class("model-class", model, made)
