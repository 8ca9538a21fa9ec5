"""Extensions: what ``backprism.collect`` computes and stores on each parameter."""

from backprism.extensions.base import Extension, FirstOrderExtension, SecondOrderExtension
from backprism.extensions.firstorder import (
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    SumGradSquared,
    Variance,
)
from backprism.extensions.hessian import BatchDiagHessian, DiagHessian, HutchinsonDiagHessian
from backprism.extensions.kronecker import KFAC, KFLR, KFRA
from backprism.extensions.matprod import GGNMP, HMP, PCHMP
from backprism.extensions.projections import BatchDotWith, BatchProjGrad, GradHist
from backprism.extensions.secondorder import (
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
)

__all__ = [
    "GGNMP",
    "HMP",
    "KFAC",
    "KFLR",
    "KFRA",
    "PCHMP",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "BatchDiagHessian",
    "BatchDotGrad",
    "BatchDotWith",
    "BatchGrad",
    "BatchL2Grad",
    "BatchProjGrad",
    "DiagGGNExact",
    "DiagGGNMC",
    "DiagHessian",
    "Extension",
    "FirstOrderExtension",
    "GradHist",
    "HutchinsonDiagHessian",
    "SecondOrderExtension",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "SumGradSquared",
    "Variance",
]
