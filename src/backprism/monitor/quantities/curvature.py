r"""Curvature quantities: Hessian trace and TIC, with a choice of curvature.

``curvature`` selects the loss Hessian or an approximation of it (Cockpit's choice):

* ``"diag_h"`` — the exact Hessian (default; GGN plus the residual terms of elementwise
  nonlinearities, refused where ``DiagHessian`` is),
* ``"diag_ggn_exact"`` — the generalized Gauss-Newton matrix (exact, ``C`` backpropagated
  columns per sample),
* ``"diag_ggn_mc"`` — its Monte-Carlo estimate with one sampled label (one extra backward pass),
* ``"hutchinson"`` (HessTrace only) — the exact Hessian's trace estimated by Hutchinson's
  method, ``tr(H_p) ≈ (1/S) Σₛ v_{s,p}ᵀ (H vₛ)_p`` with Rademacher ``vₛ`` over all parameters
  (``samples = S``, default 1): unbiased, ``Var = (2/S) Σ_{i≠j in p, j} H_{ij}²``-type noise;
  works on any twice-differentiable graph (``HutchinsonDiagHessian``, ``1 + 2S`` extra backward
  passes, no ``create_graph`` needed from the caller).

**Traces need no diagonal.** HessTrace and TICTrace only need per-parameter traces, which the
monitor computes with :mod:`backprism.monitor.traces`: ``tr(GGN_p) = Σ_{k,n} ‖V[k, n]_p‖²``
from the layer rules' norm closed forms (Linear ``‖δ‖²‖x‖²``, convolutions' Gram form)
instead of squaring every element of the per-sample, per-column gradients. When a diagonal of
the same curvature is computed in the same pass anyway (TICDiag next to HessTrace), the trace
is read from it. TICDiag needs the diagonal itself.

With the engine's ``sum_grad_squared = Σₙ (gₙ/N)²`` (``gₙ = ∇ℓₙ``, mean reduction), the
uncentered gradient second moment is ``(1/N)Σₙ gₙ² = N · sum_grad_squared``:

* **HessTrace** — per parameter ``Tr_p = Σ_i c_{p,i}``, a list of floats (Cockpit's format).
* **TICDiag** — ``Σ_i N·sum_grad_squared_i / (c_i + ε)`` over all parameters, ``ε = 1e-7``.
* **TICTrace** — ``Σ_i N·sum_grad_squared_i / (Σ_i c_i + ε)``; the numerator is
  ``N Σₙ batch_l2[n]`` (squared per-sample gradient norms, closed forms).

(Takeuchi information criterion, Thomas et al., 2019.) All values are computed on the device
and reach the host with the other values of the step.

Cost on cifar10_3c3d (CPU, N = 128, ratio to a plain step, indicative; ReLU network, so
``diag_h`` and ``diag_ggn_exact`` cost the same there): see
:mod:`backprism.monitor.configuration` for the measured table.
"""

from __future__ import annotations

from typing import Any

import torch

from backprism.extensions import (
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    HutchinsonDiagHessian,
    SumGradSquared,
)
from backprism.extensions.base import Extension
from backprism.monitor.quantities.base import (
    Pending,
    Schedule,
    SingleStepQuantity,
    StepData,
    flat_cat,
)
from backprism.monitor.traces import GGNTrace, HessianTrace

__all__ = [
    "CURVATURES",
    "TRACE_CURVATURES",
    "HessTrace",
    "TICDiag",
    "TICTrace",
    "curvature_extension",
    "trace_extension",
]

CURVATURES = ("diag_h", "diag_ggn_exact", "diag_ggn_mc")
TRACE_CURVATURES = (*CURVATURES, "hutchinson")


def curvature_extension(curvature: str) -> Extension:
    """The engine extension computing the diagonal named ``curvature``."""
    if curvature == "diag_ggn_exact":
        return DiagGGNExact()
    if curvature == "diag_ggn_mc":
        return DiagGGNMC()
    if curvature == "diag_h":
        from backprism.extensions import DiagHessian

        return DiagHessian()
    raise KeyError(f"'{curvature}'. Available: {list(CURVATURES)}")


def trace_extension(curvature: str, samples: int = 1) -> Extension:
    """The extension giving per-parameter traces of ``curvature`` (0-dim results, or a
    Hutchinson diagonal estimate whose sum is the trace estimate)."""
    if curvature == "diag_ggn_exact":
        return GGNTrace()
    if curvature == "diag_ggn_mc":
        return GGNTrace(mc_samples=1)
    if curvature == "diag_h":
        return HessianTrace()
    if curvature == "hutchinson":
        return HutchinsonDiagHessian(samples=samples)
    raise KeyError(f"'{curvature}'. Available: {list(TRACE_CURVATURES)}")


