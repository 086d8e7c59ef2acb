"""Sparse gradients: tfscale's update is the dense gradient's, on any number of replicas.

The keras-io Transformer text classifier (a positional embedding and a token embedding with
repeated ids, ``parity/sparse_cases.py``) trained by ``tfscale.fit`` over 2 logical CPUs with
each of Adam, AdamW, RMSprop, Adagrad, Nadam and Lion ends within 1e-5 (per variable) of one
device's ``model.fit`` with dense gradients. Before, the replicas' slices of the same row
reached Keras's sparse update as separate entries, each squared on its own: up to 0.92 apart
(Adagrad 3e-5; Lion, linear in the gradient, was exact).
Where a batch repeats an id, Keras's own one-device sparse update differs from the dense one,
and tfscale follows the dense one, over 1 replica as over 2 (docs/training.md, "Sparse
gradients"). The same case runs across 2 worker processes in ``test_parity_examples.py``.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

import tfscale
from tfscale.training.optimizer import _rows_summed

from .helpers import strategy_for
from .parity import SPARSE_CASES
from .parity.registry import Case, run_case, tiered
from .parity.sparse_cases import TOKEN_LABELS, TOKENS, transformer_classifier, variable_differences

pytestmark = pytest.mark.tf


_TEST = "tests/training/test_sparse_updates.py::"
# `make test` runs the embeddings' gather with Adam and AdamW (decoupled decay); the other
# sparse-aware optimizers (the same gathered rows into their own step) and the transformer
# (trained by `make test` across 2 workers, the parity suite's 2-worker group) in
# `make test-full`.
FULL = {
    **{
        f"token_and_position_embedding_{name}": "token_and_position_embedding_adam"
        for name in ("nadam", "lion", "rmsprop", "adagrad")
    },
    "transformer_classifier_adam": "tests/training/test_parity_examples.py::"
    "test_cases_across_two_worker_processes_match_one_device[paths_across_workers]",
}


@pytest.mark.parametrize(
    "case",
    [
        tiered(
            case, FULL, f"{_TEST}test_two_replicas_give_the_dense_gradients_update_of_one_device"
        )
        for case in SPARSE_CASES
    ],
)
def test_two_replicas_give_the_dense_gradients_update_of_one_device(case: Case) -> None:
    run_case(case, strategy_for(2))


def test_duplicate_rows_are_summed_into_one_entry_each() -> None:
    slices = tf.IndexedSlices(
        tf.constant([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0], [3.0, 4.0]]),
        tf.constant([4, 1, 4, 0]),
        tf.constant([6, 2]),
    )
    summed = _rows_summed(slices)
    assert isinstance(summed, tf.IndexedSlices)  # still sparse: the rows touched only
    assert summed.indices.numpy().tolist() == [4, 1, 0]
    assert summed.values.numpy().tolist() == [[101.0, 202.0], [10.0, 20.0], [3.0, 4.0]]
    assert (tf.convert_to_tensor(summed).numpy() == tf.convert_to_tensor(slices).numpy()).all()


def test_repeated_ids_follow_the_dense_update_where_keras_sparse_one_differs() -> None:
    """docs/training.md's claim: with duplicate ids (the token embedding), Keras's one-device
    sparse Adam (each lookup's entry squared on its own) is not the dense gradient's update;
    tfscale gives the dense one over 1 replica as over 2 (see the parametrized test)."""
    fit = {"x": TOKENS, "y": TOKEN_LABELS, "batch_size": 16, "epochs": 2, "shuffle": False}
    dense = transformer_classifier("adam", dense=True, block=False)
    keras_sparse = transformer_classifier("adam", block=False)
    keras_sparse.run_eagerly = True  # as the reference runs (cheaper than tracing 6 steps)
    with tf.device("/device:CPU:0"):
        dense.fit(verbose=0, **fit)
        keras_sparse.fit(verbose=0, **fit)
    one_replica = transformer_classifier("adam", block=False)
    tfscale.fit(one_replica, strategy=strategy_for(0), verbose=0, **fit)

    assert max(variable_differences(one_replica, dense).values()) <= 1e-5
    apart = variable_differences(keras_sparse, dense)
    assert apart[keras_sparse.layers[1].token_emb.embeddings.path] > 1e-2
