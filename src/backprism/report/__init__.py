"""Self-contained interactive HTML report of a monitor log (``pip install backprism[report]``).

>>> write_report("run/monitor.jsonl", "run/report.html")

One HTML file, no server, no network: every instrument of :func:`backprism.plot.build_panels`
is a Plotly chart (:mod:`backprism.report.figures`), with plotly.js embedded in the page. Hover
for values, drag to zoom, wheel to zoom, double-click to reset, click a legend entry to hide a
series. The warnings of :func:`backprism.plot.diagnose` are listed on top.

The page is put together from package data files in ``backprism/report/assets/``
(``report.html``, ``report.css`` and the few lines of ``report.js`` that hand the embedded
figures to ``Plotly.newPlot``). The figures travel as JSON in
``<script type="application/json" id="backprism-data">`` (``{"title", "subtitle",
"warnings", "config", "figures": [{"key", "data", "layout"}]}``), so the numbers can also be
read back from the file.
"""

from __future__ import annotations

import html
import os
from functools import cache
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from backprism.plot.diagnose import diagnose
from backprism.plot.logdata import load
from backprism.plot.panels import Panel, build_panels
from backprism.report.figures import CONFIG, build_figures, panel_figure, require_plotly

__all__ = ["build_figures", "panel_figure", "render_report", "write_report"]

_COLUMNS = ("Step size", "Gradients", "Curvature")


@cache
def _asset(name: str) -> str:
    return resources.files("backprism.report").joinpath("assets", name).read_text("utf-8")


@cache
def _plotlyjs() -> tuple[str, str]:
    """plotly.js (minified, the bundle shipped inside the plotly package) and its version."""
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    return get_plotlyjs(), get_plotlyjs_version()


class _Page:
    """Collects the chart placeholders (HTML) and their figures (JSON) in page order."""

    def __init__(self) -> None:
        self.figures: list[dict[str, Any]] = []

    def chart(self, panel: Panel, small: bool = False) -> str:
        fig = panel_figure(panel, small=small).to_plotly_json()
        self.figures.append({"key": panel.key, "data": fig["data"], "layout": fig["layout"]})
        key = html.escape(panel.key, quote=True)
        return f'<div class="chart" data-key="{key}" data-figure="{len(self.figures) - 1}"></div>'

    def card(self, panel: Panel) -> str:
        cls = "card" if panel.tracked else "card untracked"
        info = f'<span class="info">{html.escape(panel.info)}</span>' if panel.info else ""
        head = (f'<div class="{cls}" data-panel="{html.escape(panel.key, quote=True)}">'
                f"<h3>{html.escape(panel.title)}{info}</h3>")
        if not panel.tracked:
            return f'{head}<div class="note">{html.escape(panel.note or "not tracked")}</div></div>'
        if panel.key != "gradtests":
            return f"{head}{self.chart(panel)}</div>"
        main = self.chart(panel)
        smalls = []
        for child in panel.children:
            title = html.escape(child.title + (f"  {child.info}" if child.info else ""))
            inner = (self.chart(child, small=True) if child.tracked
                     else f'<div class="note">{html.escape(child.note)}</div>')
            smalls.append(f'<div class="small" data-panel="{html.escape(child.key, quote=True)}">'
                          f"<h4>{title}</h4>{inner}</div>")
        return (f'{head}<div class="tests"><div>{main}</div>'
                f'<div>{"".join(smalls)}</div></div></div>')


def _body(page: _Page, panels: list[Panel]) -> str:
    cols = []
    for group in _COLUMNS:
        cards = "".join(page.card(p) for p in panels if p.group == group)
        cols.append(f'<section class="group"><h2>{group}</h2>{cards}</section>')
    parts = [f'<div class="groups" id="groups">{"".join(cols)}</div>']
    perf = "".join(page.card(p) for p in panels if p.group == "Performance")
    parts.append(f'<section class="wide" id="performance"><h2>Performance</h2>{perf}</section>')
    others = [p for p in panels if p.group == "Other"]
    if others:
        cards = "".join(page.card(p) for p in others)
        parts.append(f'<section class="wide" id="other"><h2>Other quantities</h2>'
                     f'<div class="others">{cards}</div></section>')
    return "\n".join(parts)


def _warnings(warnings: list[str]) -> str:
    if not warnings:
        return '<div class="warnings ok" id="warnings">No warnings.</div>'
    items = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    return f'<div class="warnings" id="warnings"><strong>Warnings</strong><ul>{items}</ul></div>'


def render_report(source: Any, smoothing: float = 0.6, title: str | None = None) -> str:
    """HTML text of the report for ``source`` (a log path, a ``RunLog``, parsed monitor
    output or a Monitor). Needs plotly (``pip install backprism[report]``)."""
    require_plotly()
    from plotly.io.json import to_json_plotly

    from backprism import __version__

    log = load(source)
    panels = build_panels(log, smoothing)
    name = title or (Path(log.source).name if log.source else "backprism monitor")
    last = log.last_step
    sub = f"{log.num_steps} tracked steps" + (f", last step {last}" if last is not None else "")
    if log.truncated:
        sub += " (last line was cut off and ignored)"
    heading = f"backprism instrument panel — {name}"
    warnings = diagnose(log)
    page = _Page()
    body = _body(page, panels)
    payload = {"title": heading, "subtitle": sub, "warnings": warnings, "config": CONFIG,
               "figures": page.figures}
    # NaN → null; "</" must not appear inside the <script> element
    data = to_json_plotly(payload).replace("</", "<\\/")
    plotlyjs, plotly_version = _plotlyjs()
    return Template(_asset("report.html")).substitute(
        version=__version__, plotly_version=plotly_version, title=html.escape(heading),
        subtitle=html.escape(sub), css=_asset("report.css"), warnings=_warnings(warnings),
        body=body, plotlyjs=plotlyjs, data=data, script=_asset("report.js"),
    )


def write_report(
    source: Any,
    path: str | os.PathLike[str],
    smoothing: float = 0.6,
    title: str | None = None,
) -> Path:
    """Write the HTML report of ``source`` to ``path`` and return the path."""
    text = render_report(source, smoothing, title)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text, encoding="utf-8")
    return p
