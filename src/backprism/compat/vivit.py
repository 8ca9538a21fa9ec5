"""ViViT-compatible names: ``backprism.compat.vivit`` mirrors ``vivit``'s public paths.

================================================  ==========================================
ViViT                                             ``backprism.spectral``
================================================  ==========================================
``vivit.linalg.eigvalsh.EigvalshComputation``     ``EigvalshComputation``
``vivit.linalg.eigh.EighComputation``             ``EighComputation``
``vivit.optim.directional_derivatives.…``         ``DirectionalDerivativesComputation``
``vivit.optim.directional_damped_newton.…``       ``DirectionalDampedNewtonComputation``
================================================  ==========================================

All four are also available as ``backprism.compat.vivit.<Name>`` (ViViT's top-level names).

Use with ``backprism.collect`` in place of ``backpack.backpack``::

    from backprism.compat.vivit.linalg.eigh import EighComputation
    with backprism.collect(comp.get_extension(), extension_hook=comp.get_extension_hook(groups)):
        loss.backward()

The sub-modules (``linalg``, ``linalg.eigh``, ``linalg.eigvalsh``, ``optim``,
``optim.directional_derivatives``, ``optim.directional_damped_newton``) are registered in
``sys.modules`` so that ``from backprism.compat.vivit.linalg.eigh import EighComputation`` works.
"""

from __future__ import annotations

import sys
import types

from backprism.spectral import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    EigvalshComputation,
)

__all__ = [
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivativesComputation",
    "EighComputation",
    "EigvalshComputation",
    "linalg",
    "optim",
]


def _module(name: str, doc: str, **attrs: object) -> types.ModuleType:
    full = f"{__name__}.{name}"
    mod = types.ModuleType(full, doc)
    mod.__dict__.update(attrs)
    mod.__all__ = sorted(k for k in attrs if not isinstance(attrs[k], types.ModuleType))  # type: ignore[attr-defined]
    sys.modules[full] = mod
    return mod


_eigh = _module("linalg.eigh", "GGN eigenpairs (ViViT path).", EighComputation=EighComputation)
_eigvalsh = _module(
    "linalg.eigvalsh", "GGN eigenvalues (ViViT path).", EigvalshComputation=EigvalshComputation
)
linalg = _module(
    "linalg", "GGN eigenvalues and eigenpairs (ViViT path).",
    eigh=_eigh, eigvalsh=_eigvalsh,
    EighComputation=EighComputation, EigvalshComputation=EigvalshComputation,
)
_dd = _module(
    "optim.directional_derivatives", "Directional derivatives (ViViT path).",
    DirectionalDerivativesComputation=DirectionalDerivativesComputation,
)
_ddn = _module(
    "optim.directional_damped_newton", "Directionally damped Newton steps (ViViT path).",
    DirectionalDampedNewtonComputation=DirectionalDampedNewtonComputation,
)
optim = _module(
    "optim", "Directional derivatives and damped Newton steps (ViViT path).",
    directional_derivatives=_dd, directional_damped_newton=_ddn,
    DirectionalDerivativesComputation=DirectionalDerivativesComputation,
    DirectionalDampedNewtonComputation=DirectionalDampedNewtonComputation,
)
__path__: list[str] = []  # lets the import system treat this module as a package
