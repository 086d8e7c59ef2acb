"""The embedded reference data and models."""

from __future__ import annotations

import hashlib
from importlib import resources

import numpy as np
import pytest

from tfscale.workloads import build_model, digits, synthetic_images


def test_digits_are_split_scaled_and_labelled() -> None:
    data = digits()
    assert data.x_train.shape == (1438, 8, 8, 1) and data.x_test.shape == (359, 8, 8, 1)
    assert data.x_train.min() >= 0.0 and data.x_train.max() <= 1.0
    assert set(np.unique(data.y_train)) == set(range(10))


def test_embedded_digits_are_scikit_learns_load_digits() -> None:
    with resources.files("tfscale").joinpath("data/digits.npz").open("rb") as handle:
        stored = np.load(handle)
        images, target = stored["images"], stored["target"]
    # The fingerprint of scikit-learn 1.9's load_digits() (images as uint8, target as uint8),
    # taken when the file was made; the same check against scikit-learn follows where it is.
    fingerprint = hashlib.sha256(images.tobytes() + target.tobytes()).hexdigest()
    assert fingerprint == "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"
    assert np.bincount(target).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return  # tfscale no longer installs scikit-learn (tfscale/data/README.md)
    bunch = load_digits()
    np.testing.assert_array_equal(images.astype(np.float64), bunch.images)
    np.testing.assert_array_equal(target, bunch.target)


@pytest.mark.tf
def test_models_are_compiled_identically_for_a_seed() -> None:
    x, _ = synthetic_images(4)
    first, second = build_model("cnn"), build_model("cnn")
    assert first.compiled and first.optimizer is not None
    np.testing.assert_array_equal(first.predict(x, verbose=0), second.predict(x, verbose=0))
    assert build_model("mlp").count_params() > 0
    with pytest.raises(ValueError, match="Unknown workload kind"):
        build_model("rnn")
