"""The instrument panels as Plotly figures (``pip install backprism[report]``).

:func:`panel_figure` turns one :class:`~backprism.plot.panels.Panel` into a
:class:`plotly.graph_objects.Figure`; :func:`build_figures` does it for every tracked panel of a
log. The HTML report embeds these figures; in a notebook ``build_figures(log)["gradnorm"]``
shows one instrument on its own.

How panel data map onto Plotly:

* series style ``line`` / ``step`` / ``markers`` → ``Scatter`` lines (``line.shape="hv"`` for
  steps, lines with markers for ``markers``), ``scatter`` → markers coloured by ``c`` (viridis),
  ``bars`` (``len(y) + 1`` edges) → ``Bar`` with one bar per bin; a series on the right axis
  goes to ``yaxis2``. The faint raw curve shares its legend entry (``legendgroup``) with the
  smoothed one, so a click on the legend hides both, and it is left out of the hover label;
* shapes → layout shapes in data coordinates (bands span the whole other axis), listed in the
  legend when they have a label;
* heat maps → ``Heatmap`` of ``log10(count)`` over the bin edges; the hover shows the count;
* ``ylog`` / ``ylog2`` → log axes, ``equal`` → one unit per pixel on both axes
  (``scaleanchor``), ``xlim`` / ``ylim`` → the initial ranges (double-click returns to them).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from backprism.plot.logdata import load
from backprism.plot.panels import Panel, Series, Shape, build_panels

__all__ = ["CONFIG", "build_figures", "panel_figure", "require_plotly"]

#: Plotly config of the report's charts: wheel zoom, no logo, no lasso/box select.
CONFIG: dict[str, Any] = {
    "displaylogo": False,
    "scrollZoom": True,
    "responsive": True,
    "modeBarButtonsToRemove": ["select2d", "lasso2d", "autoScale2d"],
}

_SPARSE = 30  # line series with at most this many points also get markers
_HEIGHT = {"default": 260, "performance": 320, "gradtests": 320, "small": 118}


def require_plotly() -> Any:
    """``plotly.graph_objects``, or an :class:`ImportError` naming the extra to install."""
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise ImportError(
            "the HTML report needs plotly: pip install 'backprism[report]' (or pip install plotly)"
        ) from None
    return go


def _values(v: Any) -> list[float | None]:
    """Plain floats, non-finite → ``None`` (a gap in Plotly)."""
    return [float(x) if x is not None and math.isfinite(float(x)) else None for x in v]


def _rgba(color: str, alpha: float) -> str:
    c = color.lstrip("#")
    if len(c) != 6:
        return color
    r, g, b = (int(c[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def _is_raw(s: Series) -> bool:
    return s.faint and s.label.endswith(" (raw)")


def _xy_hover(panel: Panel) -> str:
    """Hover text of a point: the value alone on a step axis (the unified label shows the step
    and the series' name), both coordinates otherwise."""
    if panel.xlabel == "step":
        return "%{y:.4~g}"
    return f"{panel.xlabel} %{{x:.4~g}}<br>{panel.ylabel} %{{y:.4~g}}"


def _trace(go: Any, panel: Panel, s: Series, small: bool) -> Any:
    yaxis = "y2" if s.axis == "right" else "y"
    group = s.label[: -len(" (raw)")] if _is_raw(s) else s.label
    hidden_in_legend = small or _is_raw(s) or s.label in ("origin", "parabola")
    common: dict[str, Any] = {
        "name": s.label, "legendgroup": group, "showlegend": not hidden_in_legend, "yaxis": yaxis,
    }
    if s.style == "bars":
        edges = np.asarray(s.x, dtype=float)
        y = np.asarray(s.y, dtype=float)
        lo, hi = edges[:-1], edges[1:]
        return go.Bar(
            x=_values((lo + hi) / 2), y=_values(y), width=_values(hi - lo),
            customdata=np.stack([lo, hi], axis=1).tolist(),
            marker={"color": s.color, "line": {"width": 0}},
            opacity=0.3 if s.faint else 0.75,
            hovertemplate="[%{customdata[0]:.3~g}, %{customdata[1]:.3~g}): %{y:.4~g}",
            **common,
        )
    if s.style == "scatter":
        marker: dict[str, Any] = {"size": 7, "line": {"color": "white", "width": 0.5}}
        if s.c is not None:
            marker.update(color=_values(s.c), colorscale="Viridis", showscale=False)
            hover = "α = %{x:.3~g}<br>step %{customdata}"
        else:
            marker["color"] = s.color
            hover = _xy_hover(panel)
        return go.Scatter(
            x=_values(s.x), y=_values(s.y), mode="markers", marker=marker,
            customdata=s.c, hovertemplate=hover, **common,
        )
    line = {
        "color": s.color, "width": 1 if s.faint else 1.8,
        "dash": "dash" if s.dashed else "solid", "shape": "hv" if s.style == "step" else "linear",
    }
    skip = _is_raw(s) or s.label in ("parabola", "origin")
    x, y = _values(s.x), _values(s.y)
    finite = sum(a is not None and b is not None for a, b in zip(x, y))
    # a quantity on a sparse (e.g. logarithmic) schedule: mark its points, a single one is
    # invisible as a line
    sparse = not s.faint and s.style == "line" and finite <= _SPARSE
    return go.Scatter(
        x=x, y=y, line=line, opacity=0.35 if s.faint else 1.0,
        mode="lines+markers" if s.style == "markers" or sparse else "lines",
        marker={"size": 6 if s.style == "markers" else 4},
        hoverinfo="skip" if skip else None,
        hovertemplate=None if skip else _xy_hover(panel),
        **common,
    )


def _shape(sh: Shape, small: bool) -> dict[str, Any]:
    q = sh.params
    line = {"color": sh.color, "width": 1.2, "dash": "dash" if sh.dashed else "solid"}
    out: dict[str, Any] = {"line": line, "name": sh.label or None,
                           "showlegend": bool(sh.label) and not small}
    if sh.kind == "circle":
        out.update(type="circle", xref="x", yref="y", x0=q["cx"] - q["r"], x1=q["cx"] + q["r"],
                   y0=q["cy"] - q["r"], y1=q["cy"] + q["r"],
                   fillcolor=_rgba(sh.color, 0.22) if sh.fill else "rgba(0,0,0,0)")
    elif sh.kind == "hband":
        out.update(type="rect", xref="x domain", x0=0, x1=1, yref="y", y0=q["y0"], y1=q["y1"],
                   fillcolor=_rgba(sh.color, 0.18), layer="below", line={"width": 0})
    elif sh.kind == "vband":
        out.update(type="rect", yref="y domain", y0=0, y1=1, xref="x", x0=q["x0"], x1=q["x1"],
                   fillcolor=_rgba(sh.color, 0.18), layer="below", line={"width": 0})
    elif sh.kind == "hline":
        out.update(type="line", xref="x domain", x0=0, x1=1, yref="y", y0=q["y"], y1=q["y"])
    elif sh.kind == "vline":
        out.update(type="line", yref="y domain", y0=0, y1=1, xref="x", x0=q["x"], x1=q["x"])
    else:
        raise ValueError(f"unknown shape kind {sh.kind!r}")
    if sh.kind in ("hband", "vband") and sh.label:
        # a filled legend swatch needs a visible outline colour
        out["line"] = {"color": _rgba(sh.color, 0.5), "width": 1}
    return out


def _heat_trace(go: Any, panel: Panel) -> Any:
    heat = panel.heat or {}
    counts = np.asarray(heat["z"], dtype=float).T  # rows: y bins, columns: x bins
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(counts > 0, np.log10(counts), np.nan)
    return go.Heatmap(
        x=_values(heat["xedges"]), y=_values(heat["yedges"]),
        z=[_values(row) for row in z], text=np.nan_to_num(counts).astype(int).tolist(),
        colorscale="Viridis", zmin=0, hoverongaps=False, name="count",
        colorbar={"title": {"text": "log₁₀ count", "side": "right"}, "thickness": 10},
        hovertemplate=(f"{panel.xlabel} %{{x:.3~g}}<br>{panel.ylabel} %{{y:.3~g}}"
                       "<br>count %{text}<extra></extra>"),
    )


def _axis_range(lim: tuple[float, float] | None, log: bool) -> list[float] | None:
    if lim is None:
        return None
    if log:
        return [math.log10(v) if v > 0 else -300.0 for v in lim]
    return [float(lim[0]), float(lim[1])]


def panel_figure(panel: Panel, small: bool = False, height: int | None = None) -> Any:
    """The Plotly figure of one tracked panel (``small``: a compact chart without legend and
    axis titles, as for the gradient tests' histories)."""
    go = require_plotly()
    if not panel.tracked:
        raise ValueError(f"panel {panel.key!r} is not tracked: {panel.note}")
    fig = go.Figure()
    if panel.heat is not None:
        fig.add_trace(_heat_trace(go, panel))
    for s in panel.series:
        fig.add_trace(_trace(go, panel, s, small))
    right = any(s.axis == "right" for s in panel.series)
    x_is_step = panel.xlabel == "step"
    key = "small" if small else panel.key
    fig.update_layout(
        template="none",
        height=height or _HEIGHT.get(key, _HEIGHT["default"]),
        margin={"l": 58, "r": 58 if right else 14, "t": 8, "b": 24 if small else 40},
        font={"size": 10, "family": "-apple-system, Segoe UI, Helvetica, Arial, sans-serif"},
        paper_bgcolor="white", plot_bgcolor="white",
        showlegend=not small,
        legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 0, "yref": "container",
                "yanchor": "bottom", "font": {"size": 10}, "itemclick": "toggle",
                "itemdoubleclick": "toggleothers"},
        hovermode="x unified" if x_is_step else "closest",
        hoverlabel={"font": {"size": 11}},
        dragmode="zoom",
        bargap=0,
        barmode="overlay",
        shapes=[_shape(sh, small) for sh in panel.shapes],
    )
    grid = {"showgrid": True, "gridcolor": "#ececec", "zeroline": False, "showline": True,
            "linecolor": "#bbb", "mirror": True, "ticks": "outside", "tickcolor": "#bbb",
            "automargin": True}
    fig.update_xaxes(
        title={"text": None if small else panel.xlabel}, range=_axis_range(panel.xlim, False),
        hoverformat="d" if x_is_step else ".4~g", **grid,
    )
    yaxis: dict[str, Any] = {
        "title": {"text": None if small else panel.ylabel}, "type": "log" if panel.ylog else None,
        "range": _axis_range(panel.ylim, panel.ylog), "exponentformat": "power", **grid,
    }
    if panel.equal:
        yaxis.update(scaleanchor="x", scaleratio=1)
    if small:
        yaxis["nticks"] = 4
    fig.update_layout(yaxis=yaxis)
    if right:
        y2: dict[str, Any] = {
            "overlaying": "y", "side": "right", "showgrid": False, "zeroline": False,
            "title": {"text": panel.ylabel2 or None}, "type": "log" if panel.ylog2 else None,
            "exponentformat": "power", "automargin": True, "tickmode": "auto",
        }
        if any(s.axis == "right" and s.style == "bars" for s in panel.series):
            y2["rangemode"] = "tozero"
        if panel.key == "alpha":  # the α histogram's density only sets the bars' height
            y2.update(showticklabels=False, title={"text": None})
        fig.update_layout(yaxis2=y2)
    return fig


def build_figures(source: Any, smoothing: float = 0.6) -> dict[str, Any]:
    """``{panel key: Figure}`` for every tracked panel of ``source`` (a log path, a ``RunLog``,
    parsed monitor output or a Monitor); the gradient tests add ``gradtests.NormTest`` etc."""
    out: dict[str, Any] = {}
    for panel in build_panels(load(source), smoothing):
        if not panel.tracked:
            continue
        out[panel.key] = panel_figure(panel)
        for child in panel.children:
            if child.tracked:
                out[child.key] = panel_figure(child, small=True)
    return out
