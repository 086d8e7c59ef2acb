"""The embedded reference data and models."""

from __future__ import annotations

import numpy as np
import pytest

from tfscale.workloads import build_model, digits, synthetic_images


def test_digits_are_split_scaled_and_labelled() -> None:
    data = digits()
    assert data.x_train.shape == (1438, 8, 8, 1) and data.x_test.shape == (359, 8, 8, 1)
    assert data.x_train.min() >= 0.0 and data.x_train.max() <= 1.0
    assert set(np.unique(data.y_train)) == set(range(10))


@pytest.mark.tf
def test_models_are_compiled_identically_for_a_seed() -> None:
    x, _ = synthetic_images(4)
    first, second = build_model("cnn"), build_model("cnn")
    assert first.compiled and first.optimizer is not None
    np.testing.assert_array_equal(first.predict(x, verbose=0), second.predict(x, verbose=0))
    assert build_model("mlp").count_params() > 0
    with pytest.raises(ValueError, match="Unknown workload kind"):
        build_model("rnn")
