"""What runs in place of layers' ``call`` while a step is traced: recomputation.

It acts on the layers of the model that the step calls, so it applies to Keras's own
``train_step`` and to a user's override alike. (XLA compiles the whole replica step instead:
``xla.py``; compiling only the model's call fails on recurrent layers.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from tfscale.interop import internals, registry

__all__ = ["layer_calls"]


def _recomputed(call: Callable[..., Any], graphs: dict[int, Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        # The backward pass recomputes the call outside the layer's __call__, where a mixed
        # policy's autocast scope no longer holds: float32 weights met bfloat16 inputs
        # ("Input 'b' of 'MatMul' Op has type float32 that does not match type bfloat16").
        dtype = internals.autocast_dtype()

        def recomputed(*inner: Any) -> Any:
            with internals.autocast(dtype):
                return call(*inner, **kwargs)

        outputs = tf.recompute_grad(recomputed)(*args)
        for tensor in tf.nest.flatten(outputs, expand_composites=True):
            graph = getattr(tensor, "graph", None)  # an eager tensor has none
            if graph is not None:
                graphs[id(graph)] = graph
        return outputs

    return wrapped


@contextlib.contextmanager
def layer_calls(model: Any, *, remat: bool, traced_into: dict[int, Any]) -> Iterator[None]:
    """Replaces layer calls while the code inside traces a step.

    Args:
        model: The model the step calls.
        remat: Recompute each weighted leaf layer's activations in the backward pass.
            ``keras.RematScope`` only acts on layers created inside it, and under the TF
            backend in a ``tf.function`` it fails on layers called with keyword arguments
            (``training=``): "The custom_gradient decorator currently supports keywords
            arguments only when eager execution is enabled" (keras-team/keras#21207). So each
            leaf layer's ``call`` is wrapped in ``tf.recompute_grad`` with its keyword
            arguments bound.
        traced_into: Where the wrapped calls were traced, by id, filled here: their
            gradient functions (forward and recomputing backward) leave TensorFlow's registry
            once the step is traced (``internals.gradient_functions_released``), also from a
            graph nested in the step's (an XLA-compiled step's).
    """
    replaced: list[Any] = []
    if remat:
        for layer in internals.flatten_layers(model, include_self=False):
            if not internals.flatten_layers(layer, include_self=False) and layer.weights:
                registry.replace("remat-call", layer, "call", _recomputed(layer.call, traced_into))
                replaced.append(layer)
    try:
        yield
    finally:
        for layer in replaced:
            registry.restore("remat-call", layer, "call")
