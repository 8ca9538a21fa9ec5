r"""Pre-defined quantity sets (Cockpit's ``configuration``) with default schedules.

========== ===============================================================================
label      quantities
========== ===============================================================================
economy    Alpha, Distance, GradHist1d, GradNorm, InnerTest, Loss, NormTest, OrthoTest,
           UpdateSize
business   economy + TICDiag, HessTrace
full       business + HessMaxEV, GradHist2d
========== ===============================================================================

**Default schedules** (``track_schedule=None``). Each quantity is tracked as often as its cost
allows, so that the monitor costs little on average (:data:`DEFAULT_INTERVALS`; every schedule
also includes step 0):

* every step: Loss, GradNorm, Distance, UpdateSize (norms of tensors the step has anyway);
* every 10th step: Alpha (starts there, ends one step later), NormTest, InnerTest, OrthoTest,
  GradHist1d (per-sample statistics, one pass over the layers' inputs and output gradients);
* every 100th step: TICDiag, HessTrace (curvature: backpropagated loss-Hessian columns);
* every 200th step: HessMaxEV, GradHist2d (Hessian-vector products; a 2d histogram of every
  per-sample gradient element).

Pass ``track_schedule=schedules.linear(1)`` for Cockpit's behaviour (every quantity at every
step). :meth:`Monitor.cost_estimate <backprism.monitor.Monitor.cost_estimate>` measures the cost
of any set of quantities and schedules on your own model.

**Curvature** (``curvature=``) of HessTrace and TICDiag: ``"diag_h"`` (Cockpit's default, the
exact Hessian), ``"diag_ggn_exact"``, ``"diag_ggn_mc"``, or for HessTrace ``"hutchinson"``
(a dict ``{"HessTrace": ..., "TICDiag": ...}`` sets them separately). HessTrace needs no
diagonal (:mod:`backprism.monitor.quantities.curvature`); TICDiag does.

**Measured cost** on cifar10_3c3d (CPU, 2 threads, N = 128, ``benchmarks/bench_monitor.py``;
ratio to a plain training step; taken on a machine shared with other jobs, so indicative only:
repeated runs differed by up to ±30 %, and by more for the configurations). Per step, i.e.
tracked at every step, each variant against the plain step in its own process:

=============================  ========  ===============  ============  ============
quantity                       diag_h    diag_ggn_exact   diag_ggn_mc   hutchinson
=============================  ========  ===============  ============  ============
HessTrace (trace, no diag.)    6.3×      7.4×             1.5×          2.9×
TICTrace (trace, no diag.)     7.2×      —                2.3×          —
TICDiag (diagonal)             11.3×     —                2.3×          —
=============================  ========  ===============  ============  ============

(before the trace closed forms: HessTrace 8.6×, TICTrace 9.4× with ``diag_h``; on this ReLU
network ``diag_h`` and ``diag_ggn_exact`` do the same work.) Configurations at every step:
economy 2.4–4.2×, business 15–17× (``diag_ggn_mc``: 3.3–4.1×), full 18–19× (``diag_ggn_mc``:
12–28×; HessMaxEV alone costs 9×). With the **default schedules**, amortised over steps
0–999 (:func:`~backprism.monitor.cost.cost_estimate`, process CPU time): economy 1.22×,
business 1.21×, full 1.35×.
"""

from __future__ import annotations

from typing import Any

from backprism.monitor import quantities, schedules
from backprism.monitor.quantities.base import Quantity, Schedule

__all__ = [
    "DEFAULT_INTERVALS",
    "TRACKED",
    "configuration",
    "default_schedule",
    "quantities_cls_for_configuration",
]

