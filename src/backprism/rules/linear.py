r"""Rule for :class:`torch.nn.Linear` with any number of leading axes.

Input ``x`` of shape ``[N, *T, I]``, output columns ``g`` of shape ``[M, N, *T, O]``; ``T`` is the
product of the middle axes (1 when there are none). With ``Vₘₙ`` the per-sample, per-column
weight gradient,

* ``Vₘₙ = Σₜ gₘₙₜ xₙₜᵀ`` (``[O, I]``) and bias ``Σₜ gₘₙₜ``;
* without middle axes, ``‖Vₘₙ‖² = ‖gₘₙ‖² ‖xₙ‖²``, ``Σₘₙ wₘₙ Vₘₙ² = Σₙ (Σₘ wₘₙ gₘₙ²) (xₙ²)ᵀ`` and
  ``⟨Vₘₙ, Vₘₖ⟩ = ⟨gₘₙ, gₘₖ⟩⟨xₙ, xₖ⟩`` — no ``[N, O, I]`` tensor is built;
* ``Vₘₙ`` as outer products ``gₘₙₜ xₙₜᵀ`` for a weight tied to other calls
  (:mod:`backprism.engine.tied`);
* with middle axes, ``‖Vₘₙ‖² = Σₜₛ ⟨gₘₙₜ, gₘₙₛ⟩⟨xₙₜ, xₙₛ⟩`` (Gram form, cost ``N T² (O + I)``) or
  by materialising ``Vₘₙ`` (cost ``N T O I``), whichever is cheaper; ``Σₘₙ wₘₙ Vₘₙ²`` from
  ``Vₘₙ`` built in sample chunks (batched BLAS), squared in place and reduced over ``(m, n)`` by
  one matrix product.

Kronecker factors (BackPACK's convention, which for middle axes follows its convolution rule):
``A = (1/N) Σₙₜ xₙₜ xₙₜᵀ`` and ``B = Σₘₙ (Σₜ gₘₙₜ)(Σₜ gₘₙₜ)ᵀ`` — the exact (KFLR) / MC (KFAC)
GGN of the bias (the ``1/N`` of a mean loss sits in ``g``); the bias gets ``[B]``. KFAC-expand
(``A/T``, ``B = Σₘₙₜ gₘₙₜ gₘₙₜᵀ``) and KFAC-reduce (``A`` of the position means) on request
(:meth:`~backprism.engine.rule.Rule.kronecker_factors`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from backprism.engine.columns import pull_back
from backprism.engine.functional import JoinedBias
from backprism.engine.gram import gram
from backprism.engine.rule import Call, Outer, Rule, register_rule

#: elements of a per-sample weight-gradient chunk ``[M, n, O, I]`` built at once (sequences)
CHUNK_ELEMENTS = 2**22
#: elements of a chunk squared and reduced over the samples at once (``sum_squared``): small
#: enough to stay in cache and to come from the allocator's free memory, not fresh pages (an
#: ``[N, O, I]`` chunk of a transformer's feed-forward layer is 8 MiB)
SQUARE_CHUNK_ELEMENTS = 2**18


def _vmat(g: Tensor, x: Tensor, out: Tensor | None = None) -> Tensor:
    """``Vₘₙ = Σₜ gₘₙₜ xₙₜᵀ``: ``[M, n, T, O] × [n, T, I] → [M, n, O, I]`` (batched BLAS);
    ``out``: a ``[n, O, I]`` buffer to write into (``M = 1`` only)."""
    if g.shape[0] == 1:
        return torch.bmm(g[0].transpose(1, 2), x, out=out).unsqueeze(0)
    return torch.einsum("mnto,nti->mnoi", g, x)


def _squares(g: Tensor, x: Tensor, weights: Tensor | None, keep_batch: bool) -> Tensor:
    """``Σₘ wₘₙ Vₘₙ²`` (``[N, O, I]``) or its sum over ``n`` (``[O, I]``) for sequences: ``V``
    in sample chunks, squared in place, reduced over ``(m, n)`` by one matrix product per
    chunk (accumulated by ``addmm``; with ``M = 1`` the chunks share one buffer)."""
    m, n, _, o = g.shape
    i = x.shape[-1]
    limit = CHUNK_ELEMENTS if keep_batch else SQUARE_CHUNK_ELEMENTS
    step = max(1, limit // max(1, m * o * i))
    parts: list[Tensor] = []
    total: Tensor | None = None
    # one buffer for the chunks (not under autograd: a create_graph=True pass differentiates
    # the result, and ``out=`` does not record)
    reuse = m == 1 and not keep_batch and not (g.requires_grad or x.requires_grad)
    buf = g.new_empty(min(n, step), o, i) if reuse else None
    ones = None
    for a in range(0, n, step):
        b = min(n, a + step)
        out = None if buf is None else buf[: b - a]
        v = _vmat(g[:, a:b], x[a:b], out).reshape(m * (b - a), o * i)
        v.square_()
        w = None if weights is None else weights[:, a:b].reshape(1, -1).to(v.dtype)
        if keep_batch:
            if w is not None:
                v.mul_(w.t())
            parts.append(v.reshape(m, b - a, o, i).sum(0))
            continue
        if w is None:
            if ones is None or ones.shape[1] != v.shape[0]:
                ones = v.new_ones(1, v.shape[0])
            w = ones
        total = w @ v if total is None else total.addmm_(w, v)
    if keep_batch:
        return torch.cat(parts)
    assert total is not None
    return total.reshape(o, i)


def _chunks(n: int, per_sample: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(1, per_sample))
    return [slice(a, min(n, a + step)) for a in range(0, n, step)]


def _flat(call: Call, g: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` as ``[N, T, I]`` and ``g`` as ``[M, N, T, O]``."""
    x = call.input
    n = x.shape[0]
    return x.reshape(n, -1, x.shape[-1]), g.reshape(g.shape[0], n, -1, g.shape[-1])


