"""The plan and the measured peak in bench/profile reports: report.json, report.md and a
per-device plot in report.html (built from given numbers, no TensorFlow)."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from tfscale.profiling.report import Report, write_report
from tfscale.profiling.steptime import Breakdown
from tfscale.profiling.sweep import SweepPoint
from tfscale.training.memory.measure import MeasuredPeak
from tfscale.training.memory.plan import ModelFacts, PlanOptions, make_plan
from tfscale.training.memory.report import memory_record

MiB = 2**20
FACTS = ModelFacts("m", 4 * MiB, 4 * MiB, 2 * MiB, 2, 12, 32, 20 * MiB, 5 * MiB, MiB // 4)
CPUS = ("/device:CPU:0", "/device:CPU:1")


def _report(tmp_path: Path) -> tuple[dict[str, object], str, str]:
    one = make_plan(FACTS, PlanOptions(32, 1), CPUS[:1], shared_allocator=True)
    two = make_plan(FACTS, PlanOptions(32, 2), CPUS, shared_allocator=True)
    points = [
        SweepPoint(
            "weak",
            1,
            32,
            1,
            Breakdown(0.010, 0.001, 0.009, 0.0, 32),
            memory=memory_record(one, [MeasuredPeak(CPUS[:1], 40 * MiB, 13 * MiB)]),
        ),
        SweepPoint(
            "weak",
            2,
            32,
            1,
            Breakdown(0.012, 0.001, 0.009, 0.002, 64),
            memory=memory_record(two, [MeasuredPeak(CPUS, 100 * MiB, 30 * MiB)]),
        ),
    ]
    paths = write_report(Report("m", "CPU", 2, {}, points), str(tmp_path))
    return (
        json.loads(Path(paths["json"]).read_text()),
        Path(paths["md"]).read_text(),
        Path(paths["html"]).read_text(),
    )


def test_report_json_carries_planned_and_measured_peaks(tmp_path: Path) -> None:
    data, _, _ = _report(tmp_path)
    memory = data["points"][1]["memory"]  # type: ignore[index]
    planned = memory["plan"]["total_peak_bytes"]
    assert memory["plan"]["devices"][1]["device"] == "/device:CPU:1"
    (measured,) = memory["measured"]
    assert measured["devices"] == list(CPUS)
    assert measured["peak_bytes"] == 100 * MiB
    # One shared allocator: its peak is compared with the plan summed over both devices.
    assert measured["planned_bytes"] == planned
    assert measured["planned_over_measured"] == pytest.approx(planned / (100 * MiB))


def test_report_markdown_has_a_row_per_allocator(tmp_path: Path) -> None:
    data, markdown, _ = _report(tmp_path)
    section = markdown.split("## Memory: planned and measured peak", 1)[1]
    planned = data["points"][1]["memory"]["plan"]["total_peak_bytes"]  # type: ignore[index]
    row = f"| weak 2 x 32 | CPU:0 + CPU:1 | {planned / MiB:.1f} | 100.0 | "
    assert row in section
    assert "| weak 1 x 32 | CPU:0 | " in section


def test_report_html_has_a_memory_plot_per_device(tmp_path: Path) -> None:
    from PIL import Image

    _, _, html = _report(tmp_path)
    found = re.search(
        r'id="plot-memory" alt="memory plot" src="data:image/png;base64,([^"]+)"', html
    )
    assert found is not None
    image = Image.open(io.BytesIO(base64.b64decode(found.group(1))))
    image.load()
    assert image.size[0] >= 400
    assert len(np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0)) > 20
    assert "Memory: planned and measured peak" in html


def test_a_plan_without_a_measured_cpu_peak_says_how_to_measure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    record = memory_record(make_plan(FACTS, PlanOptions(32, 1), CPUS[:1]), [])
    assert record["measured"] == []
    assert "TF_CPU_ALLOCATOR_USE_BFC=true" in record["note"]
