"""The instrument panels as data: what each panel of the dashboard and the HTML report shows.

:func:`build_panels` turns a :class:`~backprism.plot.logdata.RunLog` into a list of
:class:`Panel` objects (series, reference shapes, labels, heat maps). The matplotlib
:class:`~backprism.plot.Dashboard` and the HTML report render the same panels, so both always
show the same numbers.

Panels, by group (Cockpit's layout):

* **Step size** — ``Alpha`` gauge (each step's α on the normalised parabola ``y = α²`` of the
  local quadratic fit — α = −1: no progress, 0: step lands on the minimum, 1: overshoots to the
  same loss on the other side — with a histogram of all α), ``Distance`` from the start and
  ``UpdateSize``, ``GradNorm``, and the hyperparameters (learning rate, ``CABS`` batch size).
* **Gradients** — gradient tests gauge: the plane spanned by the true gradient (normalised to
  ``(1, 0)``) and its orthogonal complement, with the norm test as a disk of radius ``NormTest``
  around the true gradient, the inner-product test as the band ``1 ± InnerTest`` and the
  orthogonality test as the band ``± OrthoTest`` (each test passes while its value ≤ 1, the unit
  disk drawn dashed), and the three tests' histories; ``GradHist1d`` (latest histogram of
  gradient elements, first one as outline) and ``GradHist2d`` (x: gradient element, y: parameter
  value, log count).
* **Curvature** — ``HessMaxEV`` (with the stability limit ``2/η`` when the learning rate is
  logged), ``HessTrace``, ``TICDiag``/``TICTrace``, ``MeanGSNR`` and ``EarlyStopping``.
* **Performance** — mini-batch ``Loss`` and the ``monitor.log`` metrics (losses left axis,
  accuracies right axis).

Per-parameter lists are reduced with :func:`~backprism.plot.logdata.combine`. Line series are
drawn raw (faint) plus smoothed by a debiased exponential moving average with weight
``smoothing``: ``m_t = s·m_{t−1} + (1−s)·y_t``, shown as ``m_t / (1 − s^t)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from backprism.plot.logdata import RunLog, base_name, is_auxiliary

__all__ = [
    "GROUPS",
    "KNOWN_QUANTITIES",
    "Panel",
    "Series",
    "Shape",
    "build_panels",
    "ema",
    "tail_median",
]

GROUPS = ("Step size", "Gradients", "Curvature", "Performance", "Other")

#: Quantities with a panel of their own; ``Parameters`` and ``Time`` are only summarised.
KNOWN_QUANTITIES = (
    "Loss", "Alpha", "Distance", "UpdateSize", "GradNorm", "NormTest", "InnerTest", "OrthoTest",
    "GradHist1d", "GradHist2d", "TICDiag", "TICTrace", "HessTrace", "HessMaxEV", "MeanGSNR",
    "CABS", "EarlyStopping", "Time", "Parameters",
)

COLORS = {
    "blue": "#1f5fa8",
    "orange": "#e0701b",
    "green": "#2c9a48",
    "red": "#c83232",
    "purple": "#7a4bb0",
    "grey": "#7f7f7f",
    "teal": "#168a8a",
    "brown": "#8c564b",
}
_CYCLE = list(COLORS.values())


@dataclass
class Series:
    """One drawn series. ``style``: ``line``, ``step``, ``markers``, ``scatter`` (colour by ``c``)
    or ``bars`` (``x`` are the ``len(y) + 1`` bin edges)."""

    label: str
    x: list[float]
    y: list[float]
    style: str = "line"
    color: str = COLORS["blue"]
    axis: str = "left"
    faint: bool = False
    dashed: bool = False
    c: list[float] | None = None


@dataclass
class Shape:
    """Reference geometry in data coordinates: ``circle`` (cx, cy, r), ``hband`` (y0, y1),
    ``vband`` (x0, x1), ``hline`` (y) or ``vline`` (x)."""

    kind: str
    params: dict[str, float]
    color: str = COLORS["grey"]
    label: str = ""
    dashed: bool = False
    fill: bool = True


@dataclass
class Panel:
    """One instrument. ``kind``: ``xy`` or ``heat`` (``heat`` = ``{"z", "xedges", "yedges"}``).
    Untracked panels have ``tracked=False`` and a ``note`` saying which quantities to add."""

    key: str
    title: str
    group: str
    tracked: bool = True
    kind: str = "xy"
    series: list[Series] = field(default_factory=list)
    shapes: list[Shape] = field(default_factory=list)
    xlabel: str = "step"
    ylabel: str = ""
    ylabel2: str = ""
    ylog: bool = False
    ylog2: bool = False
    equal: bool = False
    xlim: tuple[float, float] | None = None
    ylim: tuple[float, float] | None = None
    note: str = ""
    info: str = ""
    heat: dict[str, Any] | None = None
    children: list[Panel] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN/inf → ``None``)."""
        return _clean(asdict(self))


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.generic):
        return _clean(obj.item())
    return obj


