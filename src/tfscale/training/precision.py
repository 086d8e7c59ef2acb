"""Mixed precision: which Keras dtype policy ``mixed_precision=`` means, applied to a model.

``"bf16"`` needs no loss scaling (bfloat16 has float32's exponent range). ``"fp16"`` wraps the
optimizer in Keras's ``LossScaleOptimizer`` (``prepare.py``), as ``compile()`` does under a
``mixed_float16`` policy. Under a strategy Keras's ``LossScaleOptimizer`` reads the finiteness
of the first replica's gradients before they are reduced
(``keras/src/optimizers/loss_scale_optimizer.py``, ``_tf_apply``); behind tfscale's
distributed update it sees the all-reduced gradients, so an overflow on any replica makes
every replica skip the same update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tfscale.errors import TrainingError, explain
from tfscale.interop import internals

__all__ = ["Precision", "apply_policy", "resolve_precision"]

_POLICIES = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}
_ALIASES = {
    "bfloat16": "bf16",
    "mixed_bfloat16": "bf16",
    "float16": "fp16",
    "mixed_float16": "fp16",
}


@dataclass(frozen=True)
class Precision:
    """A decided precision setting.

    Attributes:
        name: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        policy: The Keras dtype policy name, or None to leave the model as it is.
        loss_scaling: Whether dynamic loss scaling runs (fp16 only).
    """

    name: str
    policy: str | None
    loss_scaling: bool


def resolve_precision(mixed_precision: str | None) -> Precision:
    """Turns ``mixed_precision=`` into a :class:`Precision`.

    Raises:
        TrainingError: An unknown value.
    """
    if mixed_precision is None:
        return Precision("fp32", None, False)
    key = _ALIASES.get(str(mixed_precision).lower(), str(mixed_precision).lower())
    if key not in _POLICIES:
        raise TrainingError(
            explain(
                "Unknown mixed_precision setting.",
                received=mixed_precision,
                allowed='None, "bf16" or "fp16"',
                fix='tfscale.fit(model, x, y, mixed_precision="bf16")',
            )
        )
    return Precision(key, _POLICIES[key], key == "fp16")


def apply_policy(model: Any, precision: Precision) -> None:
    """Sets the mixed policy on every float32 layer of an existing model.

    Keras fixes a layer's policy when it is created; assigning ``layer.dtype_policy`` later
    changes its compute dtype while its variables stay float32, which is what a
    ``mixed_*`` policy means. Layers with another explicit dtype are left alone.
    """
    if precision.policy is None:
        return
    for layer in internals.flatten_layers(model):
        if getattr(layer.dtype_policy, "name", None) == "float32":
            layer.dtype_policy = precision.policy
