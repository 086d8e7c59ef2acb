"""The report of a bench or profile run: report.json, report.md and a self-contained report.html.

The HTML embeds its plots as base64 PNG (matplotlib, Agg backend), so it opens anywhere without
the files beside it: throughput and scaling efficiency against replicas, and a stacked bar of
each replica count's step breakdown.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from tfscale.profiling.advice import Advice
from tfscale.profiling.collectives import CollectiveResult
from tfscale.profiling.stragglers import Straggler, WorkerRow
from tfscale.profiling.sweep import SweepPoint
from tfscale.training.memory.report import memory_lines, memory_plot

__all__ = ["Report", "plots", "to_dict", "to_markdown", "write_report"]

_COLOURS = {"input": "#e4a11b", "compute": "#3b7dd8", "communication": "#d64545"}


@dataclass(frozen=True)
class Report:
    """Everything measured in one run, and what follows from it.

    Attributes:
        workload: What was measured (``"mlp"``, ``"train.py"``).
        device_kind: ``"CPU"`` or ``"GPU"``.
        physical_devices: Physical cores or GPUs.
        settings: The run's settings (replicas, batch, steps, ...).
        points: Sweep points (weak, then strong); one point for a profiled script.
        collectives: All-reduce bandwidth measurements.
        advice: Recommendations, best first.
        verification: Predicted against measured effect of the applied advice, if verified.
        notes: Remarks on method and limits shown with the report.
        workers: Per-worker steps where several workers ran (``tfscale profile -n``).
        straggler: The worker that held the others back, if one did.
    """

    workload: str
    device_kind: str
    physical_devices: int
    settings: dict[str, Any]
    points: list[SweepPoint]
    collectives: list[CollectiveResult] = field(default_factory=list)
    advice: list[Advice] = field(default_factory=list)
    verification: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    workers: list[WorkerRow] = field(default_factory=list)
    straggler: Straggler | None = None

    def advised_point(self) -> SweepPoint:
        """The configuration the advice is about: weak scaling at the most replicas."""
        weak = [p for p in self.points if p.mode not in ("strong", "projected")] or self.points
        first_k = weak[0].accumulation
        return max((p for p in weak if p.accumulation == first_k), key=lambda p: p.replicas)


def _point_dict(point: SweepPoint) -> dict[str, Any]:
    b = point.breakdown
    return {
        "mode": point.mode,
        "replicas": point.replicas,
        "batch_per_replica": point.batch_per_replica,
        "global_batch": point.global_batch,
        "accumulation": point.accumulation,
        "examples_per_s": point.examples_per_s,
        "speedup": point.speedup,
        "efficiency": point.efficiency,
        "step_ms": b.step_s * 1e3,
        "input_ms": b.input_s * 1e3,
        "compute_ms": b.compute_s * 1e3,
        "communication_ms": b.communication_s * 1e3,
        "shares": b.shares,
        "method": b.method,
        "trace_shares": point.trace,
        **({"extra": b.extra} if b.extra else {}),
        **({"memory": point.memory} if point.memory else {}),
    }


def to_dict(report: Report) -> dict[str, Any]:
    """All numbers of ``report`` as JSON-ready data."""
    return {
        "workload": report.workload,
        "device_kind": report.device_kind,
        "physical_devices": report.physical_devices,
        "settings": report.settings,
        "points": [_point_dict(p) for p in report.points],
        "collectives": [asdict(c) for c in report.collectives],
        "advice": [asdict(a) for a in report.advice],
        "verification": report.verification,
        "notes": report.notes,
        **(_workers_dict(report) if report.workers else {}),
    }


def _workers_dict(report: Report) -> dict[str, Any]:
    straggler = report.straggler
    return {
        "workers": [
            {
                **asdict(r),
                **{f"{k[:-2]}_ms": v * 1e3 for k, v in asdict(r).items() if k != "worker"},
            }
            for r in report.workers
        ],
        "straggler": None
        if straggler is None
        else {"worker": straggler.worker, "cause": straggler.cause, "lead_s": straggler.lead_s},
    }


def _worker_lines(report: Report) -> list[str]:
    """The per-worker table and the straggler line."""
    lines = ["", "## Workers (own work and wait in the collective)", ""]
    lines += _table(
        ["worker", "step ms", "input ms", "compute ms", "comm. ms", "waiting for others ms"],
        [
            [str(r.worker)]
            + [
                f"{v * 1e3:.2f}"
                for v in (r.step_s, r.input_s, r.compute_s, r.communication_s, r.wait_s)
            ]
            for r in report.workers
        ],
    )
    s = report.straggler
    lines.append("")
    if s is None:
        lines.append("Straggler: none (no worker's own work leads the others' enough).")
    else:
        lines.append(
            f"Straggler: **worker {s.worker}, {s.cause}** ({s.lead_s * 1e3:.1f} ms per step "
            "ahead of the others' own work)."
        )
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


_SCALING_COLUMNS = (
    "mode",
    "replicas",
    "batch/replica",
    "accum.",
    "examples/s",
    "speedup",
    "efficiency",
    "input",
    "compute",
    "exposed comm.",
)


def _scaling_cells(p: SweepPoint) -> list[str]:
    """One sweep point as the cells of :data:`_SCALING_COLUMNS` (Markdown and terminal)."""
    shares = p.breakdown.shares
    return [
        p.mode,
        str(p.replicas),
        str(p.batch_per_replica),
        str(p.accumulation),
        f"{p.examples_per_s:.0f}",
        f"{p.speedup:.2f}x",
        _pct(p.efficiency),
        _pct(shares["input"]),
        _pct(shares["compute"]),
        _pct(shares["communication"]),
    ]


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def to_markdown(report: Report) -> str:
    """The report as Markdown: scaling table, breakdown, collectives, advice, verification."""
    lines = [f"# tfscale report: {report.workload}", ""]
    lines.append(
        f"{report.device_kind} x {report.physical_devices} physical; settings: "
        + ", ".join(f"{k}={v}" for k, v in report.settings.items())
    )
    lines += ["", "## Scaling and step breakdown (wall-clock method)", ""]
    rows = []
    for p in report.points:
        trace = p.trace
        cells = _scaling_cells(p)
        cells.insert(7, f"{p.breakdown.step_s * 1e3:.2f}")
        cells.append(" / ".join(_pct(trace.get(c, 0.0)) for c in _TRACE_ORDER) if trace else "-")
        rows.append(cells)
    header = list(_SCALING_COLUMNS)
    header.insert(7, "step ms")
    lines += _table([*header, "trace: input / compute / comm. / other"], rows)
    if report.workers:
        lines += _worker_lines(report)
    if report.collectives:
        lines += ["", "## All-reduce bandwidth", ""]
        lines += _table(
            ["buffer", "bytes", "replicas", "ms", "algbw GB/s", "busbw GB/s", "implementation"],
            [
                [
                    c.label,
                    str(c.size_bytes),
                    str(c.replicas),
                    f"{c.seconds * 1e3:.3f}",
                    f"{c.algbw / 1e9:.3f}",
                    f"{c.busbw / 1e9:.3f}",
                    c.implementation,
                ]
                for c in report.collectives
            ],
        )
    lines += memory_lines(report.points)
    lines += ["", "## Advice (best predicted effect first)", ""]
    if not report.advice:
        lines.append("Nothing to change: no rule fired.")
    for i, advice in enumerate(report.advice, 1):
        lines.append(f"{i}. **{advice.key}** ({advice.severity}): {advice.text}")
    if report.verification:
        v = report.verification
        lines += ["", "## Verification", ""]
        lines.append(
            f"Applied **{v['key']}** ({v['change']}): predicted {v['predicted_speedup']:.2f}x, "
            f"measured {v['measured_speedup']:.2f}x examples/s "
            f"({v['baseline_examples_per_s']:.0f} -> {v['changed_examples_per_s']:.0f})."
        )
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


_TRACE_ORDER = ("input", "compute", "communication", "other")


def plots(report: Report) -> dict[str, bytes]:
    """PNG images: ``"scaling"`` (throughput and efficiency), ``"breakdown"`` (stacked bars)
    and, where the memory was planned, ``"memory"`` (per device: the plan's components and
    the measured peak)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images: dict[str, bytes] = {}
    figure, left = plt.subplots(figsize=(6.4, 3.8))
    right = left.twinx()
    for mode, marker in (("weak", "o"), ("strong", "s"), ("script", "D"), ("projected", "x")):
        points = sorted(
            (p for p in report.points if p.mode == mode and p.accumulation == _first_k(report)),
            key=lambda p: p.replicas,
        )
        if not points:
            continue
        xs = [p.replicas for p in points]
        left.plot(
            xs, [p.examples_per_s for p in points], marker=marker, label=f"{mode}: examples/s"
        )
        right.plot(
            xs,
            [100 * p.efficiency for p in points],
            marker=marker,
            linestyle="--",
            label=f"{mode}: efficiency",
        )
    if any(p.mode == "projected" for p in report.points):
        left.set_xscale("log", base=2)  # projections reach hundreds of replicas
    left.set_xlabel("replicas")
    left.set_ylabel("examples/s")
    right.set_ylabel("scaling efficiency (%)")
    right.set_ylim(0, 110)
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    labels = left.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
    left.legend(handles, labels, fontsize=8, loc="lower left")
    left.set_title(f"Throughput and scaling efficiency: {report.workload}")
    images["scaling"] = _png(figure)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(6.4, 3.8))
    bars = [p for p in report.points if p.mode not in ("strong", "projected")]
    labels = [
        f"{p.replicas} x {p.batch_per_replica}"
        + (f" k={p.accumulation}" if p.accumulation > 1 else "")
        for p in bars
    ]
    bottom = [0.0] * len(bars)
    for part in ("input", "compute", "communication"):
        values = [getattr(p.breakdown, f"{part}_s") * 1e3 for p in bars]
        axis.bar(labels, values, bottom=bottom, label=part, color=_COLOURS[part])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axis.set_ylabel("ms per step")
    axis.set_xlabel("replicas x batch per replica")
    axis.set_title("Where each step's time goes")
    axis.legend(fontsize=8)
    images["breakdown"] = _png(figure)
    plt.close(figure)
    if report.workers:
        images["workers"] = _workers_plot(report)
    memory = [p for p in report.points if p.memory and p.mode != "strong"]
    if memory:
        point = max(memory, key=lambda p: p.replicas)  # the advised configuration's
        figure = memory_plot(
            point.memory,
            f"Memory per device: planned (bars) and measured peak, "
            f"{point.replicas} x {point.batch_per_replica}",
        )
        images["memory"] = _png(figure)
        plt.close(figure)
    return images


