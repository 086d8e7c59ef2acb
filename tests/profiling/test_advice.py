"""Advice rules on given breakdowns, with their predicted effects checked by hand."""

from __future__ import annotations

import json

import pytest

from tfscale.profiling.advice import Facts, advise, fit_batch_cost
from tfscale.profiling.facts import Environment, facts_for
from tfscale.profiling.report import Report
from tfscale.profiling.script import script_report
from tfscale.profiling.steptime import Breakdown, StepTimes, breakdown, to_record
from tfscale.profiling.sweep import SweepPoint


def _facts(input_s: float, compute_s: float, communication_s: float, **kw: object) -> Facts:
    b = Breakdown(input_s + compute_s + communication_s, input_s, compute_s, communication_s, 64)
    return Facts(b, **{"replicas": 2, "batch_per_replica": 64, "physical_devices": 4, **kw})  # type: ignore[arg-type]


def test_input_share_above_20_percent_is_high_and_predicts_the_wait_removed() -> None:
    advice = advise(_facts(0.030, 0.070, 0.0, jit_compile=True))
    assert [a.key for a in advice] == ["input-pipeline"]
    assert advice[0].severity == "high"
    assert advice[0].predicted_speedup == pytest.approx(0.100 / 0.070)
    assert "30% -> 0%" in advice[0].text and "1.43x" in advice[0].text


def test_input_between_5_and_20_percent_is_medium_and_below_5_is_silent() -> None:
    assert advise(_facts(0.010, 0.090, 0.0, jit_compile=True))[0].severity == "medium"
    assert advise(_facts(0.004, 0.096, 0.0, jit_compile=True)) == []


def test_exposed_communication_predicts_accumulation_from_the_cost_line() -> None:
    # 31 ms of 100 exposed; local time per update a + m * micro-batches with a = 29, m = 40 ms.
    facts = _facts(0.0, 0.069, 0.031, accumulation_cost=(0.029, 0.040), jit_compile=True)
    advice = {a.key: a for a in advise(facts)}
    accumulate = advice["accumulate"]
    assert accumulate.severity == "high" and accumulate.change == {"accumulation": 8}
    step_8 = 0.029 + 0.040 * 8 + 0.031  # k = 8: communication still above 3% at k = 2, 4
    assert accumulate.predicted_speedup == pytest.approx(8 * 0.100 / step_8)
    assert accumulate.shares_after["communication"] == pytest.approx(0.031 / step_8)
    assert "31% ->" in accumulate.text


def test_small_batch_uses_the_fitted_batch_cost() -> None:
    # local(b) = a + c b with a = 8 ms, c = 0.5 ms per example; b = 4 -> local 10 ms.
    facts = _facts(
        0.0, 0.010, 0.0, batch_per_replica=4, batch_cost=(0.008, 0.0005), jit_compile=True
    )
    (advice,) = advise(facts)
    assert advice.key == "larger-batch" and advice.change == {"batch_per_replica": 16}
    assert advice.predicted_speedup == pytest.approx(4 * 0.010 / (0.008 + 0.0005 * 16))


def test_more_replicas_than_cores_uses_the_measured_throughputs() -> None:
    facts = _facts(
        0.0,
        0.100,
        0.0,
        replicas=4,
        physical_devices=2,
        jit_compile=True,
        throughput_by_replicas={1: 900.0, 2: 1500.0, 4: 1000.0},
    )
    (advice,) = advise(facts)
    assert advice.key == "fewer-replicas" and advice.change == {"replicas": 2}
    assert advice.predicted_speedup == pytest.approx(1.5)


def test_bf16_and_xla_rules_and_ordering() -> None:
    facts = _facts(0.0, 0.080, 0.020, bf16_available=True)
    advice = advise(facts)
    keys = [a.key for a in advice]
    assert keys[-1] == "xla" and {"accumulate", "larger-batch", "bf16"} <= set(keys)
    bf16 = advice[keys.index("bf16")]
    assert bf16.predicted_speedup == pytest.approx(0.100 / (0.100 - 0.040))
    speedups = [a.predicted_speedup for a in advice]
    assert speedups == sorted(speedups, reverse=True)


