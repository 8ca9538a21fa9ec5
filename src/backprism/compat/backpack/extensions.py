"""BackPACK's ``backpack.extensions`` namespace, re-exporting backprism's extensions."""

from __future__ import annotations

import importlib

from backprism.extensions import *  # noqa: F403
from backprism.extensions import __all__ as _core

__all__ = list(_core)

# second-order families that live in their own modules
for _mod, _names in (
    ("backprism.extensions.hessian", ("DiagHessian", "BatchDiagHessian")),
    ("backprism.extensions.matprod", ("HMP", "GGNMP", "PCHMP")),
    ("backprism.extensions.kronecker", ("KFAC", "KFLR", "KFRA")),
):
    try:
        _m = importlib.import_module(_mod)
    except ImportError:  # pragma: no cover - family not installed
        continue
    for _n in _names:
        if hasattr(_m, _n) and _n not in globals():
            globals()[_n] = getattr(_m, _n)
            __all__.append(_n)
