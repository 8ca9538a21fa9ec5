r"""The Hessian term of ``F.scaled_dot_product_attention``, as signed columns.

Fused attention kernels are one autograd node, ``O = softmax(S) V`` with
``S = c · Q Kᵀ + M`` (scale ``c``, default ``1/√E``; ``M`` the additive mask, ``−∞`` where a
boolean or causal mask hides a key; grouped-query attention repeats each key/value head over
its query heads, and leading axes broadcast — one key/value head for all query heads, as in
multi-query attention). Its second-order term, for ``G_O = ∂L/∂O``, is the sum of the terms of the
three operations it composes (the chain rule to second order), each with the gradient at its
own output:

* the product ``Q Kᵀ`` with ``c · G_S`` (``G_S = ∂L/∂S``): :mod:`backprism.engine.bilinear`;
* the softmax over each row of ``S`` with ``G_P = ∂L/∂P``: :mod:`backprism.engine.rows`;
* the product ``P V`` with ``G_O``: :mod:`backprism.engine.bilinear`.

The attention is rebuilt from the node's inputs with PyTorch's math formulation (the kernels
compute the same function), the three families of signed columns are built on its internal
tensors and mapped to ``(Q, K, V)`` by vector-Jacobian products of the rebuilt graph, from
where the engine pushes them on like any other. Columns per sample (``H`` heads, ``L`` queries,
``S`` keys, widths ``E``, ``Eᵥ``): ``2 H L E`` + ``H L S`` + ``2 H min(L, Eᵥ) S`` — as for the same
attention written out, whose operations this follows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from backprism.engine.bilinear import BilinearForm, signed_columns
from backprism.engine.rows import row_columns

__all__ = ["attention_columns", "safe_softmax", "sdpa_arguments"]

#: ``(values, make, paired)``: a family of signed columns (``paired``: a product's ``(a, ±b)``
#: pairs, :func:`backprism.engine.bilinear.signed_columns`)
Family = tuple[Tensor, Callable[[Tensor, Tensor], list[Tensor]], bool]


def _product_form(x: Tensor, y: Tensor) -> BilinearForm:
    """The canonical form of ``x @ y`` over leading batch axes (``[..., I, K] @ [..., K, J]``)."""
    B = math.prod(x.shape[:-2])
    return BilinearForm(None, x.shape, y.shape, (B, x.shape[-2], y.shape[-1], x.shape[-1]), None)


def attention_columns(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None,
    gqa: bool, grad: Tensor, n: int, budget: int, mask_grad: bool = False,
) -> list[Family]:
    """The three families of signed columns of attention ``(q, k, v) ↦ O`` (module docstring)
    for ``grad = ∂L/∂O`` and ``n`` samples on the first axis of ``q``, ``k``, ``v``: each
    ``(values [n, C], make, paired)`` with ``make(idx, scale)`` the columns ``idx`` scaled by
    ``scale`` (``[n, c]``) in ``q``'s, ``k``'s and ``v``'s shapes (``[c, *shape]`` each; see
    :func:`backprism.engine.bilinear.signed_columns`). With ``mask_grad``, the additive float
    ``mask`` is an input too (a relative position bias that depends on parameters, as T5 and
    BEiT pass under SDPA, widened over the samples): it enters ``S`` additively, so it takes
    no product term of its own, but the softmax's and ``P V``'s columns reach it as they reach
    ``c · Q Kᵀ`` — a fourth tensor per column, in the mask's shape."""
    with torch.enable_grad():
        inputs = (q, k, v, mask) if mask_grad and mask is not None else (q, k, v)
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        qq, kk, vv = (t.view(t.shape) for t in leaves[:3])  # (non-leaf: mapped like the rest)
        if len(leaves) > 3:
            mask = leaves[3]
        if gqa and kk.shape[-3] != qq.shape[-3]:
            rep = qq.shape[-3] // kk.shape[-3]
            kk, vv = kk.repeat_interleave(rep, -3), vv.repeat_interleave(rep, -3)
        # leading axes broadcast as the kernel's matmuls do (Falcon's multi-query attention
        # passes one key/value head for all query heads): the products' forms need them equal
        lead = torch.broadcast_shapes(qq.shape[:-2], kk.shape[:-2], vv.shape[:-2])
        qq, kk, vv = (t.expand(*lead, *t.shape[-2:]) for t in (qq, kk, vv))
        c = 1.0 / math.sqrt(qq.shape[-1]) if scale is None else scale
        kt = kk.transpose(-2, -1)
        raw = qq @ kt
        s = raw * c
        L, S = s.shape[-2], s.shape[-1]
        if is_causal:
            keep = torch.ones(L, S, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
        # a query that sees no key (a left-padded position under a causal mask) attends to
        # nothing: its row of P is zero, as PyTorch's kernels return, not softmax's NaN
        hidden = torch.isneginf(s).all(-1, keepdim=True)
        p = safe_softmax(s, hidden)
        out = p @ vv
        g = grad.detach().to(out.dtype)
        g_p, g_s = torch.autograd.grad(out, (p, s), g, retain_graph=True)

    def pulled(origins: list[Tensor], make: Callable) -> Callable[[Tensor, Tensor], list[Tensor]]:
        """``make``'s columns on the internal ``origins``, mapped to ``(q, k, v)``."""

        def mapped(idx: Tensor, sc: Tensor) -> list[Tensor]:
            cols = make(idx, sc)
            with torch.enable_grad():
                got = torch.autograd.grad(
                    origins, leaves, cols, retain_graph=True, is_grads_batched=True,
                    allow_unused=True,
                )
            k = cols[0].shape[0]
            return [
                t.new_zeros(k, *t.shape) if x is None else x
                for x, t in zip(got, leaves, strict=True)
            ]

        return mapped

    families: list[Family] = []
    values, make = signed_columns(_product_form(qq, kt), g_s.detach() * c, n)
    families.append((values, pulled([qq, kt], make), True))
    values, make = row_columns(
        lambda t: safe_softmax(t, hidden), s.detach(), g_p, -1, 1, n, budget
    )
    families.append((values, pulled([s], make), False))
    values, make = signed_columns(_product_form(p, vv), g, n)
    families.append((values, pulled([p, vv], make), True))
    return families


def safe_softmax(s: Tensor, hidden: Tensor) -> Tensor:
    """``softmax(s)`` over the last axis, with the rows ``hidden`` (``[..., 1]``: every key
    masked, ``-∞``) zero instead of NaN, and zero gradient there."""
    return torch.softmax(s.masked_fill(hidden, 0.0), dim=-1).masked_fill(hidden, 0.0)


def sdpa_arguments(args: tuple, kwargs: dict) -> dict | None:
    """The arguments of one ``F.scaled_dot_product_attention`` call, by name, or ``None``
    where they are not what the math formulation covers (positional extras beyond
    ``enable_gqa``)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    if len(args) > len(names):
        return None
    bound = dict(zip(names, args, strict=False))
    for key, val in kwargs.items():
        if key not in names or key in bound:
            return None
        bound[key] = val
    if not all(isinstance(bound.get(x), Tensor) for x in names[:3]):
        return None
    return bound

