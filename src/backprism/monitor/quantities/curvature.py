r"""Curvature quantities from diagonal curvature approximations: Hessian trace and TIC.

``curvature`` selects the diagonal ``c`` of the loss Hessian (or of an approximation):

* ``"diag_h"`` — the exact Hessian diagonal (``DiagHessian``, attribute ``diag_h``; default),
* ``"diag_ggn_exact"`` — the GGN diagonal (``DiagGGNExact``),
* ``"diag_ggn_mc"`` — its Monte-Carlo estimate with one sampled label (``DiagGGNMC``).

With the engine's ``sum_grad_squared = Σₙ (gₙ/N)²`` (``gₙ = ∇ℓₙ``, mean reduction), the
uncentered gradient second moment is ``(1/N)Σₙ gₙ² = N · sum_grad_squared``:

* **HessTrace** — per parameter ``Tr_p = Σ_i c_{p,i}``, a list of floats (Cockpit's format).
* **TICDiag** — ``Σ_i N·sum_grad_squared_i / (c_i + ε)`` over all parameters, ``ε = 1e-7``.
* **TICTrace** — ``Σ_i N·sum_grad_squared_i / (Σ_i c_i + ε)``.

(Takeuchi information criterion, Thomas et al., 2019.)
"""

from __future__ import annotations

from typing import Any

from backprism.extensions import DiagGGNExact, DiagGGNMC, SumGradSquared
from backprism.extensions.base import Extension
from backprism.monitor.quantities.base import Schedule, SingleStepQuantity, StepData, flat_cat

__all__ = ["HessTrace", "TICDiag", "TICTrace", "curvature_extension"]

CURVATURES = ("diag_h", "diag_ggn_exact", "diag_ggn_mc")


def curvature_extension(curvature: str) -> Extension:
    """The engine extension computing the diagonal named ``curvature``."""
    if curvature == "diag_ggn_exact":
        return DiagGGNExact()
    if curvature == "diag_ggn_mc":
        return DiagGGNMC()
    if curvature == "diag_h":
        try:
            from backprism.extensions import DiagHessian  # type: ignore[attr-defined]
        except ImportError:
            try:
                from backprism.extensions.hessian import DiagHessian  # type: ignore[no-redef]
            except ImportError as err:
                raise RuntimeError(
                    "curvature='diag_h' needs backprism.extensions.DiagHessian, which is not "
                    "available in this installation; use curvature='diag_ggn_exact'"
                ) from err
        return DiagHessian()
    raise KeyError(f"'{curvature}'. Available: {list(CURVATURES)}")


def _check_curvature(curvature: str) -> str:
    if curvature not in CURVATURES:
        raise KeyError(f"'{curvature}'. Available: {list(CURVATURES)}")
    return curvature


class HessTrace(SingleStepQuantity):
    """Per-parameter trace of the (approximate) Hessian, ``[Σ_i c_{p,i} for p]``.

    Args:
        track_schedule: steps at which it is computed.
        verbose: print values.
        curvature: ``"diag_h"`` (default), ``"diag_ggn_exact"`` or ``"diag_ggn_mc"``.
    """

    per_sample = False

    def __init__(
        self, track_schedule: Schedule, verbose: bool = False, curvature: str = "diag_h"
    ) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._curvature = _check_curvature(curvature)

    def hyperparameters(self) -> dict[str, Any]:
        return {"curvature": self._curvature}

    def extensions(self, global_step: int) -> list[Extension]:
        if not self.should_compute(global_step):
            return []
        return [curvature_extension(self._curvature)]

    def _compute(self, global_step: int, data: StepData) -> list[float]:
        diag = data.fetch(curvature_extension(self._curvature))
        return [float(d.double().sum()) for d in diag]


class _TIC(SingleStepQuantity):
    per_sample = True

    def __init__(
        self,
        track_schedule: Schedule,
        verbose: bool = False,
        curvature: str = "diag_h",
        epsilon: float = 1e-7,
    ) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._curvature = _check_curvature(curvature)
        self._epsilon = epsilon

    def hyperparameters(self) -> dict[str, Any]:
        return {"curvature": self._curvature, "epsilon": self._epsilon}

    def extensions(self, global_step: int) -> list[Extension]:
        if not self.should_compute(global_step):
            return []
        return [SumGradSquared(), curvature_extension(self._curvature)]

    def info_keys(self, global_step: int) -> set[str]:
        return {"batch_size"} if self.should_compute(global_step) else set()

    def _fetch(self, data: StepData) -> tuple[Any, Any, int]:
        sgs = flat_cat(data.fetch(SumGradSquared())).double()
        curv = flat_cat(data.fetch(curvature_extension(self._curvature))).double()
        return sgs, curv, int(data.get("batch_size", self))


class TICDiag(_TIC):
    """TIC with a diagonal curvature: ``Σ_i N·sum_grad_squared_i / (c_i + ε)``.

    Args:
        curvature: ``"diag_h"`` (default), ``"diag_ggn_exact"``, ``"diag_ggn_mc"``.
        epsilon: stabilization ``ε`` (default ``1e-7``).
    """

    def _compute(self, global_step: int, data: StepData) -> float:
        sgs, curv, n = self._fetch(data)
        return float((n * sgs / (curv + self._epsilon)).sum())


class TICTrace(_TIC):
    """TIC with traces: ``Σ_i N·sum_grad_squared_i / (Σ_i c_i + ε)``.

    Args:
        curvature: ``"diag_h"`` (default), ``"diag_ggn_exact"``, ``"diag_ggn_mc"``.
        epsilon: stabilization ``ε`` (default ``1e-7``).
    """

    def _compute(self, global_step: int, data: StepData) -> float:
        sgs, curv, n = self._fetch(data)
        return float(n * sgs.sum() / (curv.sum() + self._epsilon))