def ema(y: np.ndarray, smoothing: float) -> np.ndarray:
    """Debiased exponential moving average skipping NaNs (``smoothing`` in ``[0, 1)``)."""
    y = np.asarray(y, dtype=float)
    if smoothing <= 0 or y.size == 0:
        return y.copy()
    out = np.full_like(y, np.nan)
    m, w = 0.0, 0.0
    for i, v in enumerate(y):
        if math.isfinite(v):
            m = smoothing * m + (1 - smoothing) * v
            w = smoothing * w + (1 - smoothing)
        if w > 0:
            out[i] = m / w
    return out


def tail_median(y: np.ndarray, fraction: float = 0.2) -> float:
    """Median of the finite values among the last ``fraction`` of ``y`` (NaN if none)."""
    y = np.asarray(y, dtype=float)
    if y.size == 0:
        return math.nan
    tail = y[-max(1, math.ceil(fraction * y.size)) :]
    tail = tail[np.isfinite(tail)]
    return float(np.median(tail)) if tail.size else math.nan


def _lst(a: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(a, dtype=float)]


def _line(
    x: np.ndarray, y: np.ndarray, label: str, color: str, smoothing: float, axis: str = "left"
) -> list[Series]:
    """Raw (faint, when smoothed) plus smoothed series."""
    if smoothing > 0 and y.size > 2:
        return [
            Series(label + " (raw)", _lst(x), _lst(y), color=color, axis=axis, faint=True),
            Series(label, _lst(x), _lst(ema(y, smoothing)), color=color, axis=axis),
        ]
    return [Series(label, _lst(x), _lst(y), color=color, axis=axis)]


def _untracked(key: str, title: str, group: str, names: str) -> Panel:
    return Panel(key, title, group, tracked=False, note=f"not tracked (add {names})")


def _positive(y: np.ndarray) -> bool:
    f = y[np.isfinite(y)]
    return bool(f.size) and bool(np.all(f > 0)) and f.max() / max(f.min(), 1e-300) > 30


def _scalar_panel(
    log: RunLog,
    key: str,
    title: str,
    group: str,
    names: tuple[str, ...],
    ylabel: str,
    smoothing: float,
    logscale: str = "auto",
) -> Panel:
    """Generic panel: every logged key of the quantity classes ``names``."""
    keys = [k for n in names for k in log.keys_of(n)]
    if not keys:
        return _untracked(key, title, group, " / ".join(names))
    panel = Panel(key, title, group, ylabel=ylabel)
    ys = []
    for i, k in enumerate(keys):
        x, y = log.scalar(k)
        ys.append(y)
        panel.series += _line(x, y, k, _CYCLE[i % len(_CYCLE)], smoothing)
    allv = np.concatenate(ys) if ys else np.zeros(0)
    panel.ylog = _positive(allv) if logscale == "auto" else logscale == "log"
    last = [f"{k} = {_fmt(tail_last(log.scalar(k)[1]))}" for k in keys]
    panel.info = ", ".join(last)
    return panel


def tail_last(y: np.ndarray) -> float:
    """Last finite value of ``y`` (NaN if none)."""
    f = np.asarray(y, dtype=float)
    f = f[np.isfinite(f)]
    return float(f[-1]) if f.size else math.nan


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "nan"
    return f"{v:.3g}"