def _check_curvature(curvature: str, allowed: tuple[str, ...] = CURVATURES) -> str:
    if curvature not in allowed:
        raise KeyError(f"'{curvature}'. Available: {list(allowed)}")
    return curvature


def _traces(parts: list[torch.Tensor]) -> torch.Tensor:
    """``[Σ t for t in parts]`` in float64 on the first part's device."""
    ref = parts[0]
    return torch.stack([t.double().sum().to(ref.device) for t in parts])


class HessTrace(SingleStepQuantity):
    """Per-parameter trace of the (approximate) Hessian, ``[Tr_p for p]`` (list of floats).

    Args:
        track_schedule: steps at which it is computed.
        verbose: print values.
        curvature: ``"diag_h"`` (default), ``"diag_ggn_exact"``, ``"diag_ggn_mc"`` or
            ``"hutchinson"`` (module doc).
        samples: Rademacher vectors of the Hutchinson estimate (``curvature="hutchinson"``).
    """

    per_sample = False

    def __init__(
        self,
        track_schedule: Schedule,
        verbose: bool = False,
        curvature: str = "diag_h",
        samples: int = 1,
    ) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._curvature = _check_curvature(curvature, TRACE_CURVATURES)
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be a positive integer, got {samples!r}")
        self._samples = samples

    @property
    def needs_residual(self) -> bool:
        return self._curvature == "diag_h"

    def hyperparameters(self) -> dict[str, Any]:
        hp: dict[str, Any] = {"curvature": self._curvature}
        if self._curvature == "hutchinson":
            hp["samples"] = self._samples
        return hp

    def _ext(self) -> Extension:
        return trace_extension(self._curvature, self._samples)

    def extensions(self, global_step: int) -> list[Extension]:
        if not self.should_compute(global_step):
            return []
        return [self._ext()]

    def _compute(self, global_step: int, data: StepData) -> Pending:
        return Pending.floats(_traces(data.fetch(self._ext())))


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

    @property
    def needs_residual(self) -> bool:
        return self._curvature == "diag_h"

    def hyperparameters(self) -> dict[str, Any]:
        return {"curvature": self._curvature, "epsilon": self._epsilon}

    def info_keys(self, global_step: int) -> set[str]:
        return {"batch_size"} if self.should_compute(global_step) else set()


class TICDiag(_TIC):
    """TIC with a diagonal curvature: ``Σ_i N·sum_grad_squared_i / (c_i + ε)``.

    Args:
        curvature: ``"diag_h"`` (default), ``"diag_ggn_exact"``, ``"diag_ggn_mc"``.
        epsilon: stabilization ``ε`` (default ``1e-7``).
    """

    def extensions(self, global_step: int) -> list[Extension]:
        if not self.should_compute(global_step):
            return []
        return [SumGradSquared(), curvature_extension(self._curvature)]

    def _compute(self, global_step: int, data: StepData) -> Pending:
        sgs = flat_cat(data.fetch(SumGradSquared())).double()
        curv = flat_cat(data.fetch(curvature_extension(self._curvature))).double()
        n = data.batch_size_of(self)
        return Pending.scalar((n * sgs / (curv + self._epsilon)).sum())


class TICTrace(_TIC):
    """TIC with traces: ``N Σₙ batch_l2[n] / (Σ_i c_i + ε)`` (``= Σ_i N·sum_grad_squared_i /
    (Σ_i c_i + ε)``), the trace without the diagonal (module doc).

    Args:
        curvature: ``"diag_h"`` (default), ``"diag_ggn_exact"``, ``"diag_ggn_mc"``.
        epsilon: stabilization ``ε`` (default ``1e-7``).
    """

    def extensions(self, global_step: int) -> list[Extension]:
        if not self.should_compute(global_step):
            return []
        return [BatchL2Grad(), trace_extension(self._curvature)]

    def _compute(self, global_step: int, data: StepData) -> Pending:
        second = _traces(data.rows(BatchL2Grad())).sum()
        trace = _traces(data.fetch(trace_extension(self._curvature))).sum()
        n = data.batch_size_of(self)
        return Pending.scalar(n * second / (trace + self._epsilon))
