"""Each replica draws its own random numbers, as one device draws them for the whole batch.

A Keras random op (``Dropout``, ``GaussianNoise``, ``keras.random.normal(..., seed=
self.seed_generator)`` in a VAE's sampling layer or a GAN's ``train_step``) takes its seed from
a ``keras.random.SeedGenerator`` whose state is one variable for all replicas. Under a
``tf.distribute`` strategy every replica reads the same state, so every replica draws the same
numbers for its share of the batch: example ``i`` of each replica gets the same dropout mask,
and a GAN's generator sees the same latent vectors N times per step, not N different ones
(Keras's own ``model.fit`` under MirroredStrategy does it; ``tests/training/test_randomness.py``
shows it). One device draws independent numbers for every example of the batch.

A prepared model's seed generators fold the replica's id into each seed they hand out
(``tf.random.experimental.stateless_fold_in``; ``replica_id_in_sync_group``, which counts the
replicas of every worker under MultiWorkerMirroredStrategy), so the replicas' draws are
independent, as one device's are. Outside a replica context of several replicas (one device,
eager calls, the strategy's cross-replica context) they hand out Keras's seed unchanged. The
generators are the ones Keras tracks on the model's layers and the model itself
(``Layer._seed_generators``); a generator held by no layer (a module-level one, against
Keras's advice) is not reached.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfscale.interop import internals, registry

__all__ = ["draw_per_replica"]


def draw_per_replica(model: Any) -> int:
    """Makes every seed generator of ``model`` draw per replica (idempotent).

    Returns:
        How many generators were changed by this call.
    """
    changed = 0
    for generator in internals.seed_generators(model):
        if getattr(generator.__dict__.get("next"), "folds_replica", False):
            continue
        registry.replace("seed-generator", generator, "next", _folded(generator.next))
        changed += 1
    return changed


def _folded(keras_next: Any) -> Any:
    def next(ordered: bool = True) -> Any:
        seed = keras_next(ordered)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return seed
        return tf.random.experimental.stateless_fold_in(seed, context.replica_id_in_sync_group)

    next.folds_replica = True  # type: ignore[attr-defined]
    return next