def test_fit_batch_cost() -> None:
    assert fit_batch_cost({4: 0.010, 8: 0.012}) == pytest.approx((0.008, 0.0005))
    assert fit_batch_cost({4: 0.010}) is None
    assert fit_batch_cost({4: 0.010, 8: 0.009}) == pytest.approx((0.0095, 0.0))


def test_compute_that_grows_with_replicas_is_named_shared_hardware() -> None:
    # 2 replicas at the same per-replica batch: compute 10 -> 18 ms, so they share hardware.
    facts = _facts(
        0.0,
        0.018,
        0.0,
        physical_devices=2,
        jit_compile=True,
        compute_by_replicas={1: 0.010, 2: 0.018},
    )
    (advice,) = advise(facts)
    assert advice.key == "shared-compute" and advice.severity == "high"
    assert advice.change == {}  # no setting buys it: --verify skips it
    assert advice.predicted_speedup == pytest.approx(0.018 / (0.018 - 0.008))
    assert "1.80x from 1 to 2 replicas" in advice.text and "logical CPU devices" in advice.text
    gpu = advise(
        _facts(
            0.0,
            0.018,
            0.0,
            device_kind="GPU",
            jit_compile=True,
            compute_by_replicas={1: 0.010, 2: 0.018},
        )
    )
    assert gpu[0].key == "shared-compute" and "steps_per_execution" in gpu[0].text


def test_flat_compute_across_replicas_is_silent() -> None:
    flat = _facts(0.0, 0.011, 0.0, jit_compile=True, compute_by_replicas={1: 0.010, 2: 0.011})
    assert advise(flat) == []
    # A growth between 1.25x and 1.5x is medium.
    grown = _facts(0.0, 0.013, 0.0, jit_compile=True, compute_by_replicas={1: 0.010, 2: 0.013})
    assert [(a.key, a.severity) for a in advise(grown)] == [("shared-compute", "medium")]


def test_facts_for_takes_compute_at_the_advised_per_replica_batch() -> None:
    points = [
        SweepPoint("weak", 1, 64, 1, Breakdown(0.011, 0.0, 0.011, 0.0, 64)),
        SweepPoint("weak", 2, 64, 1, Breakdown(0.020, 0.0, 0.0195, 0.0005, 128)),
        SweepPoint("strong", 1, 128, 1, Breakdown(0.020, 0.0, 0.020, 0.0, 128)),
        SweepPoint("strong", 2, 64, 1, Breakdown(0.020, 0.0, 0.0195, 0.0005, 128)),
    ]
    # The environment is given (no bf16 units, XLA on): this test is about compute.
    facts = facts_for(Report("mlp", "CPU", 2, {}, points), Environment("CPU", 2, jit_compile=True))
    assert facts.compute_by_replicas == {1: 0.011, 2: 0.0195}  # not strong 1 x 128
    assert [a.key for a in advise(facts)] == ["shared-compute"]


def test_compression_is_advised_for_communication_over_a_link_only() -> None:
    # 40 ms of 100 exposed, over a link: bf16 halves it -> 80 ms a step.
    facts = _facts(0.0, 0.060, 0.040, jit_compile=True, over_a_link=True)
    advice = {a.key: a for a in advise(facts)}
    compress = advice["compress-gradients"]
    assert compress.severity == "high" and compress.change == {"gradient_compression": "bf16"}
    assert compress.predicted_speedup == pytest.approx(0.100 / 0.080)
    assert compress.shares_after["communication"] == pytest.approx(0.020 / 0.080)
    assert "gradient_compression='bf16'" in compress.text and "40% -> 25%" in compress.text
    # Between CPU devices of one process the all-reduce is a memory copy; already
    # compressed, or on one replica, there is nothing to advise.
    for quiet in (
        _facts(0.0, 0.060, 0.040, jit_compile=True),
        _facts(0.0, 0.060, 0.040, jit_compile=True, over_a_link=True, gradient_compression="bf16"),
        _facts(0.0, 0.060, 0.040, jit_compile=True, over_a_link=True, replicas=1),
        _facts(0.0, 0.098, 0.002, jit_compile=True, over_a_link=True),  # 2%: below 3%
    ):
        assert "compress-gradients" not in {a.key for a in advise(quiet)}


