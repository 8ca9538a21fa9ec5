"""Pre-defined quantity sets (Cockpit's ``configuration``)."""

from __future__ import annotations

from backprism.monitor import quantities, schedules
from backprism.monitor.quantities.base import Quantity, Schedule

__all__ = ["configuration", "quantities_cls_for_configuration"]


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


def configuration(
    label: str, track_schedule: Schedule | None = None, verbose: bool = False
) -> list[Quantity]:
    """Instantiated quantities of configuration ``label`` (``"economy"``, ``"business"`` or
    ``"full"``) with their default hyperparameters, all on ``track_schedule`` (default: every
    step, ``schedules.linear(1)``)."""
    if track_schedule is None:
        track_schedule = schedules.linear(interval=1, offset=0)
    return [
        cls(track_schedule=track_schedule, verbose=verbose)
        for cls in quantities_cls_for_configuration(label)
    ]
