"""Choose, explain and build the ``tf.distribute`` strategy that uses every device.

The choice is made in three steps so that each can be tested and shown on its own:

1. :func:`gather_facts` (``facts.py``) takes one snapshot of what this process can see
   (platform, GPUs, logical devices, the cluster from ``TF_CONFIG``, whether NCCL exists)
   into a frozen :class:`StrategyFacts`, without starting TensorFlow's runtime.
2. :func:`decide` (``rules.py``) is a pure function of those facts: small named rules
   (``_multi_worker``, ``_default_local``, ``_collectives_for``, ...) return a
   :class:`Decision` whose ``reasons`` hold each rule's verdict. ``tfscale doctor`` shows it
   without building anything (building MultiWorkerMirroredStrategy starts a gRPC server).
3. :func:`choose_strategy` (``choice.py``) builds the decided strategy (``build.py``); if
   TensorFlow refuses, it falls back to one device, keeps the error and warns, unless
   ``strict=True``.

Everything else in tfscale receives the resulting :class:`StrategyChoice`; where a caller
takes ``strategy=None``, :func:`strategy_in_effect` (``current.py``) says which one is meant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The facts and the rules are TensorFlow-free (the doctor and the pure tests use them without
# TensorFlow's 5 s import); building a strategy imports it, so those names load on first use.
from tfscale.runtime.lazy import lazy_names
from tfscale.strategy.facts import StrategyFacts, gather_facts, normalize_device
from tfscale.strategy.rules import KINDS, Decision, decide

if TYPE_CHECKING:
    from tfscale.strategy.choice import StrategyChoice, choose_strategy
    from tfscale.strategy.current import strategy_in_effect

_LAZY = {
    "StrategyChoice": "tfscale.strategy.choice",
    "choose_strategy": "tfscale.strategy.choice",
    "strategy_in_effect": "tfscale.strategy.current",
}

__all__ = [
    "KINDS",
    "Decision",
    "StrategyChoice",
    "StrategyFacts",
    "choose_strategy",
    "decide",
    "gather_facts",
    "normalize_device",
    "strategy_in_effect",
]


__getattr__, __dir__ = lazy_names("tfscale.strategy", _LAZY, globals())
