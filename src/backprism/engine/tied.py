r"""Quadratic statistics of a parameter used by several calls in one backward pass (tied
weights: a language model's embedding reused as its output layer; several forwards; unrolled
steps).

The per-sample, per-column gradient of a parameter used by calls ``k = 1…K`` is the sum of the
calls' contributions, ``Vₘₙ = Σₖ Vᵏₘₙ``, so a statistic that is quadratic in it is not the sum of
the calls' statistics:

    ``Σₘ ‖Vₘₙ‖²        = Σₖ Σₘ ‖Vᵏₘₙ‖²       + 2 Σ_{k<l} Σₘ ⟨Vᵏₘₙ, Vˡₘₙ⟩``        (``batch_l2``)
    ``Σₘₙ wₘₙ Vₘₙ²      = Σₖ Σₘₙ wₘₙ (Vᵏₘₙ)² + 2 Σ_{k<l} Σₘₙ wₘₙ Vᵏₘₙ ⊙ Vˡₘₙ``   (``sum_squared``)

The first sum is each call's own statistic (its rule's closed form). The cross terms come from
the calls' outer-product factors (:class:`~backprism.engine.rule.Outer`,
``Vᵏₘₙ = Σₜ rᵏₘₙₜ (cᵏₘₙₜ)ᵀ``) without building ``Vᵏₘₙ``:

* ``⟨Vᵏₘₙ, Vˡₘₙ⟩ = Σₜₛ ⟨rᵏₘₙₜ, rˡₘₙₛ⟩ ⟨cᵏₘₙₜ, cˡₘₙₛ⟩`` — Gram form, cost ``M N Tₖ Tₗ (R + C)``;
  with one-hot rows ``e_{iₙₜ}`` the row product is a look-up, ``rˡₘₙₛ[iₙₜ]``, and the cost is
  ``M N Tₖ Tₗ C`` (an embedding against its tied output layer: ``N T² d`` instead of the
  ``N T V d`` of the dense per-sample gradients);
* ``Σₘₙ wₘₙ Vᵏₘₙ ⊙ Vˡₘₙ`` with one-hot rows ``e_{iₙₜ}`` on side ``k``: row ``v`` is
  ``Σₘₙ wₘₙ Σ_{t: iₙₜ = v} cᵏₘₙₜ ⊙ (Σₛ rˡₘₙₛ[v] cˡₘₙₛ)``, one batched product and a scatter into
  the rows; two dense sides build ``Vᵏₘₙ`` and ``Vˡₘₙ`` a chunk of samples at a time.

A parameter whose calls do not all have outer factors takes the dense path (the sum of the
calls' per-sample gradients, :meth:`~backprism.engine.extension.Extension.from_dense`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from backprism.engine.rule import Outer, Rule
from backprism.engine.state import Call

__all__ = ["Use", "Uses", "cross_batch_l2", "cross_sum_squared"]

#: elements of the per-sample gradients ``[M, n, R, C]`` built at once where two dense sides
#: are multiplied elementwise
CHUNK_ELEMENTS = 2**22


def _row_gram(a: Outer, b: Outer) -> Tensor:
    """``⟨rᵃₘₙₜ, rᵇₘₙₛ⟩``: ``[M or 1, N, Tₐ, T_b]``."""
    if a.one_hot and b.one_hot:
        return (a.rows[:, :, None] == b.rows[:, None, :]).to(a.cols.dtype)[None]
    if b.one_hot:
        return _row_gram(b, a).transpose(-1, -2)
    if a.one_hot:  # rᵇₘₙₛ[iₙₜ]
        rb = b.rows.transpose(-1, -2)  # [M, N, R, T_b]
        m, n, _, tb = rb.shape
        index = a.rows[None, :, :, None].expand(m, n, a.rows.shape[1], tb)
        return rb.gather(2, index)
    return a.rows @ b.rows.transpose(-1, -2)


def _dense(o: Outer, sl: slice) -> Tensor:
    """``Vₘₙ`` of the samples ``sl``: ``[M or 1, n, R, C]`` (dense rows only)."""
    return o.rows[:, sl].transpose(-1, -2) @ o.cols[:, sl]


def _sample_chunks(a: Outer, b: Outer) -> list[slice]:
    n = a.cols.shape[1]
    m = max(a.rows.shape[0], a.cols.shape[0], b.rows.shape[0], b.cols.shape[0])
    per_sample = m * a.size * a.cols.shape[-1]
    step = max(1, CHUNK_ELEMENTS // max(1, per_sample))
    return [slice(s, min(n, s + step)) for s in range(0, n, step)]


def cross_batch_l2(a: Outer, b: Outer) -> Tensor:
    """``Σₘ ⟨Vᵃₘₙ, Vᵇₘₙ⟩``: ``[N]``, by the Gram form or, for two dense sides where it costs
    less, from the per-sample gradients built a chunk of samples at a time."""
    ta, tb = a.cols.shape[2], b.cols.shape[2]
    r, c = a.size, a.cols.shape[-1]
    if a.one_hot or b.one_hot or ta * tb * (r + c) <= (ta + tb) * r * c:
        return (_row_gram(a, b) * (a.cols @ b.cols.transpose(-1, -2))).sum((2, 3)).sum(0)
    parts = [
        (_dense(a, sl) * _dense(b, sl)).sum((2, 3)).sum(0) for sl in _sample_chunks(a, b)
    ]
    return torch.cat(parts)


def cross_sum_squared(a: Outer, b: Outer, weights: Tensor | None) -> Tensor:
    """``Σₘₙ wₘₙ Vᵃₘₙ ⊙ Vᵇₘₙ``: ``[R, C]``."""
    if b.one_hot and not a.one_hot:
        a, b = b, a
    r, c = a.size, a.cols.shape[-1]
    if a.one_hot:
        # row iₙₜ gets cᵃₘₙₜ ⊙ Σₛ rᵇₘₙₛ[iₙₜ] cᵇₘₙₛ
        prod = (_row_gram(a, b) @ b.cols) * a.cols  # [M, N, Tₐ, C]
        if weights is not None:
            prod = prod * weights[:, :, None, None].to(prod.dtype)
        prod = prod.sum(0).reshape(-1, c)
        return prod.new_zeros(r, c).index_add_(0, a.rows.reshape(-1), prod)
    total: Tensor | None = None
    for sl in _sample_chunks(a, b):
        prod = _dense(a, sl) * _dense(b, sl)  # [M, n, R, C]
        if weights is not None:
            prod = prod * weights[:, sl, None, None].to(prod.dtype)
        part = prod.sum((0, 1))
        total = part if total is None else total + part
    assert total is not None
    return total


@dataclass
class Use:
    """One call's contribution to a parameter used by several calls: the rule and columns it
    was computed with, the parameter's name in the call, and its outer factors (``None``: the
    rule has none for it)."""

    rule: Rule
    call: Call
    g: Any
    name: str
    outer: Outer | None


@dataclass
class Uses:
    """The uses of one parameter in one pass (or one chunk of columns) so far."""

    items: list[Use] = field(default_factory=list)

    @property
    def factored(self) -> bool:
        """Every use has outer factors: quadratic statistics need no dense gradients."""
        return all(u.outer is not None for u in self.items)

    def statistic(self, kind: str, weights: Tensor | None = None) -> Tensor:
        """The parameter's ``kind`` statistic (``"batch_l2"``, ``"sum_squared"``) over all its
        uses: each use's own closed form plus twice the cross terms (needs :attr:`factored`)."""
        total: Tensor | None = None
        for u in self.items:
            own = (
                u.rule.batch_l2(u.call, u.g)
                if kind == "batch_l2"
                else u.rule.sum_squared(u.call, u.g, weights)
            )[u.name]
            total = own if total is None else total + own
        assert total is not None
        shape = total.shape
        for k, a in enumerate(self.items):
            for b in self.items[k + 1 :]:
                assert a.outer is not None and b.outer is not None
                cross = (
                    cross_batch_l2(a.outer, b.outer)
                    if kind == "batch_l2"
                    else cross_sum_squared(a.outer, b.outer, weights).reshape(shape)
                )
                total = total + 2 * cross
        return total

    def dense(self) -> Tensor:
        """``Σₖ Vᵏ``: the parameter's per-sample, per-column gradients ``[M, N, *p]``."""
        total: Tensor | None = None
        for u in self.items:
            v = u.rule.per_sample(u.call, u.g)[u.name]
            total = v if total is None else total + v
        assert total is not None
        return total