def _workers_plot(report: Report) -> bytes:
    """One step of each worker on a shared time axis: input, compute, communication, then
    the wait for the others (the steps end together in the collective)."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 1.2 + 0.5 * len(report.workers)))
    colours = {**_COLOURS, "wait": "#bbbbbb"}
    for index, row in enumerate(report.workers):
        left = 0.0
        parts = (
            ("input", row.input_s),
            ("compute", row.compute_s),
            ("wait", row.wait_s),
            ("communication", row.communication_s),
        )
        for part, seconds in parts:
            axis.barh(
                index,
                seconds * 1e3,
                left=left,
                color=colours[part],
                label=part if index == 0 else None,
            )
            left += seconds * 1e3
    axis.set_yticks(range(len(report.workers)), [f"worker {r.worker}" for r in report.workers])
    axis.invert_yaxis()
    axis.set_xlabel("ms (median step)")
    straggler = report.straggler
    axis.set_title(
        "One step per worker"
        + (f": worker {straggler.worker} holds the others back" if straggler else "")
    )
    axis.legend(fontsize=8, loc="lower right")
    data = _png(figure)
    plt.close(figure)
    return data


def _first_k(report: Report) -> int:
    return report.points[0].accumulation if report.points else 1


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def _markdown_to_html(markdown: str) -> str:
    """A minimal renderer for the Markdown this module writes (headings, tables, lists)."""
    out: list[str] = []
    in_table = False
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [html.escape(c.strip()) for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-"):
                continue
            tag = "th" if not in_table else "td"
            if not in_table:
                out.append("<table>")
                in_table = True
            out.append("<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>")
            continue
        if in_table:
            out.append("</table>")
            in_table = False
        text = html.escape(line).replace("**", "")
        if line.startswith("## "):
            out.append(f"<h2>{text[3:]}</h2>")
        elif line.startswith("# "):
            out.append(f"<h1>{text[2:]}</h1>")
        elif line.strip():
            out.append(f"<p>{text}</p>")
    if in_table:
        out.append("</table>")
    return "\n".join(out)


def to_html(report: Report, images: dict[str, bytes] | None = None) -> str:
    """A self-contained HTML page: the Markdown report with the plots embedded as base64 PNG."""
    images = plots(report) if images is None else images
    figures = "\n".join(
        f'<figure><img id="plot-{name}" alt="{name} plot" '
        f'src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}"></figure>'
        for name, data in images.items()
    )
    style = (
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px}"
        "figure{display:inline-block;margin:0 1em 1em 0}img{max-width:540px}"
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>tfscale report: {html.escape(report.workload)}</title>"
        f"<style>{style}</style></head>"
        f"<body><h1>tfscale report: {html.escape(report.workload)}</h1>\n{figures}\n"
        f"{_markdown_to_html(to_markdown(report).split(chr(10), 1)[1])}</body></html>\n"
    )


def write_report(report: Report, directory: str) -> dict[str, str]:
    """Writes report.json, report.md and report.html into ``directory`` (created if needed).

    Returns:
        ``{"json": path, "md": path, "html": path}``.
    """
    os.makedirs(directory, exist_ok=True)
    paths = {
        "json": os.path.join(directory, "report.json"),
        "md": os.path.join(directory, "report.md"),
        "html": os.path.join(directory, "report.html"),
    }
    with open(paths["json"], "w") as handle:
        json.dump(to_dict(report), handle, indent=2)
    with open(paths["md"], "w") as handle:
        handle.write(to_markdown(report))
    with open(paths["html"], "w") as handle:
        handle.write(to_html(report))
    return paths


def print_summary(report: Report, directory: str | None = None) -> None:
    """Prints the scaling table, the advice and where the report files are (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    table = Table(title=f"tfscale: {report.workload} on {report.device_kind}")
    for column in _SCALING_COLUMNS:
        table.add_column(column, justify="right")
    for p in report.points:
        table.add_row(*_scaling_cells(p))
    console.print(table)
    if report.workers:
        for line in _worker_lines(report)[1:]:
            console.print(line.replace("**", ""), markup=False)
    for line in memory_lines(report.points)[3:]:  # the table, without its heading
        console.print(line, markup=False)
    for i, advice in enumerate(report.advice[:3], 1):
        console.print(f"[bold]{i}. {advice.key}[/bold] ({advice.severity}): {advice.text}")
    if report.verification:
        v = report.verification
        console.print(
            f"[bold]verify[/bold] {v['key']} {v['change']}: predicted "
            f"{v['predicted_speedup']:.2f}x, measured {v['measured_speedup']:.2f}x examples/s"
        )
    if directory:
        console.print(
            f"Report: {os.path.join(directory, 'report.html')} (and report.md, report.json)"
        )
