r"""First-order extensions: per-sample gradients and their statistics.

With ``L = (1/N) Σₙ ℓₙ`` (``"sum"`` drops the ``1/N``) and ``grad_batch[n] = ∇(ℓₙ/N)``:

=================  ===================  ===============================================
extension          attribute            value
=================  ===================  ===============================================
BatchGrad          ``grad_batch``       ``[N, *p]``: ``∇(ℓₙ/N)`` (``Σₙ grad_batch = grad``)
BatchL2Grad        ``batch_l2``         ``[N]``: ``‖grad_batch[n]‖²``
SumGradSquared     ``sum_grad_squared`` ``[*p]``: ``Σₙ grad_batch[n]²``
Variance           ``variance``         ``[*p]``: ``(1/N)Σₙ gbₙ² − ((1/N)Σₙ gbₙ)²``, gb = grad_batch
BatchDotGrad       ``batch_dot``        ``[N, N]``: ``⟨grad_batch[n], grad_batch[m]⟩``
=================  ===================  ===============================================

Statistics come from the layer rules' closed forms (e.g. Linear: ``‖gₙ‖² = ‖δₙ‖²‖xₙ‖²``)
without materialising per-sample gradients wherever the algebra allows.

Under distributed data parallelism (:mod:`backprism.engine.distributed`, ``ρ = N_r/N`` for a
mean loss, ``1`` for sum): ``grad_batch`` and ``batch_l2`` are this rank's rows of the global
batch's (``ρ·`` and ``ρ²·`` the local ones); ``sum_grad_squared = Σ_r ρ_r² Σₙ gbₙ²`` and
``variance`` (from it and the global gradient ``G = Σ_r ρ_r ∇L_r``:
``(1/N) Σ gb² − (G/N)²``) are the global values; ``batch_dot`` is this rank's diagonal block
``[N_r, N_r]`` of the global matrix, or the whole ``[N, N]`` matrix on every rank with
``BatchDotGrad(across_ranks=True)`` (which all-reduces the per-sample gradients, ``N·D`` numbers
per parameter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from backprism.engine.backward import current_pass
from backprism.engine.extension import CatPart, GlobalBatch, SumPart
from backprism.engine.rule import Call, Rule
from backprism.extensions.base import (
    FirstOrderExtension,
    PerSampleRows,
    SummedOverSamples,
    check_subsampling,
    subsample_index,
)

__all__ = ["BatchDotGrad", "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance"]


def _axes(call: Call) -> tuple[list[int], list[int]]:
    """Batch axes of the call's positional arguments and of its tensor outputs. Axis 0, except
    for recurrent layers: ``input``/``output`` on axis 0 or 1 (``batch_first``), the hidden
    states ``h_0``/``h_n``/``c_n`` (``[layers, N, H]``) always on axis 1."""
    module = call.module
    if isinstance(module, nn.RNNBase):
        seq = 0 if module.batch_first else 1
        return [seq] + [1] * (len(call.args) - 1), [seq] + [1] * (len(call.out_shapes) - 1)
    if isinstance(module, nn.MultiheadAttention) and not module.batch_first:
        # query, key, value [L|S, N, E]; the output [L, N, E], the weights [N, L, S]
        return [1] * len(call.args), [1] + [0] * (len(call.out_shapes) - 1)
    return [0] * len(call.args), [0] * len(call.out_shapes)


def _subset_call(call: Call, index: Tensor) -> Call:
    """The call restricted to the samples ``index`` (tensors with the batch on their batch
    axis, see :func:`_axes`; repeated or permuted indices give repeated or permuted samples).

    What the forward kept from inside the call (:attr:`Call.inner`, e.g. the attention output
    before ``out_proj`` that :class:`~backprism.rules.attention.MultiheadAttentionRule` reuses)
    holds the whole batch and is dropped: the rule recomputes it from the restricted arguments.
    (Its layout checks compare shapes only, so a subset of ``N`` rows, such as ``[1, 0]`` or
    ``[0, 0]``, would otherwise read the unrestricted rows.)"""
    from dataclasses import replace

    arg_axes, out_axes = _axes(call)
    n = call.batch_size

    def take(x: Any, axis: int) -> Any:
        if isinstance(x, tuple):  # LSTM's (h_0, c_0)
            return tuple(take(t, axis) for t in x)
        if isinstance(x, Tensor) and x.dim() > axis and x.shape[axis] == n:
            return x.index_select(axis, index.to(x.device))
        return x

    new = replace(
        call,
        args=tuple(take(a, ax) for a, ax in zip(call.args, arg_axes)),
        kwargs={k: take(v, 0) for k, v in call.kwargs.items()},
        batch_size=len(index),
        versions=[],
        inner=None,
    )
    new.group = getattr(call, "group", None)  # type: ignore[attr-defined]
    new.out_shapes = [
        s if len(s) <= ax or s[ax] != n else torch.Size((*s[:ax], len(index), *s[ax + 1 :]))
        for s, ax in zip(call.out_shapes, out_axes)
    ]
    return new


def subset_columns(g: Any, index: Tensor, batch_size: int, call: Call | None = None) -> Any:
    """Restrict ``[M, *out.shape]`` columns (or a tuple of them, one per output of ``call``)
    to the samples ``index``."""
    axes = _axes(call)[1] if call is not None else []
    if isinstance(g, tuple):
        axes = axes or [0] * len(g)
        return tuple(
            _subset_one(x, index, batch_size, ax) for x, ax in zip(g, axes, strict=False)
        )
    return _subset_one(g, index, batch_size, axes[0] if axes else 0)


def _subset_one(g: Any, index: Tensor, batch_size: int, axis: int) -> Any:
    if isinstance(g, Tensor) and g.dim() > axis + 1 and g.shape[axis + 1] == batch_size:
        return g.index_select(axis + 1, index.to(g.device))
    return g


class BatchGrad(PerSampleRows, FirstOrderExtension):
    """Per-sample gradients ``grad_batch`` of shape ``[N, *param.shape]`` (``∇(ℓₙ/N)``).

    Args:
        subsampling: indices of the samples to keep (default: all); the result then has
            ``len(subsampling)`` rows, in the given order (a repeated index repeats its row).
            In a distributed pass the indices count this rank's samples.
    """

    savefield = "grad_batch"
    additive = True

    def __init__(self, subsampling: Sequence[int] | None = None) -> None:
        self.subsampling = check_subsampling(subsampling, unique=False)

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        idx = subsample_index(self.subsampling, call.batch_size, "BatchGrad")
        if idx is not None:
            call, g = _subset_call(call, idx), subset_columns(g, idx, call.batch_size, call)
        return {k: v[0] for k, v in rule.per_sample(call, g).items()}


class BatchL2Grad(PerSampleRows, FirstOrderExtension):
    """Squared norms ``batch_l2[n] = ‖grad_batch[n]‖²`` of shape ``[N]``."""

    savefield = "batch_l2"
    distributed_degree = 2.0
    tied_statistic = "batch_l2"

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        return rule.batch_l2(call, g)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        return dense[0].reshape(dense.shape[1], -1).square().sum(1)


class SumGradSquared(SummedOverSamples, FirstOrderExtension):
    """Second moment ``sum_grad_squared = Σₙ grad_batch[n]²`` of shape ``param.shape``."""

    savefield = "sum_grad_squared"
    distributed_degree = 2.0
    tied_statistic = "sum_squared"

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        return rule.sum_squared(call, g)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Tensor:
        return dense[0].square().sum(0)


class Variance(FirstOrderExtension):
    """Biased variance of ``grad_batch`` over the batch, shape ``param.shape``:
    ``(1/N)Σₙ grad_batch[n]² − ((1/N)Σₙ grad_batch[n])²``."""

    savefield = "variance"
    #: the mean gradient comes from the parameter's gradient of the same backward pass, so
    #: only ``Σₙ grad_batch[n]²`` needs an extra pass over inputs and output gradients
    needs_param_grad = True
    tied_statistic = "sum_squared"

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        n = call.batch_size
        return {k: (v, n) for k, v in rule.sum_squared(call, g).items()}

    def from_statistic(self, statistic: Tensor, call: Call) -> Any:
        return statistic, call.batch_size

    def finish(self, partial: tuple[Tensor, int], grad: Tensor) -> Tensor:
        """``partial = (Σₙ gbₙ², N)`` and ``grad = Σₙ gbₙ`` → the biased variance."""
        sq, n = partial  # ``sq`` may be shared with SumGradSquared: not modified in place
        out = sq / n
        return out.addcmul_(grad, grad, value=-1.0 / (n * n)).clamp_min_(0)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Any:
        d = dense[0]
        if _distributed():  # the moments, combined over the ranks before the variance
            return _Moments(d.square().sum(0), d.sum(0))
        return (d.square().mean(0) - d.mean(0).square()).clamp_min_(0)

    def accumulate(self, old: Any, new: Any) -> Any:
        return old + new

    # distributed: the partial's Σ gb² is summed over the ranks; finish() takes the global
    # gradient of the pass (parameters of several calls: both moments are summed)
    def distributed_unsupported(self, params: list) -> str | None:
        return None

    def distributed_parts(self, value: Any, batch: GlobalBatch) -> list:
        rho = batch.loss_weight
        if isinstance(value, _Moments):
            return [SumPart(value.sq, rho**2), SumPart(value.sum, rho)]
        return [SumPart(value[0], rho**2)]  # often SumGradSquared's tensor: sent once

    def distributed_result(self, value: Any, reduced: list[Tensor], batch: GlobalBatch) -> Any:
        if isinstance(value, _Moments):
            n = batch.n
            return (
                (reduced[0] / n)
                .addcmul_(reduced[1], reduced[1], value=-1.0 / (n * n))
                .clamp_min_(0)
            )
        return reduced[0], batch.n


class _Moments:
    """``Σₙ gbₙ²`` and ``Σₙ gbₙ`` of a parameter used by several calls (distributed pass)."""

    __slots__ = ("sq", "sum")

    def __init__(self, sq: Tensor, sum_: Tensor) -> None:
        self.sq = sq
        self.sum = sum_


class _Rows:
    """Flattened per-sample gradients ``[N_r, D]`` of one parameter, kept by
    ``BatchDotGrad(across_ranks=True)`` in a distributed pass until the ranks' rows are
    combined."""

    __slots__ = ("rows",)

    def __init__(self, rows: Tensor) -> None:
        self.rows = rows


def _distributed() -> bool:
    bp = current_pass()
    return bp is not None and bp.distributed is not None


class BatchDotGrad(FirstOrderExtension):
    """Pairwise inner products ``batch_dot[n, m] = ⟨grad_batch[n], grad_batch[m]⟩``, ``[N, N]``.

    Args:
        across_ranks: in a distributed pass, the whole ``[N, N]`` matrix of the global batch on
            every rank (the per-sample gradients are all-reduced: ``N·D`` numbers per
            parameter) instead of this rank's diagonal block ``[N_r, N_r]``.
    """

    savefield = "batch_dot"

    def __init__(self, across_ranks: bool = False) -> None:
        self.across_ranks = bool(across_ranks)

    def from_rule(self, rule: Rule, call: Call, g: Any, weights: Tensor | None) -> dict:
        if self.across_ranks and _distributed():
            per_sample = rule.per_sample(call, g).items()
            return {k: _Rows(v[0].reshape(v.shape[1], -1)) for k, v in per_sample}
        return rule.batch_dot(call, g)

    def from_dense(self, dense: Tensor, call: Call, weights: Tensor | None) -> Any:
        f = dense[0].reshape(dense.shape[1], -1)
        if self.across_ranks and _distributed():
            return _Rows(f)
        return f @ f.t()

    def distributed_unsupported(self, params: list) -> str | None:
        return None

    def distributed_parts(self, value: Any, batch: GlobalBatch) -> list:
        if isinstance(value, _Rows):
            return [CatPart(value.rows * batch.loss_weight, rows=batch.sizes)]
        return []

    def distributed_result(self, value: Any, reduced: list[Tensor], batch: GlobalBatch) -> Any:
        if isinstance(value, _Rows):
            f = reduced[0]
            return f @ f.t()
        return value * batch.loss_weight**2