#: tracking interval of each quantity under the default schedules (steps ``0, k, 2k, …``)
DEFAULT_INTERVALS: dict[str, int] = {
    "Loss": 1,
    "GradNorm": 1,
    "Distance": 1,
    "UpdateSize": 1,
    "Time": 1,
    "Parameters": 1,
    "Alpha": 10,
    "NormTest": 10,
    "InnerTest": 10,
    "OrthoTest": 10,
    "GradHist1d": 10,
    "MeanGSNR": 10,
    "CABS": 10,
    "EarlyStopping": 10,
    "TICDiag": 100,
    "TICTrace": 100,
    "HessTrace": 100,
    "HessMaxEV": 200,
    "GradHist2d": 200,
}


#: the quantities a training run tracks (every quantity class but the bookkeeping ones,
#: ``Time`` and ``Parameters``), in the order of :data:`DEFAULT_INTERVALS`
TRACKED: tuple[str, ...] = tuple(n for n in DEFAULT_INTERVALS if n not in ("Time", "Parameters"))


def default_schedule(name: str) -> Schedule:
    """The default schedule of the quantity class ``name`` (:data:`DEFAULT_INTERVALS`)."""
    return schedules.linear(DEFAULT_INTERVALS.get(name, 1))


def quantities_cls_for_configuration(label: str) -> list[type[Quantity]]:
    """Quantity classes of a configuration (least to most expensive):

    * ``"economy"``: Alpha, Distance, GradHist1d, GradNorm, InnerTest, Loss, NormTest,
      OrthoTest, UpdateSize;
    * ``"business"``: economy + TICDiag, HessTrace;
    * ``"full"``: business + HessMaxEV, GradHist2d.
    """
    economy: list[type[Quantity]] = [
        quantities.Alpha,
        quantities.Distance,
        quantities.GradHist1d,
        quantities.GradNorm,
        quantities.InnerTest,
        quantities.Loss,
        quantities.NormTest,
        quantities.OrthoTest,
        quantities.UpdateSize,
    ]
    business = [*economy, quantities.TICDiag, quantities.HessTrace]
    full = [*business, quantities.HessMaxEV, quantities.GradHist2d]
    configs = {"economy": economy, "business": business, "full": full}
    try:
        return list(configs[label])
    except KeyError:
        raise KeyError(f"unknown configuration {label!r}; choose one of {list(configs)}") from None


def _curvatures(curvature: str | dict[str, str] | None) -> dict[str, str]:
    if curvature is None:
        return {}
    if isinstance(curvature, dict):
        unknown = set(curvature) - {"HessTrace", "TICDiag"}
        if unknown:
            raise KeyError(f"curvature= sets HessTrace and TICDiag, got {sorted(unknown)}")
        return dict(curvature)
    if curvature == "hutchinson":
        raise ValueError(
            "curvature='hutchinson' exists for HessTrace only (TICDiag needs a diagonal): pass "
            "curvature={'HessTrace': 'hutchinson', 'TICDiag': 'diag_ggn_mc'}"
        )
    return {"HessTrace": curvature, "TICDiag": curvature}


def configuration(
    label: str,
    track_schedule: Schedule | None = None,
    verbose: bool = False,
    curvature: str | dict[str, str] | None = None,
) -> list[Quantity]:
    """Instantiated quantities of configuration ``label`` (``"economy"``, ``"business"`` or
    ``"full"``) with their default hyperparameters.

    Args:
        label: the configuration.
        track_schedule: one schedule for all quantities (``schedules.linear(1)``: every step,
            Cockpit's behaviour); ``None`` (default): each quantity's default schedule
            (module doc).
        verbose: print values.
        curvature: curvature of HessTrace and TICDiag (module doc); default ``"diag_h"``.
    """
    chosen = _curvatures(curvature)
    out = []
    for cls in quantities_cls_for_configuration(label):
        schedule = default_schedule(cls.__name__) if track_schedule is None else track_schedule
        kwargs: dict[str, Any] = {}
        if cls.__name__ in chosen:
            kwargs["curvature"] = chosen[cls.__name__]
        out.append(cls(track_schedule=schedule, verbose=verbose, **kwargs))
    return out
