"""Sparse gradients under the optimizers whose Keras 3 update is sparse-aware: the keras-io
Transformer text classifier (keras-team/keras-io
``examples/nlp/text_classification_with_transformer.py``), shrunk and without dropout (its
random masks differ between one device and two replicas).

Its ``TokenAndPositionEmbedding`` holds both kinds of lookup: a positional embedding looked up at
``arange(maxlen)`` (indices that do not depend on the batch: every replica touches every row)
and a token embedding over 30 ids looked up 64 times per batch of 8 (repeated ids). The
reference is one device's ``model.fit`` with each sparse gradient densified before the
optimizer (``dense_gradients``): where a batch repeats an id, Keras's one-device sparse update
squares each lookup's entry on its own and differs from the dense gradient's update, and
tfscale reproduces the dense one (docs/training.md, "Sparse gradients"). Run in-process by
``test_sparse_updates.py`` and across 2 worker processes by ``test_parity_examples.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from keras import layers, ops

from .common import SEED, compiled, dense_gradients, tokens
from .registry import Case, Check, Run, flat_weights, same_history, same_iterations

TOKENS, TOKEN_LABELS = tokens()  # 48 sequences of 8 ids in 1..29
MAXLEN, VOCAB, EMBED, HEADS, FF = 8, 30, 8, 2, 16
WEIGHTS_RTOL = 1e-5

OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
}


class TransformerBlock(layers.Layer):
    """keras-io's block (dropout left out: see the module docstring)."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs: Any) -> Any:
        out1 = self.layernorm1(inputs + self.att(inputs, inputs))
        return self.layernorm2(out1 + self.ffn(out1))


class TokenAndPositionEmbedding(layers.Layer):
    """keras-io's embedding: tokens plus positions looked up at ``arange(maxlen)``."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x: Any) -> Any:
        positions = self.pos_emb(ops.arange(start=0, stop=ops.shape(x)[-1], step=1))
        return self.token_emb(x) + positions


def transformer_classifier(optimizer: str, dense: bool = False, block: bool = True) -> Any:
    """The seeded, compiled classifier.

    Args:
        optimizer: A key of ``OPTIMIZERS``.
        dense: The reference: one device, each sparse gradient densified before the
            optimizer (``dense_gradients``), Keras's ``model.fit`` run eagerly (6 steps: less
            than tracing them).
        block: With the ``TransformerBlock``; without it, the embeddings (every sparse
            gradient of the model) pooled into the classifier's head, which traces in a
            fraction of the time.
    """
    keras.utils.set_random_seed(SEED)
    inputs = layers.Input(shape=(MAXLEN,), dtype="int32")
    x = TokenAndPositionEmbedding(MAXLEN, VOCAB, EMBED)(inputs)
    if block:
        x = TransformerBlock(EMBED, HEADS, FF)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(20, activation="relu")(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    chosen = OPTIMIZERS[optimizer]()
    return compiled(
        keras.Model(inputs, outputs),
        optimizer=dense_gradients(chosen) if dense else chosen,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        run_eagerly=dense,
    )


def variable_differences(got: Any, expected: Any) -> dict[str, float]:
    """Each weight's relative difference (``relative_difference`` of one array), by path.

    The attention's key bias is left out: its gradient is exactly zero (softmax ignores a
    shift shared by every key), so its values are rounding noise, which Adam, RMSprop and
    Lion scale up to a step of the learning rate's size in either direction.
    """
    from tfscale.testing import relative_difference

    pairs = zip(got.weights, flat_weights(got), flat_weights(expected), strict=True)
    return {
        variable.path: relative_difference(a, b)
        for variable, a, b in pairs
        if not variable.path.endswith("key/bias")
    }


def same_weights_per_variable(rtol: float = WEIGHTS_RTOL) -> Check:
    """Every weight within ``rtol`` of the reference's, each on its own, and the weights
    moved."""
    from tfscale.testing import relative_difference

    def check(expected: Run, got: Run) -> None:
        differences = variable_differences(got.model, expected.model)
        worst = max(differences, key=differences.__getitem__)
        assert differences[worst] <= rtol, f"{worst} differs by {differences[worst]:.3g}"
        moved = relative_difference(got.model.get_weights(), got.initial_weights)
        assert moved > 0.0, "the weights did not change: nothing was trained"

    return check


def _case(optimizer: str, block: bool) -> Case:
    return Case(
        f"{'transformer_classifier' if block else 'token_and_position_embedding'}_{optimizer}",
        "keras-io examples/nlp/text_classification_with_transformer.py (sparse gradients)",
        lambda: transformer_classifier(optimizer, block=block),
        lambda: {"x": TOKENS, "y": TOKEN_LABELS, "batch_size": 16, "epochs": 2},
        reference_build=lambda: transformer_classifier(optimizer, dense=True, block=block),
        checks=[same_weights_per_variable(), same_history(), same_iterations],
    )


# Every optimizer on the embeddings; the whole classifier with Adam, the one users train most.
CASES = [*(_case(name, block=False) for name in OPTIMIZERS), _case("adam", block=True)]