def linear_shell(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` never called, carrying ``weight``/``bias`` for the Linear rule (the
    projections of attention, Hugging Face's ``Conv1D`` with ``Wᵀ``)."""
    m = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(m)
    m.in_features, m.out_features = weight.shape[1], weight.shape[0]
    m._parameters["weight"] = weight  # type: ignore[assignment]
    m._parameters["bias"] = bias  # type: ignore[assignment]
    return m


@register_rule(nn.Linear)
class LinearRule(Rule):
    #: acts on the last axis only: an input with the batch elsewhere is moved batch-first
    moves_batch_axis = True
    #: ``y = x Wᵀ + b``: a weight that also feeds ``x`` gets the Hessian term of the product
    product_weight = "weight"
    #: every statistic is a polynomial in the live input and the output gradient
    differentiable = True

    def builds_per_sample(self, call: Call) -> bool:
        # without middle axes (or with one position) every statistic has a closed form
        x = call.input
        return x.dim() > 2 and x[0].numel() != x.shape[-1]

    def per_sample(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        x, g = _flat(call, g)
        out = {"weight": _vmat(g, x)}
        if call.module.bias is not None:
            out["bias"] = g.sum(2)
        return out

    def summed(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        x, g = _flat(call, g)
        out = {"weight": torch.einsum("mnto,nti->moi", g, x)}
        if call.module.bias is not None:
            out["bias"] = g.sum((1, 2))
        return out

    def sum_squared(
        self, call: Call, g: Tensor, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        x, g = _flat(call, g)
        if x.shape[1] != 1:
            out = {"weight": _squares(g, x, weights, keep_batch=False)}
            if call.module.bias is not None:
                b2 = g.sum(2).square()
                if weights is not None:
                    b2 = b2 * weights[..., None]
                out["bias"] = b2.sum((0, 1))
            return out
        g2 = g[:, :, 0].square()  # [M, N, O]
        if weights is not None:
            g2 = g2 * weights[..., None]
        g2 = g2.sum(0)  # [N, O]
        out = {"weight": g2.t() @ x[:, 0].square()}
        if call.module.bias is not None:
            out["bias"] = g2.sum(0)
        return out

    def batch_sum_squared(
        self, call: Call, g: Tensor, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        x, g = _flat(call, g)
        if x.shape[1] != 1:
            out = {"weight": _squares(g, x, weights, keep_batch=True)}
            if call.module.bias is not None:
                b2 = g.sum(2).square()
                if weights is not None:
                    b2 = b2 * weights[..., None]
                out["bias"] = b2.sum(0)
            return out
        g2 = g[:, :, 0].square()
        if weights is not None:
            g2 = g2 * weights[..., None]
        g2 = g2.sum(0)  # [N, O]
        out = {"weight": g2[:, :, None] * x[:, 0].square()[:, None, :]}
        if call.module.bias is not None:
            out["bias"] = g2
        return out

    def batch_l2(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        x, g = _flat(call, g)
        _m, _n, t, o = g.shape
        i = x.shape[-1]
        out = {}
        if t == 1:
            out["weight"] = g[:, :, 0].square().sum(-1).sum(0) * x[:, 0].square().sum(-1)
        elif t * (o + i) <= o * i:
            gram_x = torch.bmm(x, x.transpose(1, 2))  # [N, T, T]
            if g.shape[0] == 1:
                gram_g = torch.bmm(g[0], g[0].transpose(1, 2))
            else:
                gram_g = torch.einsum("mnto,mnso->nts", g, g)
            prod = gram_x * gram_g if gram_x.requires_grad else gram_x.mul_(gram_g)
            out["weight"] = prod.sum((1, 2))
        else:
            out["weight"] = torch.cat([
                torch.linalg.vector_norm(_vmat(g[:, sl], x[sl]).flatten(2), dim=-1)
                .square().sum(0)
                for sl in _chunks(x.shape[0], g.shape[0] * o * i)
            ])
        if call.module.bias is not None:
            out["bias"] = g.sum(2).square().sum((0, 2))
        return out

    def batch_dot(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        x, g = _flat(call, g)
        _m, n, t, o = g.shape
        i = x.shape[-1]
        out = {}
        if t == 1:
            out["weight"] = torch.einsum("mno,mko->nk", g[:, :, 0], g[:, :, 0]) * (
                x[:, 0] @ x[:, 0].t()
            )
        elif n * t * t * (o + i) <= 2 * o * i:
            gram_x = torch.einsum("nti,ksi->ntks", x, x)
            gram_g = torch.einsum("mnto,mkso->ntks", g, g)
            out["weight"] = (gram_x * gram_g).sum((1, 3))
        else:
            v = _vmat(g, x).flatten(2)
            out["weight"] = torch.einsum("mnj,mkj->nk", v, v)
        if call.module.bias is not None:
            b = g.sum(2)
            out["bias"] = torch.einsum("mno,mko->nk", b, b)
        return out

    def batch_dot_with(
        self, call: Call, g: Tensor, vectors: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        r"""``⟨Vₙ, V⟩ = Σₜ δₙₜᵀ V xₙₜ`` (columns summed first, linear in ``g``); no ``[N, O, I]``
        tensor is built."""
        x, g = _flat(call, g)
        gs = g.sum(0)  # [N, T, O]
        out = {}
        if "weight" in vectors:
            w = vectors["weight"].to(x.dtype)
            out["weight"] = (gs * (x @ w.t())).sum((1, 2))
        if "bias" in vectors and call.module.bias is not None:
            out["bias"] = gs.sum(1) @ vectors["bias"].to(gs.dtype)
        return out

    def outer_factors(self, call: Call, g: Tensor) -> dict[str, Outer]:
        """``Vₘₙ = Σₜ gₘₙₜ xₙₜᵀ`` (rows ``g``, columns ``x``); the bias ``Σₜ gₘₙₜ · 1``."""
        x, g = _flat(call, g)
        out = {"weight": Outer(g, x[None], g.shape[-1])}
        if call.module.bias is not None:
            out["bias"] = Outer(g, x.new_ones(1, *x.shape[:2], 1), g.shape[-1])
        return out

    def kfac_input(self, call: Call, approx: str | None = None) -> dict[str, Tensor]:
        """``A = (1/N) Σₙₜ xₙₜ xₙₜᵀ``; ``"expand"``: divided by ``T``; ``"reduce"``:
        ``(1/N) Σₙ x̄ₙ x̄ₙᵀ`` of the position means ``x̄ₙ``."""
        x = call.input
        n = x.shape[0]
        x = x.reshape(n, -1, x.shape[-1])
        t = x.shape[1]
        if approx == "reduce" and t > 1:
            return {"weight": gram(x.mean(1).t(), n)}
        scale = n * t if approx == "expand" else n
        return {"weight": gram(x.reshape(-1, x.shape[-1]).t(), scale)}

    def kfac_output(
        self, call: Call, g: Tensor, approx: str | None = None
    ) -> dict[str, Tensor]:
        """``B = Σₘₙ ḡₘₙ ḡₘₙᵀ`` (``ḡ = Σₜ g``, the exact/MC GGN block of the bias);
        ``"expand"``: ``Σₘₙₜ gₘₙₜ gₘₙₜᵀ``, the bias's factor too."""
        _, g = _flat(call, g)
        f = g.flatten(0, 2) if approx == "expand" else g.sum(2).flatten(0, 1)  # [·, O]
        b = gram(f.t())
        out = {"weight": b}
        if call.module.bias is not None:
            out["bias"] = b
        return out


@register_rule(JoinedBias)
class JoinedBiasRule(Rule):
    r"""A linear layer's bias joined from parameters and constants
    (:class:`~backprism.engine.functional.JoinedBias`: timm's
    ``F.linear(x, w, torch.cat((q_bias, k_bias, v_bias)))``). As for a Linear bias, sample
    ``n``'s gradient of the joined vector is ``sₘₙ = Σₜ gₘₙₜ`` (``[M, N, O]``); each
    parameter's is the transpose of its part's rebuild ``r`` applied to its slice,
    ``Vₘₙ(θ) = J_rᵀ sₘₙ[slice]`` (a slice of ``s`` itself for the parameter as it is). The
    scaling is that of ``g``. Statistics and the single Kronecker factor (the GGN diagonal) come
    from the :class:`~backprism.engine.rule.Rule` defaults; linear in its parameters."""

    def per_sample(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        m, n = g.shape[0], g.shape[1]
        s = g.reshape(m, n, -1, g.shape[-1]).sum(2)  # [M, N, O]
        out: dict[str, Tensor] = {}
        start = 0
        for size, i, rebuild in call.module._parts:
            if i is not None:
                p = call.module._parameters[f"p{i}"].detach()
                cols = s[..., start : start + size].reshape(m * n, size).to(p.dtype)
                (v,) = pull_back(lambda q, r=rebuild: (r(q),), (p,), (cols,))
                out[f"p{i}"] = v.reshape(m, n, *p.shape)
            start += size
        return out
