"""The one step measurement of bench and profile, on given step records (pure)."""

from __future__ import annotations

import json

import pytest

from tfscale.profiling.steptime import StepTimes, breakdown, from_record, to_record

_SHARES = {"input": 0.1, "compute": 0.5, "other": 0.1, "communication": 0.3}


def test_a_reference_without_the_all_reduce_splits_the_step_by_difference() -> None:
    # 2 ms fetching + 18 ms executing; 14 ms without the all-reduce: 4 ms exposed. A trace
    # is not needed where the reference ran (bench), and does not change the split.
    times = StepTimes((0.002,) * 5, (0.018,) * 5, 64)
    reference = StepTimes((0.0,) * 5, (0.014,) * 5, 64)
    for shares in (None, _SHARES):
        b = breakdown(times, reference, fetch_floor=0.0005, trace_shares=shares)
        assert b.method == "wall-clock"
        assert (b.step_s, b.input_s, b.compute_s, b.communication_s) == pytest.approx(
            (0.020, 0.0015, 0.0145, 0.004)
        )


def test_without_a_reference_a_trace_splits_the_wall_clock_step() -> None:
    # profile: the user's step observed, a trace window's shares; time with no op running
    # ("other") counts as compute.
    b = breakdown(StepTimes((0.002,) * 5, (0.018,) * 5, 64), trace_shares=_SHARES)
    assert b.method == "trace"
    assert (b.step_s, b.input_s, b.compute_s, b.communication_s) == pytest.approx(
        (0.020, 0.002, 0.012, 0.006)
    )
    assert b.examples_per_s == pytest.approx(64 / 0.020)


def test_without_either_only_the_fetch_is_split_off_and_no_communication_is_seen() -> None:
    timed = breakdown(StepTimes((0.002,) * 5, (0.018,) * 5, 64))
    assert timed.method == "wall-clock"
    assert (timed.input_s, timed.compute_s, timed.communication_s) == pytest.approx(
        (0.002, 0.018, 0.0)
    )
    # model.fit: the compiled step fetches its own batch; the whole step is compute.
    untimed = breakdown(StepTimes((0.0,) * 5, (0.020,) * 5, 64, fetch_timed=False))
    assert untimed.method == "step-time"
    assert (untimed.input_s, untimed.compute_s) == pytest.approx((0.0, 0.020))


def test_the_slowest_tenth_is_left_out_and_the_record_round_trips() -> None:
    # Nine steady steps and one stalled by a neighbour: the mean is the steady step's.
    times = StepTimes((0.001,) * 10, (0.009,) * 9 + (0.5,), 32)
    b = breakdown(times, trace_shares=_SHARES)
    assert b.step_s == pytest.approx(0.010)
    assert from_record(json.loads(json.dumps(to_record(b))), 32) == b
