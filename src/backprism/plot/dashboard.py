"""Matplotlib instrument panel (Cockpit-style dashboard) for a monitor log, and its live mode.

>>> dash = Dashboard()
>>> dash.draw("run/monitor.jsonl")       # a path, a RunLog, parsed output or a Monitor
>>> dash.save("run/dashboard.png")       # PNG, PDF or SVG by suffix
>>> Dashboard().watch("run/monitor.jsonl", out="run/live.png")   # redraw as the log grows
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from backprism.plot.logdata import RunLog, load, read_log
from backprism.plot.panels import Panel, Series, Shape, build_panels

__all__ = ["Dashboard"]

# Grid position of every panel: (row, column, row span). 4 instrument rows, performance below.
_LAYOUT = {
    "alpha": (0, 0, 1), "distance": (1, 0, 1), "gradnorm": (2, 0, 1), "hyperparameters": (3, 0, 1),
    "gradtests": (0, 1, 2), "hist1d": (2, 1, 1), "hist2d": (3, 1, 1),
    "maxev": (0, 2, 1), "trace": (1, 2, 1), "tic": (2, 2, 1), "gsnr": (3, 2, 1),
}
_GROUP_COLUMNS = ("Step size", "Gradients", "Curvature")


def _pyplot() -> Any:
    """``matplotlib.pyplot``; matplotlib itself falls back to Agg where no display exists."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("the dashboard needs matplotlib: pip install matplotlib") from None
    return plt


