"""The ParameterServerStrategy loop's refusals (its real run is in tests/launch/test_jobs.py)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale.errors import TrainingError
from tfscale.training.coordinator import (
    fit_with_coordinator,
    is_parameter_server,
    unsupported_options,
)

pytestmark = pytest.mark.tf


def test_unsupported_options_are_those_set_away_from_default() -> None:
    assert unsupported_options({"accumulation_steps": 1, "global_clipnorm": None}) == []
    assert unsupported_options(
        {"accumulation_steps": 4, "mixed_precision": "bf16", "validation_data": ([1], [1])}
    ) == ["accumulation_steps", "mixed_precision", "validation_data"]


def test_is_parameter_server() -> None:
    assert not is_parameter_server(tf.distribute.OneDeviceStrategy("/cpu:0"))
    assert is_parameter_server(
        type("ParameterServerStrategyV2", (), {})()
    )  # the class TF exports under both names


def test_refusal_names_options_before_touching_the_cluster() -> None:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    data = (np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32"))
    with pytest.raises(TrainingError, match="does not support: steps_per_execution, remat"):
        fit_with_coordinator(model, data, strategy=None, steps_per_execution=2, remat=True)


def test_uncompiled_model_is_refused() -> None:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(TrainingError, match="compiled model"):
        fit_with_coordinator(model, ([[0.0, 0.0]], [[0.0]]), strategy=None)
