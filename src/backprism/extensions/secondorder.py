r"""Second-order extensions built on the GGN square root ``GGN = V Vᵀ``.

The loss Hessian w.r.t. the model output factorises as ``∇²ℓₙ = Sₙ Sₙᵀ``; the engine pushes
the ``K`` columns of ``Sₙ/√N`` (mean reduction) back to every module, where
``V[k, n] = Jₙᵀ Sₙ[:, k] / √N``. Exact: ``K = C`` columns (times the number of output positions
per sample); Monte-Carlo: ``K = M`` columns of gradients at labels sampled from the model's
predictive distribution, scaled by ``1/√M`` so that ``E[V Vᵀ] = GGN``.

==================  ===========================  ==================================
extension           attribute                    value
==================  ===========================  ==================================
DiagGGNExact        ``diag_ggn_exact``           ``[*p]``: ``Σₖₙ V[k, n]²``
DiagGGNMC           ``diag_ggn_mc``              same with MC columns
BatchDiagGGNExact   ``diag_ggn_exact_batch``     ``[N, *p]``: ``Σₖ V[k, n]²``
BatchDiagGGNMC      ``diag_ggn_mc_batch``        same with MC columns
SqrtGGNExact        ``sqrt_ggn_exact``           ``[K, N, *p]``: ``V``
SqrtGGNMC           ``sqrt_ggn_mc``              ``[M, N, *p]``: ``V`` with MC columns
==================  ===========================  ==================================

Sub-sampling (``SqrtGGNExact``/``SqrtGGNMC``, BackPACK's meaning): with indices
``𝒮 = (s₁, …, s_{N'})``, repetitions allowed, the result is ``V[:, 𝒮]`` (``[K, N', *p]``), the
columns of the full mini-batch factor taken by ``index_select`` in the given order, so that a
repeated index repeats its column block and ``V_𝒮 V_𝒮ᵀ = Σ_{i=1}^{N'} V[:, sᵢ] V[:, sᵢ]ᵀ`` counts
a sample once per occurrence. Nothing is rescaled. Each distinct sample is computed once and its
rows copied. MC columns are drawn once per sample of the mini-batch (the engine samples the
labels at the loss for all ``N`` samples, shared by every extension of the pass): a repeated
index repeats the *same* draw, and the kept rows equal those of ``SqrtGGNMC()`` without
sub-sampling under the same seed. ``E[V_𝒮 V_𝒮ᵀ]`` is the same sum as with independent draws (the
meaning BackPACK's sampler gives duplicates), only the variance of a repeated sample's term
differs.

Under distributed data parallelism (:mod:`backprism.engine.distributed`, ``ρ = N_r/N`` for a
mean loss): the diagonals are ``Σ_r ρ_r · local`` (global, on every rank), the per-sample terms
this rank's rows ``ρ · local`` and the square roots ``√ρ · local``. MC columns are sampled by
each rank for its own samples.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from backprism.engine.rule import Call, Rule
from backprism.extensions.base import (
    PerSampleRows,
    SecondOrderExtension,
    SummedOverSamples,
    check_subsampling,
    dedupe_index,
    subsample_index,
)
from backprism.extensions.firstorder import _subset_call, subset_columns

__all__ = [
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "DiagGGNExact",
    "DiagGGNMC",
    "SqrtGGNExact",
    "SqrtGGNMC",
]


def _check_mc(mc_samples: int) -> int:
    if not isinstance(mc_samples, int) or mc_samples < 1:
        raise ValueError(f"mc_samples must be a positive integer, got {mc_samples!r}")
    return mc_samples


class _Exact(SecondOrderExtension):
    def column_key(self) -> Hashable:
        return ("exact",)


class _MC(SecondOrderExtension):
    def __init__(self, mc_samples: int = 1) -> None:
        self.mc_samples = _check_mc(mc_samples)

    def column_key(self) -> Hashable:
        return ("mc", self.mc_samples)


class _Diag(SummedOverSamples):
    #: the whole batch's GGN diagonal is defined when BatchNorm mixes the samples
    whole_batch = True
    tied_statistic = "sum_squared"

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        return rule.sum_squared(call, g, weights)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        sq = dense.square()
        if weights is not None:
            sq = sq * weights.reshape(weights.shape + (1,) * (dense.dim() - 2))
        return sq.sum((0, 1))


class _BatchDiag(PerSampleRows):
    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        return rule.batch_sum_squared(call, g, weights)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        sq = dense.square()
        if weights is not None:
            sq = sq * weights.reshape(weights.shape + (1,) * (dense.dim() - 2))
        return sq.sum(0)


class _Sqrt(PerSampleRows):
    subsampling: list[int] | None
    distributed_degree = 0.5
    #: BatchNorm in train mode: ``V[k, r] = Σₙ Jₙᵀ cₖᵣ[n]`` for the column ``k`` of loss row
    #: ``r`` pushed through the whole batch, in the same ``[K, N, *p]`` layout
    whole_batch = True

    def whole_batch_result(self, value: Tensor, rows: int) -> Tensor:
        return value.reshape(-1, rows, *value.shape[2:])

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        if call.whole_batch and self.subsampling is not None:
            raise ValueError(
                f"backprism {type(self).__name__}: subsampling is undefined when BatchNorm in "
                "train mode mixes the samples (every loss row's columns depend on the whole "
                "batch); drop subsampling, or use model.eval() for the backward pass"
            )
        idx = subsample_index(self.subsampling, call.batch_size, type(self).__name__)
        if idx is None:
            return rule.per_sample(call, g)
        distinct, rows = dedupe_index(idx)
        call, g = _subset_call(call, distinct), subset_columns(g, distinct, call.batch_size, call)
        out = rule.per_sample(call, g)
        if rows is None:
            return out
        return {k: v.index_select(1, rows.to(v.device)) for k, v in out.items()}

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        idx = subsample_index(self.subsampling, call.batch_size, type(self).__name__)
        return dense if idx is None else dense.index_select(1, idx.to(dense.device))

    def accumulate(self, old: Tensor, new: Tensor) -> Tensor:
        return torch.cat([old, new], 0)


class DiagGGNExact(_Diag, _Exact):
    """Diagonal of the generalized Gauss-Newton matrix, ``diag_ggn_exact`` (``param.shape``)."""

    savefield = "diag_ggn_exact"


class DiagGGNMC(_Diag, _MC):
    """Monte-Carlo estimate of the GGN diagonal with ``mc_samples`` sampled labels,
    ``diag_ggn_mc``, shape ``param.shape``."""

    savefield = "diag_ggn_mc"


class BatchDiagGGNExact(_BatchDiag, _Exact):
    """Per-sample terms of the GGN diagonal, ``diag_ggn_exact_batch``, ``[N, *param.shape]``
    (they sum to ``diag_ggn_exact``)."""

    savefield = "diag_ggn_exact_batch"


class BatchDiagGGNMC(_BatchDiag, _MC):
    """Per-sample terms of the MC GGN diagonal, ``diag_ggn_mc_batch``, ``[N, *param.shape]``."""

    savefield = "diag_ggn_mc_batch"


class SqrtGGNExact(_Sqrt, _Exact):
    """Symmetric factorization of the GGN, ``sqrt_ggn_exact`` of shape ``[K, N, *param.shape]``.

    Args:
        subsampling: keep only these samples' columns, in the given order: the result is
            ``V[:, subsampling]`` (``[K, len(subsampling), *p]``, scaling unchanged, the
            corresponding block of the full mini-batch factor); a repeated index repeats its
            columns (BackPACK's behaviour).
    """

    savefield = "sqrt_ggn_exact"

    def __init__(self, subsampling: Sequence[int] | None = None) -> None:
        self.subsampling = check_subsampling(subsampling, unique=False)


class SqrtGGNMC(_Sqrt, _MC):
    """Monte-Carlo factorization of the GGN, ``sqrt_ggn_mc`` of shape ``[M, N, *param.shape]``.

    Args:
        mc_samples: number ``M`` of sampled labels per sample.
        subsampling: as :class:`SqrtGGNExact`: ``V[:, subsampling]``. The labels are drawn once
            per sample of the mini-batch, so a repeated index repeats the same draw (BackPACK
            draws again for each occurrence; both have ``E[V Vᵀ] = Σ_{occurrences} GGNₙ``).
    """

    savefield = "sqrt_ggn_mc"

    def __init__(self, mc_samples: int = 1, subsampling: Sequence[int] | None = None) -> None:
        super().__init__(mc_samples)
        self.subsampling = check_subsampling(subsampling, unique=False)