class Dashboard:
    """Cockpit-style instrument panel drawn with matplotlib.

    Args:
        smoothing: weight of the debiased exponential moving average drawn over raw series
            (``0`` disables smoothing).
        figsize: figure size in inches (the PNG is ``figsize × dpi`` pixels).
        dpi: resolution used by :meth:`save`.
        title: figure title (defaults to the log's file name).
    """

    def __init__(
        self,
        smoothing: float = 0.6,
        figsize: tuple[float, float] = (18.0, 13.0),
        dpi: int = 100,
        title: str | None = None,
    ) -> None:
        if not 0 <= smoothing < 1:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.figsize = figsize
        self.dpi = dpi
        self.title = title
        self.fig: Any = None
        self.panels: list[Panel] = []
        self.log: RunLog | None = None

    # ------------------------------------------------------------------ public API
    def draw(self, source: Any) -> Any:
        """Draw every panel for ``source`` and return the matplotlib figure.

        ``source``: path of a JSONL log, a :class:`RunLog`, parsed monitor output, or a
        Monitor object (read with ``get_output()``).
        """
        log = load(source)
        self.log = log
        self.panels = build_panels(log, self.smoothing)
        plt = _pyplot()
        if self.fig is None:
            self.fig = plt.figure(figsize=self.figsize, dpi=self.dpi)
        else:
            self.fig.clf()
        self._render(self.fig, log)
        return self.fig

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save the drawn figure; the format (PNG, PDF, SVG) follows the suffix."""
        if self.fig is None:
            raise ValueError("nothing drawn yet: call draw(log) before save(path)")
        p = Path(path)
        suffix = p.suffix.lower().lstrip(".")
        if suffix not in ("png", "pdf", "svg"):
            raise ValueError(f"unsupported image format {p.suffix!r}: use .png, .pdf or .svg")
        p.parent.mkdir(parents=True, exist_ok=True)
        self.fig.savefig(p, dpi=self.dpi, format=suffix)
        return p

    def close(self) -> None:
        """Close the figure."""
        if self.fig is not None:
            _pyplot().close(self.fig)
            self.fig = None

    def watch(
        self,
        path: str | os.PathLike[str],
        interval: float = 2.0,
        out: str | os.PathLike[str] | None = None,
        max_updates: int | None = None,
        timeout: float | None = None,
        on_update: Callable[[RunLog], None] | None = None,
    ) -> int:
        """Live mode: redraw whenever the JSONL log at ``path`` grows.

        Polls the file every ``interval`` seconds; on change re-reads it (a half-written last
        line is skipped until complete), redraws, shows the window when an interactive backend
        is active and saves to ``out`` if given. Stops after ``max_updates`` redraws,
        after ``timeout`` seconds, or on Ctrl-C / closing the window. Returns the number of
        redraws.
        """
        plt = _pyplot()
        interactive = plt.get_backend().lower() not in ("agg", "pdf", "svg", "ps", "cairo")
        if interactive:
            plt.ion()
        p = Path(path)
        last_sig: tuple[int, float] | None = None
        updates = 0
        start = time.monotonic()
        try:
            while True:
                sig = (p.stat().st_size, p.stat().st_mtime) if p.exists() else None
                if sig is not None and sig != last_sig:
                    try:
                        log = read_log(p)
                    except ValueError:
                        log = None  # header not written yet
                    if log is not None:
                        last_sig = sig
                        self.draw(log)
                        if out is not None:
                            self.save(out)
                        if interactive:
                            self.fig.show()
                        updates += 1
                        if on_update is not None:
                            on_update(log)
                if max_updates is not None and updates >= max_updates:
                    break
                if timeout is not None and time.monotonic() - start >= timeout:
                    break
                if interactive and self.fig is not None:
                    if not plt.fignum_exists(self.fig.number):
                        break
                    plt.pause(interval)
                else:
                    time.sleep(interval)
        except KeyboardInterrupt:
            pass
        return updates

    # ------------------------------------------------------------------ rendering
    def _render(self, fig: Any, log: RunLog) -> None:
        panels = {p.key: p for p in self.panels}
        others = [p for p in self.panels if p.group == "Other"]
        n_other_rows = math.ceil(len(others) / 3)
        heights = [1, 1, 1, 1, 1.25] + [1] * n_other_rows
        gs = fig.add_gridspec(
            len(heights), 3, height_ratios=heights, hspace=0.62, wspace=0.3,
            left=0.05, right=0.96, top=0.905, bottom=0.05,
        )
        title = self.title or (Path(log.source).name if log.source else "backprism monitor")
        steps = log.last_step
        sub = f"{log.num_steps} tracked steps"
        if steps is not None:
            sub += f", last step {steps}"
        fig.text(0.05, 0.985, f"backprism instrument panel — {title}", ha="left", va="top",
                 fontsize=16, fontweight="bold")
        fig.text(0.96, 0.985, sub, ha="right", va="top", fontsize=11, color="#555555")
        for col, name in enumerate(_GROUP_COLUMNS):
            x = 0.05 + (col + 0.5) * (0.91 / 3)
            fig.text(x, 0.94, name, ha="center", va="bottom", fontsize=14, fontweight="bold",
                     color="#1f5fa8")
        for key, (row, col, span) in _LAYOUT.items():
            panel = panels[key]
            cell = gs[row : row + span, col]
            if key == "gradtests" and panel.tracked:
                self._draw_tests(fig, cell, panel)
            else:
                ax = fig.add_subplot(cell)
                self._draw_panel(ax, panel)
        self._draw_panel(fig.add_subplot(gs[4, :]), panels["performance"])
        for i, panel in enumerate(others):
            self._draw_panel(fig.add_subplot(gs[5 + i // 3, i % 3]), panel)

    def _draw_tests(self, fig: Any, cell: Any, panel: Panel) -> None:
        inner = cell.subgridspec(3, 2, width_ratios=[1.7, 1], hspace=0.6, wspace=0.22)
        plane = fig.add_subplot(inner[:, 0])
        self._draw_panel(plane, panel)
        for i, child in enumerate(panel.children):
            ax = fig.add_subplot(inner[i, 1])
            self._draw_panel(ax, child, small=True)

    def _draw_panel(self, ax: Any, panel: Panel, small: bool = False) -> None:
        ax.set_title(panel.title, fontsize=9 if small else 11, fontweight="bold", loc="left")
        if not panel.tracked:
            ax.set_facecolor("#f4f4f4")
            ax.text(0.5, 0.5, panel.note or "not tracked", ha="center", va="center",
                    transform=ax.transAxes, color="#888888", fontsize=8 if small else 10,
                    style="italic", wrap=True)
            ax.set_xticks([])
            ax.set_yticks([])
            for s in ax.spines.values():
                s.set_color("#dddddd")
            return
        ax.grid(True, color="#e6e6e6", linewidth=0.6)
        ax.set_axisbelow(True)
        fs = 7 if small else 8
        ax.tick_params(labelsize=fs)
        if panel.kind == "heat" and panel.heat is not None:
            self._draw_heat(ax, panel)
        ax2 = None
        handles = []
        for s in panel.series:
            target = ax
            if s.axis == "right":
                if ax2 is None:
                    ax2 = ax.twinx()
                    ax2.tick_params(labelsize=fs)
                target = ax2
            h = _draw_series(target, s)
            if h is not None and not s.faint and s.label not in ("origin",):
                handles.append(h)
        for shape in panel.shapes:
            h = _draw_shape(ax, shape)
            if h is not None and shape.label:
                handles.append(h)
        if panel.ylog and ax.get_yscale() != "log":
            ax.set_yscale("log")
        if ax2 is not None:
            if panel.ylog2:
                ax2.set_yscale("log")
            if panel.key != "alpha":
                ax2.set_ylabel(panel.ylabel2, fontsize=fs)
            else:
                ax2.set_yticks([])
                ax.set_zorder(ax2.get_zorder() + 1)
                ax.patch.set_visible(False)
        if panel.xlim is not None:
            ax.set_xlim(*panel.xlim)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        if panel.equal:
            ax.set_aspect("equal", adjustable="box")
        if not small:
            ax.set_xlabel(panel.xlabel, fontsize=fs)
            ax.set_ylabel(panel.ylabel, fontsize=fs)
        if handles and not small:
            if panel.key == "performance":
                ax.legend(handles=handles, fontsize=7.5, loc="center right", framealpha=0.85)
            elif panel.children:
                ax.legend(handles=handles, fontsize=6.5, loc="upper center", framealpha=0.9,
                          ncol=2, bbox_to_anchor=(0.5, -0.16))
            else:
                ax.legend(handles=handles, fontsize=7, loc="best", framealpha=0.8)
        if small and panel.ylog:
            from matplotlib.ticker import LogFormatter

            ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 1)))
        if panel.info and panel.children:
            ax.text(0.02, 0.98, panel.info, transform=ax.transAxes, ha="left", va="top",
                    fontsize=7.5, color="#c83232" if "failing" in panel.info else "#2c9a48",
                    bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none"})
        elif panel.info:
            ax.text(1.0, 1.02, panel.info, transform=ax.transAxes, ha="right", va="bottom",
                    fontsize=6.5 if small else 7.5, color="#555555")

    def _draw_heat(self, ax: Any, panel: Panel) -> None:
        from matplotlib.colors import LogNorm

        heat = panel.heat or {}
        z = np.asarray(heat["z"], dtype=float)
        xe, ye = np.asarray(heat["xedges"]), np.asarray(heat["yedges"])
        zm = np.ma.masked_less_equal(z.T, 0)
        norm = LogNorm(vmin=max(zm.min(), 1), vmax=max(zm.max(), 2)) if zm.count() else None
        mesh = ax.pcolormesh(xe, ye, zm, cmap="viridis", norm=norm, shading="flat")
        cb = ax.figure.colorbar(mesh, ax=ax, pad=0.01, fraction=0.05)
        cb.ax.tick_params(labelsize=7)
        cb.set_label("count", fontsize=7)
        ax.grid(False)


def _draw_series(ax: Any, s: Series) -> Any:
    x, y = np.asarray(s.x, dtype=float), np.asarray(s.y, dtype=float)
    alpha = 0.3 if s.faint else 1.0
    ls = "--" if s.dashed else "-"
    if s.style == "bars":
        if y.size == 0:
            return None
        widths = np.diff(x)
        if s.faint:
            return ax.stairs(y, x, color=s.color, alpha=0.35 if s.axis == "right" else 0.8,
                             linewidth=1.0, label=s.label,
                             fill=s.axis == "right")
        return ax.bar(x[:-1], y, width=widths, align="edge", color=s.color, alpha=0.75,
                      label=s.label, linewidth=0)
    if s.style == "scatter":
        if s.c is not None and len(s.c) == len(x) and len(x):
            sc = ax.scatter(x, y, c=s.c, cmap="viridis", s=22, edgecolors="white",
                            linewidths=0.4, label=s.label, zorder=3)
            cb = ax.figure.colorbar(sc, ax=ax, pad=0.08 if s.axis == "left" else 0.01,
                                    fraction=0.05)
            cb.ax.tick_params(labelsize=7)
            cb.set_label("step", fontsize=7)
            return sc
        return ax.scatter(x, y, color=s.color, s=18, label=s.label, zorder=3)
    if s.style == "markers":
        return ax.plot(x, y, ls if len(x) > 1 else "", marker="o", markersize=4, color=s.color,
                       label=s.label, alpha=alpha, linewidth=1.2)[0]
    if s.style == "step":
        return ax.step(x, y, where="post", color=s.color, linestyle=ls, label=s.label,
                       alpha=alpha, linewidth=1.4)[0]
    # a quantity tracked on few steps (HessMaxEV every 200th step) also gets markers, or a
    # single value would draw nothing
    few = not s.faint and len(x) <= 30
    return ax.plot(x, y, color=s.color, linestyle=ls, label=s.label, alpha=alpha,
                   linewidth=0.8 if s.faint else 1.6, marker="o" if few else None,
                   markersize=3.5)[0]


def _draw_shape(ax: Any, shape: Shape) -> Any:
    from matplotlib.patches import Circle

    p = shape.params
    ls = "--" if shape.dashed else "-"
    if shape.kind == "circle":
        patch = Circle((p["cx"], p["cy"]), p["r"], facecolor=shape.color if shape.fill else "none",
                       alpha=0.25 if shape.fill else 0.9, edgecolor=shape.color, linestyle=ls,
                       linewidth=1.2, label=shape.label)
        ax.add_patch(patch)
        return patch
    if shape.kind == "hband":
        return ax.axhspan(p["y0"], p["y1"], color=shape.color, alpha=0.2, label=shape.label)
    if shape.kind == "vband":
        return ax.axvspan(p["x0"], p["x1"], color=shape.color, alpha=0.2, label=shape.label)
    if shape.kind == "hline":
        return ax.axhline(p["y"], color=shape.color, linestyle=ls, linewidth=1,
                          label=shape.label)
    if shape.kind == "vline":
        return ax.axvline(p["x"], color=shape.color, linestyle=ls, linewidth=1,
                          label=shape.label)
    raise ValueError(f"unknown shape {shape.kind!r}")
