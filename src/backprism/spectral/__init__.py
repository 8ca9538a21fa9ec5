"""Curvature through the GGN's low-rank structure (ViViT): ``GGN = V Vᵀ``, Gram matrix
``G = VᵀV``, eigenvalues, eigenvectors, directional derivatives and damped Newton steps.

>>> comp = EigvalshComputation()
>>> group = {"params": list(model.parameters())}
>>> with backprism.collect(comp.get_extension(), extension_hook=comp.get_extension_hook([group])):
...     loss.backward()
>>> evals = comp.get_result(group)
"""

from backprism.spectral.computations import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    EigvalshComputation,
)
from backprism.spectral.optim import ConstantDamping, DampedNewton

__all__ = [
    "ConstantDamping",
    "DampedNewton",
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivativesComputation",
    "EighComputation",
    "EigvalshComputation",
]
