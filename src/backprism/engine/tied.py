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
  the rows.

Where a pair has no such form (two dense sides of ``sum_squared``; of ``batch_l2`` where the
Gram form costs more than building them), the statistic of the sum is taken from the uses'
per-sample gradients built from their factors a chunk of samples at a time, each once
(:func:`summed_in_chunks`): never more work than the dense path, and never all of them.

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

__all__ = [
    "Use",
    "Uses",
    "cross_batch_l2",
    "cross_sum_squared",
    "gram_cheaper",
    "summed_in_chunks",
]

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
    """``Vₘₙ`` of the samples ``sl``: ``[M or 1, n, R, C]``."""
    cols = o.cols[:, sl]
    if not o.one_hot:
        return o.rows[:, sl].transpose(-1, -2) @ cols
    m, n, t, c = cols.shape  # row iₙₜ of sample n gets cₘₙₜ
    rows = (torch.arange(n, device=cols.device)[:, None] * o.size + o.rows[sl]).reshape(-1)
    v = cols.new_zeros(m, n * o.size, c).index_add_(1, rows, cols.reshape(m, n * t, c))
    return v.view(m, n, o.size, c)


def gram_cheaper(a: Outer, b: Outer) -> bool:
    """Whether ``⟨Vᵃ, Vᵇ⟩`` by the Gram form (``Tₐ T_b (R + C)`` per sample and column, or
    ``Tₐ T_b C`` with one-hot rows) costs less than building both (``(Tₐ + T_b) R C``)."""
    if a.one_hot or b.one_hot:
        return True
    ta, tb = a.cols.shape[2], b.cols.shape[2]
    r, c = a.size, a.cols.shape[-1]
    return ta * tb * (r + c) <= (ta + tb) * r * c


def cross_batch_l2(a: Outer, b: Outer) -> Tensor:
    """``Σₘ ⟨Vᵃₘₙ, Vᵇₘₙ⟩``: ``[N]``, by the Gram form."""
    return (_row_gram(a, b) * (a.cols @ b.cols.transpose(-1, -2))).sum((2, 3)).sum(0)


def cross_sum_squared(a: Outer, b: Outer, weights: Tensor | None) -> Tensor:
    """``Σₘₙ wₘₙ Vᵃₘₙ ⊙ Vᵇₘₙ``: ``[R, C]``, for one side with one-hot rows: row ``iₙₜ`` of
    side ``a`` gets ``cᵃₘₙₜ ⊙ Σₛ rᵇₘₙₛ[iₙₜ] cᵇₘₙₛ``."""
    if b.one_hot and not a.one_hot:
        a, b = b, a
    if not a.one_hot:
        raise ValueError("cross_sum_squared needs one side with one-hot rows")
    c = a.cols.shape[-1]
    prod = (_row_gram(a, b) @ b.cols) * a.cols  # [M, N, Tₐ, C]
    if weights is not None:
        prod = prod * weights[:, :, None, None].to(prod.dtype)
    prod = prod.sum(0).reshape(-1, c)
    return prod.new_zeros(a.size, c).index_add_(0, a.rows.reshape(-1), prod)


def summed_in_chunks(outers: list[Outer], kind: str, weights: Tensor | None) -> Tensor:
    """The ``kind`` statistic of ``Σₖ Vᵏ``, each ``Vᵏ`` built from its factors a chunk of
    samples at a time (``[N]``, or ``[R, C]`` for ``"sum_squared"``): where the cross terms
    would build the per-sample gradients anyway, every use's are built once, and their sum
    never whole."""
    first = outers[0]
    n, r, c = first.cols.shape[1], first.size, first.cols.shape[-1]
    m = max(max(o.cols.shape[0], 1 if o.one_hot else o.rows.shape[0]) for o in outers)
    step = max(1, CHUNK_ELEMENTS // max(1, m * r * c))
    parts: list[Tensor] = []
    total: Tensor | None = None
    for start in range(0, n, step):
        sl = slice(start, min(n, start + step))
        v = _dense(outers[0], sl)
        for o in outers[1:]:
            v = v + _dense(o, sl)  # [M, n, R, C]
        sq = v.square()
        if kind == "batch_l2":
            parts.append(sq.sum((2, 3)).sum(0))
            continue
        if weights is not None:
            sq = sq * weights[:, sl, None, None].to(sq.dtype)
        part = sq.sum((0, 1))
        total = part if total is None else total + part
    if kind == "batch_l2":
        return torch.cat(parts)
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

    def statistic(self, kind: str, shape: torch.Size, weights: Tensor | None = None) -> Tensor:
        """The parameter's ``kind`` statistic (``"batch_l2"``, ``"sum_squared"``) over all its
        uses (needs :attr:`factored`): each use's own closed form plus twice the cross terms
        where these need no per-sample gradients (``batch_l2``: the Gram form is cheaper for
        every pair; ``sum_squared``: every pair has one-hot rows on one side), else
        :func:`summed_in_chunks`. ``shape``: the parameter's."""
        outers = [u.outer for u in self.items]
        assert all(o is not None for o in outers)
        pairs = [(a, b) for k, a in enumerate(outers) for b in outers[k + 1 :]]
        if kind == "batch_l2":
            by_terms = all(gram_cheaper(a, b) for a, b in pairs)  # type: ignore[arg-type]
        else:
            by_terms = all(a.one_hot or b.one_hot for a, b in pairs)  # type: ignore[union-attr]
        if not by_terms:
            out = summed_in_chunks(outers, kind, weights)  # type: ignore[arg-type]
            return out if kind == "batch_l2" else out.reshape(shape)
        total: Tensor | None = None
        for u in self.items:
            own = (
                u.rule.batch_l2(u.call, u.g)
                if kind == "batch_l2"
                else u.rule.sum_squared(u.call, u.g, weights)
            )[u.name]
            total = own if total is None else total + own
        assert total is not None
        for a, b in pairs:
            cross = (
                cross_batch_l2(a, b)  # type: ignore[arg-type]
                if kind == "batch_l2"
                else cross_sum_squared(a, b, weights).reshape(shape)  # type: ignore[arg-type]
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
