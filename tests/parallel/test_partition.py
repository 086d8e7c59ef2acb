"""Partition planning: chain detection, balance modes, stage reports, clear refusals."""

from __future__ import annotations

import keras
import pytest

import tfscale
from tfscale.parallel.partition import check_sizes, split_sizes

pytestmark = pytest.mark.tf


def chain_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(64, name="wide"),  # 576 params
            keras.layers.ReLU(name="relu"),
            keras.layers.Dense(8, name="narrow"),  # 520 params
            keras.layers.Dense(8, name="mid"),  # 72 params
            keras.layers.Dense(2, name="head"),  # 18 params
        ]
    )


def residual_model() -> keras.Model:
    inputs = keras.Input((8,), name="x")
    a = keras.layers.Dense(8, name="d1")(inputs)
    b = keras.layers.Dense(8, name="d2")(a)
    c = keras.layers.Add(name="add")([a, b])
    return keras.Model(inputs, keras.layers.Dense(2, name="d3")(c))


def test_split_sizes_minimises_the_largest_stage() -> None:
    assert split_sizes([1, 1, 1, 1], 2) == [2, 2]
    assert split_sizes([10, 1, 1, 1, 1], 2) == [1, 4]
    assert split_sizes([3, 3, 3, 9], 2) == [3, 1]
    assert split_sizes([5, 0, 5, 0], 2) == [2, 2]  # weightless layers stay with the one before
    assert split_sizes([4, 4, 4], 3) == [1, 1, 1]


def test_balance_by_params_reports_params_and_activation_per_stage() -> None:
    plan = tfscale.plan_partition(chain_model(), 2)
    assert isinstance(plan, tfscale.PartitionPlan)
    assert plan.sizes == [2, 3]
    assert [s.layers for s in plan.stages] == [("wide", "relu"), ("narrow", "mid", "head")]
    assert [s.params for s in plan.stages] == [576, 520 + 72 + 18]
    assert [s.activation_bytes for s in plan.stages] == [64 * 4, 2 * 4]
    assert all(s.seconds is None for s in plan.stages)
    table = plan.table()
    assert "balance=params" in table and "610" in table and "256 B" in table
    assert str(plan) == table


def test_balance_by_time_cuts_by_measured_layer_time() -> None:
    plan = tfscale.plan_partition(chain_model(), 3, "time", sample_batch=16)
    seconds = [s.seconds for s in plan.stages]
    assert all(t is not None and t > 0 for t in seconds)
    assert plan.balance == "time" and plan.sample_batch == 16
    assert "ms" in plan.table()


def test_given_sizes_are_used_and_bad_ones_refused() -> None:
    model = chain_model()
    assert tfscale.plan_partition(model, 3, [1, 1, 3]).sizes == [1, 1, 3]
    with pytest.raises(tfscale.PartitionError, match="add up to 4 layers but the model has 5"):
        tfscale.plan_partition(model, 2, [1, 3])
    with pytest.raises(tfscale.PartitionError, match="at least one layer"):
        tfscale.plan_partition(model, 2, [0, 5])
    with pytest.raises(tfscale.PartitionError, match="3 stage sizes for 2 stages"):
        tfscale.plan_partition(model, 2, [1, 1, 3])
    with pytest.raises(tfscale.PartitionError, match="only 5 layers"):
        tfscale.plan_partition(model, 6)
    with pytest.raises(tfscale.PartitionError, match="Unknown balance mode"):
        tfscale.plan_partition(model, 2, "flops")
    assert check_sizes([2, 3], 5, 2) == [2, 3]


def test_branching_model_is_refused_naming_the_blocking_layers() -> None:
    with pytest.raises(tfscale.PartitionError) as info:
        tfscale.plan_partition(residual_model(), 2)
    message = str(info.value)
    assert "do not form a chain" in message
    assert "Blocking layers: 'd1', 'add'" in message
    assert "'d1' feeds 2 layers ('d2', 'add')" in message
    assert "'add' takes 2 inputs ('d1', 'd2')" in message
    assert "keras.Model(block_input, block_output)" in message


def test_wrapped_branch_becomes_one_link_of_a_chain() -> None:
    model = keras.Sequential([keras.Input((8,)), residual_model(), keras.layers.Dense(3)])
    assert tfscale.plan_partition(model, 2).sizes == [1, 1]


def test_functional_chain_and_shared_layer() -> None:
    inputs = keras.Input((4,))
    h = keras.layers.Dense(5, name="a")(inputs)
    chain = keras.Model(inputs, keras.layers.Dense(2, name="b")(h))
    assert tfscale.plan_partition(chain, 2).stages[1].layers == ("b",)
    shared = keras.layers.Dense(4, name="twice")
    twice = keras.Model(inputs, shared(shared(inputs)))
    with pytest.raises(tfscale.PartitionError, match="'twice' is called 2 times"):
        tfscale.plan_partition(twice, 2)


def test_subclassed_and_unbuilt_models_are_refused() -> None:
    class Net(keras.Model):  # type: ignore[misc]
        def call(self, x: object) -> object:
            return x

    with pytest.raises(tfscale.PartitionError, match="Only Sequential and functional"):
        tfscale.plan_partition(Net(), 1)
    with pytest.raises(tfscale.PartitionError, match="not built"):
        tfscale.plan_partition(keras.Sequential([keras.layers.Dense(2)]), 1)