def _steps(fetch: float, execution: float, examples: int) -> StepTimes:
    return StepTimes((fetch,) * 10, (execution,) * 10, examples)


def _summary(b: Breakdown, replicas: int, shares: dict[str, float], jit: bool) -> dict:
    """What ``ProfileCallback.summary`` writes for a fit call (the keys profile reads)."""
    return {
        **to_record(b),
        "steps_measured": 10,
        "batch_size": b.examples_per_step,
        "replicas": replicas,
        "trace_shares": shares,
        "jit_compile": jit,
    }


@pytest.mark.parametrize(
    ("environment", "fired", "silent"),
    [
        # Two GPUs with bfloat16 units: the all-reduce crosses a link, compute could halve.
        (Environment("GPU", 2, bf16_available=True), {"bf16", "compress-gradients"}, set()),
        # Two worker processes on CPUs without bf16 units: compression, no bf16.
        (Environment("CPU", 2, multi_worker=True), {"compress-gradients"}, {"bf16"}),
        # Two CPU devices of one process, XLA on: a memory copy, nothing to compress.
        (
            Environment("CPU", 2, jit_compile=True),
            {"accumulate"},
            {"bf16", "compress-gradients", "xla"},
        ),
    ],
)
def test_bench_and_profile_fire_the_same_rules_on_the_same_numbers(
    environment: Environment, fired: set[str], silent: set[str]
) -> None:
    # One measurement (steptime.breakdown) and one set of facts (facts.facts_for) for both
    # commands: the same steps give the same breakdown and the same advice, whether bench
    # measured them (with a reference step without the all-reduce) or profile observed them
    # (a trace window's shares) and its child handed them over as JSON.
    one, two = _steps(0.004, 0.056, 128), _steps(0.004, 0.096, 128)
    bench_one = breakdown(one)
    bench_two = breakdown(two, without_reduce=_steps(0.0, 0.051, 128))
    shares_one = {"input": 0.004 / 0.06, "compute": 0.056 / 0.06}
    shares_two = {"input": 0.04, "compute": 0.41, "other": 0.10, "communication": 0.45}
    profile_one = breakdown(one, trace_shares=shares_one)
    profile_two = breakdown(two, trace_shares=shares_two)
    for benched, profiled in ((bench_one, profile_one), (bench_two, profile_two)):
        assert (profiled.step_s, profiled.input_s, profiled.compute_s) == pytest.approx(
            (benched.step_s, benched.input_s, benched.compute_s)
        )
        assert profiled.communication_s == pytest.approx(benched.communication_s)
    assert bench_two.communication_s == pytest.approx(0.045)

    # bench: the sweep's points -> Report -> facts_for -> advise.
    speedup = bench_two.examples_per_s / bench_one.examples_per_s
    points = [
        SweepPoint("weak", 1, 128, 1, bench_one),
        SweepPoint("weak", 2, 64, 1, bench_two, speedup=speedup, efficiency=speedup / 2),
    ]
    report = Report("mlp", environment.device_kind, environment.physical_devices, {}, points)
    benched = advise(facts_for(report, environment))

    # profile: the child's JSON (environment and fit summaries) -> script_report.
    def child(b: Breakdown, replicas: int, shares: dict[str, float]) -> dict:
        fit = _summary(b, replicas, shares, environment.jit_compile)
        return json.loads(json.dumps({**environment.to_json(), "status": 0, "fits": [fit]}))

    scripted = script_report(
        child(profile_two, 2, shares_two), "t.py", child(profile_one, 1, shares_one)
    )
    profiled = scripted.advice

    assert [(a.key, a.severity) for a in profiled] == [(a.key, a.severity) for a in benched]
    assert [a.predicted_speedup for a in profiled] == pytest.approx(
        [a.predicted_speedup for a in benched]
    )
    keys = {a.key for a in benched}
    assert fired <= keys and not silent & keys
