"""Extensions: what ``backprism.collect`` computes and stores on each parameter."""

from backprism.extensions.base import Extension, FirstOrderExtension, SecondOrderExtension
from backprism.extensions.firstorder import (
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    SumGradSquared,
    Variance,
)
from backprism.extensions.kronecker import KFAC, KFLR, KFRA
from backprism.extensions.secondorder import (
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
)

__all__ = [
    "KFAC",
    "KFLR",
    "KFRA",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "BatchDotGrad",
    "BatchGrad",
    "BatchL2Grad",
    "DiagGGNExact",
    "DiagGGNMC",
    "Extension",
    "FirstOrderExtension",
    "SecondOrderExtension",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "SumGradSquared",
    "Variance",
]
