"""Self-contained interactive HTML report of a monitor log.

>>> write_report("run/monitor.jsonl", "run/report.html")

One HTML file, no server, no network: the panels of :func:`backprism.plot.build_panels` are
embedded as JSON and drawn as SVG by an inline script (hover for values, drag to zoom, wheel to
zoom the step axis, double-click to reset, click a legend entry to hide a series). The
warnings of :func:`backprism.plot.diagnose` are listed on top.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

from backprism.plot.diagnose import diagnose
from backprism.plot.logdata import load
from backprism.plot.panels import build_panels
from backprism.report.assets import CSS, SCRIPT

__all__ = ["render_report", "write_report"]

_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<header><h1 id="title"></h1><div class="sub" id="subtitle"></div></header>
<main>
<p class="hint">Hover a chart for values · drag to zoom · mouse wheel zooms the x axis ·
double-click resets · click a legend entry to hide it.</p>
<div class="warnings" id="warnings"></div>
<div class="groups" id="groups"></div>
<section class="wide" id="performance"></section>
<section class="wide" id="other"></section>
</main>
<div id="tooltip"></div>
<script type="application/json" id="backprism-data">{data}</script>
<script>{script}</script>
</body>
</html>
"""


def render_report(source: Any, smoothing: float = 0.6, title: str | None = None) -> str:
    """HTML text of the report for ``source`` (a log path, a ``RunLog``, parsed monitor
    output or a Monitor)."""
    log = load(source)
    panels = build_panels(log, smoothing)
    name = title or (Path(log.source).name if log.source else "backprism monitor")
    last = log.last_step
    sub = f"{log.num_steps} tracked steps" + (f", last step {last}" if last is not None else "")
    if log.truncated:
        sub += " (last line was cut off and ignored)"
    data = {
        "title": f"backprism instrument panel — {name}",
        "subtitle": sub,
        "warnings": diagnose(log),
        "panels": [p.to_dict() for p in panels],
    }
    # "</" must not appear inside the <script> element.
    payload = json.dumps(data, allow_nan=False).replace("</", "<\\/")
    return _TEMPLATE.format(
        title=html.escape(data["title"]), css=CSS, data=payload, script=SCRIPT
    )


def write_report(
    source: Any,
    path: str | os.PathLike[str],
    smoothing: float = 0.6,
    title: str | None = None,
) -> Path:
    """Write the HTML report of ``source`` to ``path`` and return the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_report(source, smoothing, title), encoding="utf-8")
    return p
