r"""Curvature traces without diagonals: second-order extensions of the monitor.

With the GGN square root ``V`` (``GGN = V Vᵀ``, columns ``V[k, n] = Jₙᵀ Sₙ[:, k]/√N``), the
trace of a parameter's GGN block is a sum of squared per-sample, per-column gradient norms,

    tr(GGN_p) = Σ_i Σ_{k,n} V[k, n]_{p,i}² = Σ_{k,n} ‖V[k, n]_p‖²,

which the layer rules give in closed form (:meth:`~backprism.engine.rule.Rule.batch_l2`;
Linear: ``‖δ‖²‖x‖²``, convolutions: the Gram form ``Σ (XᵀX ⊙ GᵀG)`` where it is cheaper),
instead of squaring every element of every ``V[k, n]`` as the diagonal does. For the exact
Hessian, the residual columns of elementwise nonlinearities carry signed weights
``w[k, n]`` (:mod:`backprism.engine.residual`): ``Σ w ‖V‖²`` is taken as
``‖V(g·√w⁺)‖² − ‖V(g·√w⁻)‖²`` (``V`` is linear in the backpropagated column ``g``).

=================================  ========================  =================================
extension                          attribute                 value (0-dim, per parameter)
=================================  ========================  =================================
``GGNTrace()``                     ``monitor_ggn_trace``     ``tr(GGN_p)``, exact columns
``GGNTrace(mc_samples=M)``         ``monitor_ggn_mc_trace``  MC estimate with ``M`` labels
``HessianTrace()``                 ``monitor_hess_trace``    ``tr(∇²_p L)`` (GGN + residuals)
=================================  ========================  =================================

Their :meth:`twin` is the diagonal whose sum they equal (``DiagGGNExact``, ``DiagGGNMC``,
``DiagHessian``): the monitor reads the trace from that diagonal when it is computed in the
same pass anyway. Exact and MC traces share the backpropagated columns with the diagonals of
the same kind (the engine pushes each column kind once per pass).

Under distributed data parallelism they are sums over the samples of degree 1 in the loss
weights, reduced like ``diag_h``: ``Σ_r ρ_r · local`` (the global batch's trace on every rank;
the MC trace samples its labels on each rank, an estimate of the same global trace).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from torch import Tensor

from backprism.engine.residual import check_linear_in_params
from backprism.engine.rule import Call, Rule
from backprism.extensions import DiagGGNExact, DiagGGNMC, DiagHessian
from backprism.extensions.base import Extension, SecondOrderExtension, SummedOverSamples
from backprism.extensions.hessian import check_shared

__all__ = ["GGNTrace", "HessianTrace"]


def _scaled(g: Any, factor: Tensor) -> Any:
    """Columns ``g`` (``[M, N, ...]`` or a tuple of them) times ``factor`` ``[M, N]``."""
    if isinstance(g, tuple):
        return tuple(_scaled(x, factor) for x in g)
    return g * factor.to(g.dtype).reshape(factor.shape + (1,) * (g.dim() - 2))


def _trace(rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict[str, Tensor]:
    """``Σ_{m,n} w_{mn} ‖V_{mn}‖²`` per parameter (``w = 1`` without weights), 0-dim."""
    if weights is None:
        return {k: v.sum() for k, v in rule.batch_l2(call, g).items()}
    pos = rule.batch_l2(call, _scaled(g, weights.clamp_min(0).sqrt()))
    neg = rule.batch_l2(call, _scaled(g, (-weights).clamp_min(0).sqrt()))
    return {k: pos[k].sum() - neg[k].sum() for k in pos}


def _dense_trace(dense: Tensor, weights: Tensor | None) -> Tensor:
    sq = dense.flatten(2).square().sum(2)  # [M, N]
    if weights is not None:
        sq = sq * weights.to(sq.dtype)
    return sq.sum()


class GGNTrace(SummedOverSamples, SecondOrderExtension):
    """Per-parameter GGN trace ``Σ_{k,n} ‖V[k, n]_p‖²`` (0-dim), exact or with ``mc_samples``
    sampled labels (see the module doc).

    Args:
        mc_samples: ``None`` for the exact GGN (default), else the number of MC labels.
    """

    def __init__(self, mc_samples: int | None = None) -> None:
        if mc_samples is not None and (not isinstance(mc_samples, int) or mc_samples < 1):
            raise ValueError(f"mc_samples must be a positive integer, got {mc_samples!r}")
        self.mc_samples = mc_samples
        self.savefield = "monitor_ggn_trace" if mc_samples is None else "monitor_ggn_mc_trace"

    def column_key(self) -> Hashable:
        return ("exact",) if self.mc_samples is None else ("mc", self.mc_samples)

    def twin(self) -> Extension:
        """The diagonal whose sum this trace is."""
        if self.mc_samples is None:
            return DiagGGNExact()
        return DiagGGNMC(mc_samples=self.mc_samples)

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        return _trace(rule, call, g, weights)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        return _dense_trace(dense, weights)


class HessianTrace(SummedOverSamples, SecondOrderExtension):
    """Per-parameter trace of the exact Hessian (0-dim): the GGN trace plus the signed residual
    terms of elementwise nonlinearities; the sum of ``DiagHessian``'s ``diag_h``, with its
    checks (refused where ``DiagHessian`` is)."""

    savefield = "monitor_hess_trace"
    needs_residual = True

    def column_key(self) -> Hashable:
        return ("exact",)

    def twin(self) -> Extension:
        return DiagHessian()

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        check_linear_in_params(call, [self])
        return _trace(rule, call, g, weights)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        check_shared(self, call)
        return _dense_trace(dense, weights)