# ---------------------------------------------------------------------------- step size
def _alpha_panel(log: RunLog) -> Panel:
    key = log.key("Alpha")
    if key is None:
        return _untracked("alpha", "α gauge", "Step size", "Alpha")
    steps, alpha = log.scalar(key)
    ok = np.isfinite(alpha)
    steps, alpha = steps[ok], alpha[ok]
    lim = 1.5
    if alpha.size:
        lim = float(min(3.0, max(1.5, np.percentile(np.abs(alpha), 95) * 1.1)))
    shown = np.clip(alpha, -lim, lim)
    xs = np.linspace(-lim, lim, 121)
    panel = Panel(
        "alpha", "α gauge", "Step size", xlabel="normalised step α",
        ylabel="normalised loss", ylabel2="density", xlim=(-lim, lim), ylim=(0, lim**2 * 1.05),
    )
    counts, edges = np.histogram(shown, bins=24, range=(-lim, lim))
    dens = counts / max(1, counts.sum()) / (edges[1] - edges[0])
    panel.series = [
        Series("α histogram", _lst(edges), _lst(dens), style="bars", color=COLORS["grey"],
               axis="right", faint=True),
        Series("parabola", _lst(xs), _lst(xs**2), color="#333333"),
        Series("α per step", _lst(shown), _lst(shown**2), style="scatter",
               color=COLORS["blue"], c=_lst(steps)),
    ]
    panel.shapes = [
        Shape("vline", {"x": 0.0}, color=COLORS["green"], label="optimal α = 0", dashed=True),
    ]
    med = tail_median(alpha)
    panel.info = f"median α (last 20%) = {_fmt(med)}"
    return panel


def _distance_panel(log: RunLog, smoothing: float) -> Panel:
    dk, uk = log.key("Distance"), log.key("UpdateSize")
    if dk is None and uk is None:
        return _untracked("distance", "Distance & update size", "Step size",
                          "Distance / UpdateSize")
    panel = Panel("distance", "Distance & update size", "Step size")
    info = []
    if dk is not None:
        x, y = log.scalar(dk)
        panel.series += _line(x, y, "distance ‖θ−θ₀‖", COLORS["blue"], 0.0)
        panel.ylabel = "‖θ − θ₀‖"
        info.append(f"distance = {_fmt(tail_last(y))}")
    if uk is not None:
        x, y = log.scalar(uk)
        axis = "right" if dk is not None else "left"
        panel.series += _line(x, y, "update size ‖Δθ‖", COLORS["orange"], smoothing, axis)
        if axis == "right":
            panel.ylabel2 = "‖Δθ‖"
            panel.ylog2 = _positive(y)
        else:
            panel.ylabel = "‖Δθ‖"
            panel.ylog = _positive(y)
        info.append(f"update = {_fmt(tail_last(y))}")
    panel.info = ", ".join(info)
    return panel


def _hyper_panel(log: RunLog, smoothing: float) -> Panel:
    x, lr = log.metric("learning_rate")
    ck = log.key("CABS")
    if not lr.size and ck is None:
        return _untracked("hyperparameters", "Hyperparameters", "Step size",
                          "monitor.log(learning_rate=...) / CABS")
    panel = Panel("hyperparameters", "Hyperparameters", "Step size")
    info = []
    if lr.size:
        panel.series.append(Series("learning rate", _lst(x), _lst(lr), style="step",
                                   color=COLORS["purple"]))
        panel.ylabel = "learning rate η"
        panel.ylog = _positive(lr)
        info.append(f"η = {_fmt(tail_last(lr))}")
    if ck is not None:
        cx, cy = log.scalar(ck)
        axis = "right" if lr.size else "left"
        panel.series += _line(cx, cy, "CABS batch size", COLORS["teal"], smoothing, axis)
        if axis == "right":
            panel.ylabel2 = "CABS batch size"
        else:
            panel.ylabel = "CABS batch size"
        info.append(f"CABS = {_fmt(tail_last(cy))}")
    panel.info = ", ".join(info)
    return panel


# ---------------------------------------------------------------------------- gradients
_TESTS = (("NormTest", "norm test"), ("InnerTest", "inner-product test"),
          ("OrthoTest", "orthogonality test"))


