"""Terminal summary of a monitor log: last values and diagnostics.

The diagnostics look at the last 20% of tracked steps (``tail``):

* median α > 1 → learning rate likely too large (steps overshoot the local minimum);
  median α < −0.5 → learning rate likely too small;
* median of a gradient test > 1 → batch too small for that test (gradient too noisy);
* non-finite loss → diverged; smoothed loss in the tail above the head → not decreasing;
* validation loss rising while the training loss falls → overfitting;
* ``η · λ_max > 2`` → beyond the stability limit of gradient descent on a quadratic;
* early-stopping criterion > 0 → stop.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from backprism.plot.logdata import RunLog, base_name, is_auxiliary, load
from backprism.plot.panels import tail_last, tail_median

__all__ = ["diagnose", "inspect_log"]

_TESTS = (("NormTest", "norm test"), ("InnerTest", "inner-product test"),
          ("OrthoTest", "orthogonality test"))


def _head_tail(y: np.ndarray, fraction: float = 0.2) -> tuple[float, float]:
    f = y[np.isfinite(y)]
    if f.size < 5:
        return math.nan, math.nan
    k = max(1, math.ceil(fraction * f.size))
    return float(np.mean(f[:k])), float(np.mean(f[-k:]))


def diagnose(log: RunLog, fraction: float = 0.2) -> list[str]:
    """Human-readable warnings about the run (empty list when nothing looks wrong)."""
    pct = f"{round(100 * fraction)}%"
    out: list[str] = []
    k = log.key("Alpha")
    if k is not None:
        med = tail_median(log.scalar(k)[1], fraction)
        if med > 1:
            out.append(f"α > 1 for the last {pct} of steps (median {med:.2g}): "
                       "learning rate likely too large")
        elif med < -0.5:
            out.append(f"α < -0.5 for the last {pct} of steps (median {med:.2g}): "
                       "learning rate likely too small")
    failing = []
    for name, label in _TESTS:
        k = log.key(name)
        if k is not None:
            med = tail_median(log.scalar(k)[1], fraction)
            if med > 1:
                failing.append(f"{label} {med:.2g}")
    if failing:
        out.append(f"gradient tests fail ({', '.join(failing)} > 1 over the last {pct}): "
                   "batch too small")
    k = log.key("Loss")
    if k is not None:
        y = log.scalar(k)[1]
        if y.size and not np.isfinite(y[-max(1, math.ceil(fraction * y.size)) :]).all():
            out.append("loss is NaN/inf: training diverged")
        else:
            head, tail = _head_tail(y, fraction)
            if math.isfinite(head) and tail >= head:
                out.append(f"loss is not decreasing (first {pct}: {head:.3g}, "
                           f"last {pct}: {tail:.3g})")
    _, vl = log.metric("valid_loss")
    _, tl = log.metric("train_loss")
    if vl.size >= 3 and tl.size >= 3:
        best = int(np.nanargmin(vl))
        if best < vl.size - 1 and vl[-1] > vl[best] * 1.05 and tl[-1] < tl[best]:
            out.append("validation loss rises while training loss falls: overfitting")
    k = log.key("HessMaxEV")
    _steps_lr, lr = log.metric("learning_rate")
    if k is not None and lr.size:
        lam = tail_last(log.scalar(k)[1])
        eta = tail_last(lr)
        if math.isfinite(lam * eta) and lam * eta > 2:
            out.append(f"η·λ_max = {lam * eta:.3g} > 2: beyond the stability limit, "
                       "learning rate likely too large")
    k = log.key("EarlyStopping")
    if k is not None:
        v = tail_last(log.scalar(k)[1])
        if v > 0:
            out.append(f"early-stopping criterion is positive ({v:.3g}): consider stopping")
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else "nan"
    return str(v)


def inspect_log(source: Any, fraction: float = 0.2) -> str:
    """Multi-line terminal summary: run size, last value of every quantity and metric, and
    the warnings of :func:`diagnose`."""
    log = load(source)
    lines = []
    name = log.source or "monitor output"
    lines.append(f"backprism log: {name}")
    last = log.last_step
    lines.append(f"  tracked steps: {log.num_steps}" + (f", last step: {last}" if last is not None
                                                        else ""))
    if log.truncated:
        lines.append("  (last line was cut off and ignored)")
    epochs = [r.get("epoch") for r in log.records if r.get("epoch") is not None]
    if epochs:
        lines.append(f"  epochs: {max(epochs) + 1 if min(epochs) == 0 else max(epochs)}")
    lines.append("")
    lines.append("  quantity              tracked  last value")
    for key in log.quantities:
        series = log.series(key)
        if not series:
            lines.append(f"  {key:<21} {0:>7}  (not tracked yet)")
            continue
        value = series[-1][1]
        if isinstance(value, dict) and "hist" not in value:
            shown = "fit record" if is_auxiliary(key) else _fmt(float(log.scalar(key)[1][-1]))
        elif isinstance(value, dict):
            shown = f"histogram, {int(np.asarray(value.get('hist', []), dtype=float).sum())} counts"
        elif base_name(key) == "Time":
            _, t = log.scalar(key)
            t = t[np.isfinite(t)]
            shown = f"{t[-1] - t[0]:.4g} s elapsed" if t.size else "nan"
        elif base_name(key) == "Parameters":
            shown = f"{len(value) if isinstance(value, list) else 1} parameter tensors"
        else:
            _, y = log.scalar(key)
            shown = _fmt(float(y[-1]))
            if isinstance(value, list):
                shown += f" (over {len(value)} parameters)"
        lines.append(f"  {key:<21} {len(series):>7}  {shown}")
    tk = log.key("Time")
    if tk is not None:
        x, t = log.scalar(tk)
        ok = np.isfinite(t)
        if ok.sum() >= 2 and t[ok][-1] > t[ok][0]:
            rate = (x[ok][-1] - x[ok][0]) / (t[ok][-1] - t[ok][0])
            lines.append(f"  speed: {rate:.3g} steps/s")
    metrics = log.metrics()
    if metrics:
        lines.append("")
        lines.append("  metric                last value")
        for m in metrics:
            _, y = log.metric(m)
            lines.append(f"  {m:<21} {_fmt(tail_last(y))}")
    warnings = diagnose(log, fraction)
    lines.append("")
    if warnings:
        lines.append("  warnings:")
        lines.extend(f"  ! {w}" for w in warnings)
    else:
        lines.append("  no warnings")
    return "\n".join(lines)
