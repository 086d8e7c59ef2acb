"""Reports: JSON numbers, Markdown, and a self-contained HTML whose plots decode and render."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from tfscale.profiling.advice import Facts, advise
from tfscale.profiling.report import Report, to_markdown, write_report
from tfscale.profiling.steptime import Breakdown
from tfscale.profiling.sweep import SweepPoint


def _report() -> Report:
    points = [
        SweepPoint("weak", 1, 64, 1, Breakdown(0.010, 0.001, 0.009, 0.0, 64), 1.0, 1.0),
        SweepPoint("weak", 2, 64, 1, Breakdown(0.013, 0.001, 0.009, 0.003, 128), 1.54, 0.77),
        SweepPoint("strong", 1, 128, 1, Breakdown(0.018, 0.001, 0.017, 0.0, 128), 1.0, 1.0),
        SweepPoint("strong", 2, 64, 1, Breakdown(0.013, 0.001, 0.009, 0.003, 128), 1.38, 0.69),
    ]
    facts = Facts(points[1].breakdown, replicas=2, batch_per_replica=64, physical_devices=2)
    return Report("mlp", "CPU", 2, {"replicas": [1, 2]}, points, advice=advise(facts))


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.sources.append(dict(attrs).get("src") or "")


def test_report_files_hold_the_numbers_and_decodable_plots(tmp_path: Path) -> None:
    from PIL import Image

    paths = write_report(_report(), str(tmp_path))
    data = json.loads(Path(paths["json"]).read_text())
    assert [p["examples_per_s"] for p in data["points"]][:2] == pytest.approx([6400, 128 / 0.013])
    assert data["points"][1]["shares"]["communication"] == pytest.approx(3 / 13)
    assert data["advice"][0]["key"] == "accumulate"
    markdown = Path(paths["md"]).read_text()
    assert "| weak | 2 | 64 |" in markdown and "77.0%" in markdown
    parser = _Images()
    html = Path(paths["html"]).read_text()
    parser.feed(html)
    assert len(parser.sources) == 2  # throughput/efficiency, and the breakdown bars
    for source in parser.sources:
        assert source.startswith("data:image/png;base64,")  # self-contained
        image = Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1])))
        image.load()
        assert image.size[0] >= 400 and image.size[1] >= 200
        # A plot, not a blank canvas: many distinct colours.
        assert len(np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0)) > 20
    assert not re.search(r"""src=["'](?!data:)""", html)  # nothing loaded from elsewhere
    assert to_markdown(_report()).count("**accumulate**") == 1


class _Tables(HTMLParser):
    """The page's tables as rows of cell texts, and its images by id."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.images: dict[str, str] = {}
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            found = dict(attrs)
            self.images[found.get("id") or ""] = found.get("src") or ""

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None


def test_html_report_of_several_workers_has_a_row_per_worker_and_a_timeline() -> None:
    import dataclasses

    from PIL import Image

    from tfscale.profiling.report import to_html
    from tfscale.profiling.stragglers import WorkerStep, judge

    # Worker 1 waits 201 ms for each batch; worker 0 waits as long for it in the all-reduce.
    steps = [WorkerStep(0, 0.207, 0.001, 0.206, 0.0), WorkerStep(1, 0.207, 0.201, 0.006, 0.0)]
    rows, straggler = judge(steps)
    several = dataclasses.replace(_report(), workers=rows, straggler=straggler)
    page = _Tables()
    page.feed(to_html(several))
    (workers,) = [t for t in page.tables if "waiting for others ms" in t[0]]
    header, *body = workers
    by_worker = {row[0]: dict(zip(header, row, strict=True)) for row in body}
    assert sorted(by_worker) == ["0", "1"]
    assert by_worker["1"]["input ms"] == "201.00" and by_worker["0"]["waiting for others ms"] == (
        "200.00"
    )
    # The timeline: one bar per worker, input (amber) and the wait for the others (grey) drawn.
    source = page.images["plot-workers"]
    assert source.startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))).convert("RGB")
    pixels = np.asarray(image).reshape(-1, 3).astype(int)
    for rgb in ((0xE4, 0xA1, 0x1B), (0xBB, 0xBB, 0xBB), (0x3B, 0x7D, 0xD8)):
        assert (np.abs(pixels - rgb).max(axis=1) <= 6).sum() > 500, rgb

    # One process: neither the table nor the timeline.
    alone = _Tables()
    alone.feed(to_html(_report()))
    assert "plot-workers" not in alone.images
    assert not [t for t in alone.tables if "waiting for others ms" in t[0]]


_CHROMIUM = (
    shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
)


# .ci/run installs Chromium, so CI renders the page; elsewhere its absence is a skip.
@pytest.mark.multiprocess
@pytest.mark.skipif(
    _CHROMIUM is None and not os.environ.get("CI"),
    reason="no Chromium/Chrome to render the HTML headless (apt-get install chromium)",
)
def test_html_report_renders_its_plots_in_headless_chromium(tmp_path: Path) -> None:
    from PIL import Image

    paths = write_report(_report(), str(tmp_path))
    shot = tmp_path / "shot.png"
    assert _CHROMIUM is not None, "CI=true but no Chromium: .ci/run installs it with apt-get"
    completed = subprocess.run(
        [
            _CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1200,900",
            f"--screenshot={shot}",
            "file://" + os.path.abspath(paths["html"]),
        ],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert shot.exists(), completed.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    # The plots' bar and line colours are on screen (they exist only inside the PNGs).
    colours = {
        tuple(int(v) for v in c) for c in np.unique(np.asarray(image).reshape(-1, 3), axis=0)
    }
    for rgb in ((0x3B, 0x7D, 0xD8), (0xD6, 0x45, 0x45)):  # compute, communication bars
        assert any(max(abs(a - b) for a, b in zip(c, rgb, strict=True)) <= 6 for c in colours)