def _tests_panel(log: RunLog, smoothing: float) -> Panel:
    keys = {name: log.key(name) for name, _ in _TESTS}
    if all(k is None for k in keys.values()):
        return _untracked("gradtests", "Gradient tests", "Gradients",
                          "NormTest / InnerTest / OrthoTest")
    panel = Panel(
        "gradtests", "Gradient tests", "Gradients", xlabel="along true gradient",
        ylabel="orthogonal", equal=True,
    )
    last: dict[str, float] = {}
    colors = {"NormTest": COLORS["blue"], "InnerTest": COLORS["orange"],
              "OrthoTest": COLORS["green"]}
    for name, label in _TESTS:
        k = keys[name]
        child = Panel(f"gradtests.{name}", label, "Gradients", ylabel="test value")
        if k is None:
            child.tracked = False
            child.note = f"not tracked (add {name})"
        else:
            x, y = log.scalar(k)
            child.series = _line(x, y, label, colors[name], smoothing)
            child.shapes = [Shape("hline", {"y": 1.0}, color=COLORS["red"], label="threshold",
                                  dashed=True)]
            last[name] = tail_last(ema(y, smoothing))
            child.info = f"{_fmt(tail_last(y))}"
        panel.children.append(child)
    r = max([1.0, *[v for v in last.values() if math.isfinite(v)]])
    panel.xlim = (1 - 1.15 * r, 1 + 1.15 * r)
    panel.ylim = (-1.15 * r, 1.15 * r)
    panel.shapes.append(Shape("circle", {"cx": 1.0, "cy": 0.0, "r": 1.0}, color=COLORS["grey"],
                              label="pass region (value 1)", dashed=True, fill=False))
    if math.isfinite(last.get("OrthoTest", math.nan)):
        v = last["OrthoTest"]
        panel.shapes.append(Shape("hband", {"y0": -v, "y1": v}, color=COLORS["green"],
                                  label=f"orthogonality {_fmt(v)}"))
    if math.isfinite(last.get("InnerTest", math.nan)):
        v = last["InnerTest"]
        panel.shapes.append(Shape("vband", {"x0": 1 - v, "x1": 1 + v}, color=COLORS["orange"],
                                  label=f"inner product {_fmt(v)}"))
    if math.isfinite(last.get("NormTest", math.nan)):
        v = last["NormTest"]
        panel.shapes.append(Shape("circle", {"cx": 1.0, "cy": 0.0, "r": v}, color=COLORS["blue"],
                                  label=f"norm {_fmt(v)}"))
    panel.series = [
        Series("origin", [0.0], [0.0], style="markers", color="#333333"),
        Series("true gradient", [1.0], [0.0], style="markers", color=COLORS["red"]),
    ]
    failing = [lbl.split("-")[0].split(" ")[0] for (name, lbl) in _TESTS if last.get(name, 0) > 1]
    panel.info = ("failing: " + ", ".join(failing)) if failing else "all tests pass"
    return panel


def _hist1d_panel(log: RunLog) -> Panel:
    key = log.key("GradHist1d")
    hists = log.histograms(key) if key else []
    hists = [h for h in hists if h[1].ndim == 1 and h[2][0].size == h[1].size + 1]
    if not hists:
        return _untracked("hist1d", "Gradient histogram", "Gradients", "GradHist1d")
    step, hist, (edges,) = hists[-1]
    panel = Panel(
        "hist1d", f"Gradient histogram (step {step})", "Gradients",
        xlabel="gradient element", ylabel="count", ylog=bool(hist.max() > 0),
    )
    if len(hists) > 1 and hists[0][2][0].size == hists[0][1].size + 1:
        s0, h0, (e0,) = hists[0]
        panel.series.append(Series(f"step {s0}", _lst(e0), _lst(h0), style="bars",
                                   color=COLORS["grey"], faint=True))
    panel.series.append(Series(f"step {step}", _lst(edges), _lst(hist), style="bars",
                               color=COLORS["blue"]))
    panel.info = f"{int(hist.sum())} elements"
    return panel


def _hist2d_panel(log: RunLog) -> Panel:
    key = log.key("GradHist2d")
    hists = log.histograms(key) if key else []
    hists = [h for h in hists if h[1].ndim == 2 and len(h[2]) == 2]
    if not hists:
        return _untracked("hist2d", "Gradient vs. parameter", "Gradients", "GradHist2d")
    step, hist, (xe, ye) = hists[-1]
    panel = Panel(
        "hist2d", f"Gradient vs. parameter (step {step})", "Gradients", kind="heat",
        xlabel="gradient element", ylabel="parameter value",
    )
    panel.heat = {"z": hist.tolist(), "xedges": _lst(xe), "yedges": _lst(ye), "log": True}
    panel.info = f"{int(hist.sum())} elements"
    return panel


# ---------------------------------------------------------------------------- curvature
def _maxev_panel(log: RunLog, smoothing: float) -> Panel:
    panel = _scalar_panel(log, "maxev", "Max. Hessian eigenvalue", "Curvature", ("HessMaxEV",),
                          "λ_max", smoothing)
    if panel.tracked:
        x, lr = log.metric("learning_rate")
        ok = np.isfinite(lr) & (lr > 0)
        if ok.any():
            panel.series.append(Series("stability limit 2/η", _lst(x[ok]), _lst(2 / lr[ok]),
                                       style="step", color=COLORS["red"], dashed=True))
    return panel


