"""Monitor quantities (Cockpit's names, formulas, defaults and output formats)."""

from backprism.monitor.quantities import bin_adaptation
from backprism.monitor.quantities.alpha import Alpha
from backprism.monitor.quantities.base import (
    ByproductQuantity,
    Quantity,
    SingleStepQuantity,
    TwoStepQuantity,
)
from backprism.monitor.quantities.basic import (
    Distance,
    GradNorm,
    Loss,
    Parameters,
    Time,
    UpdateSize,
)
from backprism.monitor.quantities.curvature import HessTrace, TICDiag, TICTrace
from backprism.monitor.quantities.gradient_tests import InnerTest, NormTest, OrthoTest
from backprism.monitor.quantities.hess_max_ev import HessMaxEV
from backprism.monitor.quantities.hist import GradHist1d, GradHist2d
from backprism.monitor.quantities.snr import CABS, EarlyStopping, MeanGSNR

__all__ = [
    "CABS",
    "Alpha",
    "ByproductQuantity",
    "Distance",
    "EarlyStopping",
    "GradHist1d",
    "GradHist2d",
    "GradNorm",
    "HessMaxEV",
    "HessTrace",
    "InnerTest",
    "Loss",
    "MeanGSNR",
    "NormTest",
    "OrthoTest",
    "Parameters",
    "Quantity",
    "SingleStepQuantity",
    "TICDiag",
    "TICTrace",
    "Time",
    "TwoStepQuantity",
    "UpdateSize",
    "bin_adaptation",
]
