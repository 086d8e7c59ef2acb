"""The α-β projection on given numbers, checked by hand (pure: no TensorFlow)."""

from __future__ import annotations

import pytest

from tfscale.errors import ProfileError
from tfscale.profiling.projection import (
    INTERCONNECTS,
    Interconnect,
    fit_alpha_beta,
    hierarchical_allreduce_s,
    interconnect,
    project,
    ring_allreduce_s,
)

LINK = Interconnect("test", bandwidth=1e9, latency=1e-5, note="1 GB/s, 10 us")


def test_ring_allreduce_is_2_n_minus_1_latencies_plus_2_n_minus_1_over_n_transfers() -> None:
    # 100 MB over 4 ranks: 6 latencies (60 us) + 1.5 x 100 MB / 1 GB/s (150 ms).
    assert ring_allreduce_s(100e6, 4, LINK) == pytest.approx(6e-5 + 0.15)
    assert ring_allreduce_s(100e6, 1, LINK) == 0.0
    # The bandwidth term tends to 2 S / B; the latency term keeps growing.
    assert ring_allreduce_s(100e6, 512, LINK) == pytest.approx(1022e-5 + 2 * 511 / 512 * 0.1)


def test_hierarchical_allreduce_is_a_ring_in_the_node_plus_a_ring_of_shards_across_nodes() -> None:
    fast = Interconnect("fast", bandwidth=100e9, latency=5e-6, note="")
    # 16 ranks, 8 per node: in the node 14 latencies + 1.75 S / 100 GB/s; across the 2 nodes
    # 2 latencies + 1 x (S / 8) / 1 GB/s.
    size = 800e6
    expected = (14 * 5e-6 + 1.75 * size / 100e9) + (2 * 1e-5 + size / 8 / 1e9)
    assert hierarchical_allreduce_s(size, 16, 8, fast, LINK) == pytest.approx(expected)
    # Inside one node only: the intra ring.
    assert hierarchical_allreduce_s(size, 8, 8, fast, LINK) == ring_allreduce_s(size, 8, fast)


def test_projection_adds_the_allreduce_to_the_measured_local_step() -> None:
    rows = project(
        local_step_s=0.1,
        gradient_bytes=100e6,
        batch_per_replica=32,
        replicas=[1, 4],
        inter=LINK,
    )
    one, four = rows
    assert (one.step_s, one.allreduce_s, one.efficiency) == (0.1, 0.0, 1.0)
    assert four.allreduce_s == pytest.approx(6e-5 + 0.15)
    assert four.step_s == pytest.approx(0.1 + 6e-5 + 0.15)
    assert four.examples_per_s == pytest.approx(4 * 32 / four.step_s)
    assert four.efficiency == pytest.approx(0.1 / four.step_s)
    # Compression halves the bytes, not the latencies.
    (half,) = project(
        local_step_s=0.1,
        gradient_bytes=100e6,
        batch_per_replica=32,
        replicas=[4],
        inter=LINK,
        compression=0.5,
    )
    assert half.allreduce_s == pytest.approx(6e-5 + 0.075)


def test_alpha_beta_fit_recovers_the_line_and_clamps_noise() -> None:
    sizes = [4e3, 64e3, 1e6, 16e6]
    alpha, beta = fit_alpha_beta(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert alpha == pytest.approx(50e-6) and beta == pytest.approx(1 / 2e9)
    # A negative intercept (noise at small sizes) becomes 0 and beta a fit through 0.
    alpha, beta = fit_alpha_beta([1e6, 2e6], [0.4e-3, 1.0e-3])
    assert alpha == 0.0 and beta == pytest.approx((1e6 * 0.4e-3 + 2e6 * 1e-3) / 5e12)
    with pytest.raises(ProfileError, match="at least two different sizes"):
        fit_alpha_beta([1e6, 1e6], [1e-3, 1e-3])


def test_presets_and_refusals() -> None:
    assert interconnect("ethernet-25g").bandwidth == 3.125e9
    assert INTERCONNECTS["nvlink4"].bandwidth > INTERCONNECTS["ib-ndr"].bandwidth
    with pytest.raises(ProfileError, match="Unknown interconnect") as info:
        interconnect("carrier-pigeon")
    assert "ethernet-25g" in str(info.value)
    with pytest.raises(ProfileError, match="link inside the node"):
        project(
            local_step_s=0.1,
            gradient_bytes=1,
            batch_per_replica=1,
            replicas=[16],
            inter=LINK,
            per_node=8,
        )
    with pytest.raises(ProfileError, match=">= 1"):
        project(local_step_s=0.1, gradient_bytes=1, batch_per_replica=1, replicas=[0], inter=LINK)