def _gsnr_panel(log: RunLog, smoothing: float) -> Panel:
    gk, ek = log.key("MeanGSNR"), log.key("EarlyStopping")
    if gk is None and ek is None:
        return _untracked("gsnr", "GSNR & early stopping", "Curvature",
                          "MeanGSNR / EarlyStopping")
    panel = Panel("gsnr", "GSNR & early stopping", "Curvature")
    info = []
    if gk is not None:
        x, y = log.scalar(gk)
        panel.series += _line(x, y, "mean GSNR", COLORS["brown"], smoothing)
        panel.ylabel = "mean GSNR"
        info.append(f"GSNR = {_fmt(tail_last(y))}")
    if ek is not None:
        x, y = log.scalar(ek)
        axis = "right" if gk is not None else "left"
        panel.series += _line(x, y, "early-stopping criterion", COLORS["red"], smoothing, axis)
        if axis == "right":
            panel.ylabel2 = "EB criterion"
        else:
            panel.ylabel = "EB criterion"
        panel.shapes.append(Shape("hline", {"y": 0.0}, color=COLORS["grey"], dashed=True,
                                  label="stop when > 0"))
        info.append(f"EB = {_fmt(tail_last(y))}")
    panel.info = ", ".join(info)
    return panel


# ---------------------------------------------------------------------------- performance
def _performance_panel(log: RunLog, smoothing: float) -> Panel:
    lk = log.keys_of("Loss")
    metrics = [m for m in log.metrics() if m != "learning_rate"]
    if not lk and not metrics:
        return _untracked("performance", "Performance", "Performance",
                          "Loss / monitor.log(train_loss=..., valid_accuracy=...)")
    panel = Panel("performance", "Performance", "Performance", ylabel="loss")
    info = []
    for i, k in enumerate(lk):
        x, y = log.scalar(k)
        panel.series += _line(x, y, "mini-batch loss" if i == 0 else k, COLORS["blue"], smoothing)
        info.append(f"loss = {_fmt(tail_last(ema(y, smoothing)))}")
    styles = {
        "train_loss": (COLORS["green"], "left"),
        "valid_loss": (COLORS["orange"], "left"),
        "train_accuracy": (COLORS["green"], "right"),
        "valid_accuracy": (COLORS["orange"], "right"),
    }
    for m in metrics:
        x, y = log.metric(m)
        color, axis = styles[m]
        panel.series.append(Series(m.replace("_", " "), _lst(x), _lst(y), style="markers",
                                   color=color, axis=axis, dashed=axis == "right"))
        info.append(f"{m.replace('_', ' ')} = {_fmt(tail_last(y))}")
        if axis == "right":
            panel.ylabel2 = "accuracy"
    panel.info = ", ".join(info)
    return panel


def _other_panels(log: RunLog, smoothing: float) -> list[Panel]:
    out = []
    for k in log.tracked:
        if base_name(k) in KNOWN_QUANTITIES or is_auxiliary(k):
            continue
        x, y = log.scalar(k)
        if not np.isfinite(y).any():
            continue
        p = Panel(f"other.{k}", k, "Other")
        p.series = _line(x, y, k, COLORS["blue"], smoothing)
        p.info = f"{k} = {_fmt(tail_last(y))}"
        out.append(p)
    return out


def build_panels(log: RunLog, smoothing: float = 0.6) -> list[Panel]:
    """All panels of the instrument panel for ``log``, in layout order.

    Order: step size (``alpha``, ``distance``, ``gradnorm``, ``hyperparameters``), gradients
    (``gradtests``, ``hist1d``, ``hist2d``), curvature (``maxev``, ``trace``, ``tic``, ``gsnr``),
    ``performance``, then one panel per unknown scalar quantity (group ``Other``).
    """
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    return [
        _alpha_panel(log),
        _distance_panel(log, smoothing),
        _scalar_panel(log, "gradnorm", "Gradient norm", "Step size", ("GradNorm",), "‖g‖",
                      smoothing),
        _hyper_panel(log, smoothing),
        _tests_panel(log, smoothing),
        _hist1d_panel(log),
        _hist2d_panel(log),
        _maxev_panel(log, smoothing),
        _scalar_panel(log, "trace", "Hessian trace", "Curvature", ("HessTrace",), "tr(H)",
                      smoothing),
        _scalar_panel(log, "tic", "Takeuchi information criterion", "Curvature",
                      ("TICDiag", "TICTrace"), "TIC", smoothing),
        _gsnr_panel(log, smoothing),
        _performance_panel(log, smoothing),
        *_other_panels(log, smoothing),
    ]
