r"""Gradient tests for adaptive batch sizes: norm, inner-product and orthogonality tests.

Notation: ``N`` samples, ``gₙ = ∇ℓₙ`` (unscaled individual gradients), ``g = (1/N)Σₙ gₙ`` the
mini-batch gradient (mean reduction). The engine stores ``grad_batch[n] = gₙ/N``, so its fast
statistics are ``batch_l2[n] = ‖gₙ‖²/N²`` and ``batch_dot[n, m] = gₙᵀgₘ/N²``, and the
projections onto the mini-batch gradient are row sums of ``batch_dot``:

    gₙᵀg = (1/N) Σₘ gₙᵀgₘ = N Σₘ batch_dot[n, m]

(summed over parameters). The engine's ``BatchProjGrad`` gives these row sums directly,
``batch_proj_grad[n] = Σₘ batch_dot[n, m]`` (Linear: from ``batch_dot``; convolutions:
``⟨δₙ, conv(xₙ, ∇L)⟩``, without ``[N, N]`` products of per-sample gradients), and
``Σₙ batch_dot[n, n] = Σₙ batch_l2[n]``. No per-sample gradient is materialised.

* **NormTest** (Byrd et al., 2012, Eq. 3.9): the largest θ for which the norm test passes,

      θ = √( Σₙ‖gₙ − g‖² / (N − 1) / N / ‖g‖² ),
      Σₙ‖gₙ − g‖² = N² Σₙ batch_l2[n] − N‖g‖².

* **InnerTest** (Bollapragada et al., 2017, Eq. 2.6): with projections ``πₙ = gₙᵀg``,

      θ = √( Var(πₙ) / N / ‖g‖⁴ ),  Var(πₙ) = (Σₙ πₙ² − N‖g‖⁴)/(N − 1).

* **OrthoTest** (Bollapragada et al., 2017, Eq. 3.3): the largest ν for which the
  orthogonality test passes,

      ν = √( Σₙ‖gₙ − (πₙ/‖g‖²) g‖² / (N − 1) / N / ‖g‖² ),
      Σₙ‖gₙ − (πₙ/‖g‖²) g‖² = N² Σₙ batch_l2[n] − Σₙ πₙ²/‖g‖²,  batch_l2 = diag(batch_dot).

All three return a float (Cockpit's output format), computed on the device in float64 and
moved to the host with the other values of the step. They need a mean-reduced loss. In a global
step under distributed data parallelism (:mod:`backprism.monitor.distributed`) ``N`` and the
rows are the global batch's (every rank's rows, gathered) and ``g`` its gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backprism.extensions import BatchL2Grad, BatchProjGrad
from backprism.extensions.base import Extension
from backprism.monitor.quantities.base import Pending, SingleStepQuantity, StepData, grad_norms

__all__ = ["InnerTest", "NormTest", "OrthoTest"]


def grad_l2_squared(data: StepData) -> Tensor:
    """``‖g‖² = Σ_p ‖∇_{θ_p} L‖²`` in float64, computed once per step (the three gradient tests
    share it): one fused norm over the gradients in their dtype (no float64 copy of them),
    squared and summed in float64."""
    if "grad_l2_squared" not in data.cache:
        norms = [n for n in grad_norms(data) if n is not None]
        dev = data.device
        data.cache["grad_l2_squared"] = torch.stack(
            [n.to(dev, torch.float64) for n in norms]
        ).square().sum()
    return data.cache["grad_l2_squared"]


class NormTest(SingleStepQuantity):
    """Norm test (Byrd et al., 2012): the largest θ for which it passes, from ``batch_l2``."""

    per_sample = True

    def extensions(self, global_step: int) -> list[Extension]:
        return [BatchL2Grad()] if self.should_compute(global_step) else []

    def _compute(self, global_step: int, data: StepData) -> Pending:
        batch_l2 = _total(data.rows(BatchL2Grad()))
        n = batch_l2.numel()
        g2 = grad_l2_squared(data)
        var_l1 = (n**2 * batch_l2.sum() - n * g2) / (n - 1)
        return Pending.scalar((var_l1 / n / g2).sqrt())


def _total(tensors: list[Tensor]) -> Tensor:
    """``Σ_p t_p`` of per-parameter ``[N]`` tensors in float64."""
    ref = tensors[0]
    return torch.stack([t.to(ref.device, torch.float64) for t in tensors]).sum(0)


def _projections(data: StepData) -> Tensor:
    """The projections ``πₙ = gₙᵀg = N Σₘ batch_dot[n, m]`` (summed over parameters)."""
    rows = _total(data.rows(BatchProjGrad()))
    return rows.shape[0] * rows


class InnerTest(SingleStepQuantity):
    """Inner-product test (Bollapragada et al., 2017): the largest θ for which it passes."""

    per_sample = True

    def extensions(self, global_step: int) -> list[Extension]:
        return [BatchProjGrad()] if self.should_compute(global_step) else []

    def _compute(self, global_step: int, data: StepData) -> Pending:
        proj = _projections(data)
        n = proj.shape[0]
        g2 = grad_l2_squared(data)
        var = (proj.square().sum() - n * g2**2) / (n - 1)
        return Pending.scalar((var / n / g2**2).sqrt())


class OrthoTest(SingleStepQuantity):
    """Orthogonality test (Bollapragada et al., 2017): the largest ν for which it passes."""

    per_sample = True

    def extensions(self, global_step: int) -> list[Extension]:
        return [BatchProjGrad(), BatchL2Grad()] if self.should_compute(global_step) else []

    def _compute(self, global_step: int, data: StepData) -> Pending:
        proj = _projections(data)
        n = proj.shape[0]
        g2 = grad_l2_squared(data)
        l2 = _total(data.rows(BatchL2Grad())).sum()
        var = (n**2 * l2 - (proj.square() / g2).sum()) / (n - 1)
        return Pending.scalar((var / n / g2).sqrt())
