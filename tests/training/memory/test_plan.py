"""The memory plan's arithmetic and its fixes, on facts given by hand (no TensorFlow)."""

from __future__ import annotations

import dataclasses

from tfscale.training.memory.plan import COMPONENTS, ModelFacts, PlanOptions, fixes, make_plan

MiB = 2**20

FACTS = ModelFacts(
    name="m",
    weight_bytes=10 * MiB,
    trainable_bytes=8 * MiB,
    largest_variable_bytes=4 * MiB,
    optimizer_slots=2,
    optimizer_extra_bytes=0,
    traced_batch=64,
    activation_bytes=40 * MiB,
    layer_output_bytes=10 * MiB,
    input_bytes=1 * MiB,
)
DEVICES = ("/device:GPU:0", "/device:GPU:1")


def test_each_replica_holds_weights_gradients_and_state_and_its_share_of_activations() -> None:
    plan = make_plan(FACTS, PlanOptions(batch_per_replica=32, replicas=2), DEVICES)
    row = plan.devices[0]
    assert row.parts["weights"] == 10 * MiB
    assert row.parts["optimizer"] == 16 * MiB  # Adam: two slots per trainable byte
    assert row.parts["gradients"] == 8 * MiB
    assert row.parts["activations"] == 20 * MiB  # traced at 64, planned at 32
    assert row.parts["input"] == 1 * MiB  # two batches of 32 (the step's, the prefetched)
    assert row.parts["all_reduce"] == 16 * MiB
    assert row.parts["accumulators"] == 0
    # Held (weights, optimizer, input) + gradients + the largest phase (activations), not
    # the sum: the all-reduce buffers and the update's workspace come after the backward.
    assert row.peak == (10 + 16 + 1) * MiB + 8 * MiB + 20 * MiB
    assert plan.peak == row.peak and plan.total_peak == 2 * row.peak
    assert set(row.parts) == set(COMPONENTS)


def test_one_replica_has_no_all_reduce_buffers_and_accumulation_adds_one_sum() -> None:
    one = make_plan(FACTS, PlanOptions(batch_per_replica=64, accumulation_steps=4), DEVICES[:1])
    assert one.devices[0].parts["all_reduce"] == 0
    assert one.devices[0].parts["accumulators"] == 8 * MiB


def test_options_change_their_own_terms() -> None:
    base = PlanOptions(batch_per_replica=64, replicas=2)
    plain = make_plan(FACTS, base, DEVICES).devices[0].parts
    sharded = make_plan(FACTS, dataclasses.replace(base, shard_optimizer_state=True), DEVICES)
    assert sharded.devices[0].parts["optimizer"] == plain["optimizer"] // 2
    half = make_plan(FACTS, dataclasses.replace(base, mixed_precision="bf16"), DEVICES)
    assert half.devices[0].parts["activations"] == plain["activations"] // 2
    assert half.devices[0].parts["weights"] == plain["weights"] * 3 // 2  # + a bf16 copy
    remat = make_plan(FACTS, dataclasses.replace(base, remat=True), DEVICES)
    # The layers' outputs (10 MiB) and one layer's inside (40 / 4 layers) stay.
    assert remat.devices[0].parts["activations"] == 20 * MiB
    staged = make_plan(FACTS, dataclasses.replace(base, pipeline_stages=2), DEVICES)
    assert staged.devices[0].parts["weights"] == plain["weights"] // 2
    assert staged.devices[0].parts["activations"] == plain["activations"] // 2


def test_capacity_decides_whether_a_device_fits() -> None:
    plan = make_plan(FACTS, PlanOptions(batch_per_replica=64), DEVICES[:1], (50 * MiB,))
    assert plan.devices[0].peak > 50 * MiB and plan.devices[0].fits is False
    assert make_plan(FACTS, PlanOptions(batch_per_replica=64), DEVICES[:1]).devices[0].fits is None


def test_fixes_that_fit_come_first_cheapest_first_and_keep_the_global_batch() -> None:
    plan = make_plan(FACTS, PlanOptions(batch_per_replica=64, replicas=2), DEVICES)
    budget = plan.peak - 6 * MiB  # sharding saves 8 MiB, half the batch 13 MiB
    found = fixes(plan, budget, devices_available=2)
    fitting = [f for f in found if f.fits]
    assert fitting and all(f.peak <= budget for f in fitting)
    assert all(f.peak > budget for f in found if not f.fits)
    first = fitting[0]
    # The largest smaller batch that fits, with the accumulation that keeps the global batch.
    assert first.options.batch_per_replica * first.options.accumulation_steps == 64
    assert first.options.batch_per_replica == 32
    assert sum(1 for f in found if f.options.batch_per_replica != 64) == 1
    changes = [f.change for f in fitting]
    assert "shard_optimizer_state=True" in changes
    assert changes.index("shard_optimizer_state=True") > 0


def test_no_fix_fits_a_budget_below_the_weights() -> None:
    plan = make_plan(FACTS, PlanOptions(batch_per_replica=64, replicas=2), DEVICES)
    found = fixes(plan, 5 * MiB, devices_available=1)
    assert found and not any(f.fits for f in found)
    assert any(f.options.batch_per_replica < 64 for f in found)  # the smallest batch, named
    assert not any(f.options.pipeline_stages > 1 for f in found)  # one device: no pipeline


def test_record_and_table_carry_every_component() -> None:
    plan = make_plan(FACTS, PlanOptions(batch_per_replica=64, replicas=2), DEVICES)
    record = plan.to_record()
    assert record["peak_bytes"] == plan.peak
    device = record["devices"][0]  # type: ignore[index]
    assert all(f"{c}_bytes" in device for c in COMPONENTS)
    lines = plan.table()
    assert len(lines) == 3 and "/device:GPU:1" in lines[2]
