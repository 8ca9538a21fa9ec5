"""Independent references for the compat suite, written with plain ``torch.autograd`` (no
backprism code): GGN and Hessian columns/blocks of small problems, float64 by default."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _flat(ts: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unflat(vec: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    out, i = [], 0
    for t in like:
        out.append(vec[i : i + t.numel()].reshape(t.shape))
        i += t.numel()
    return out


def ggn_columns(model: nn.Module, loss_fn, X, y, idx: Sequence[int]) -> Tensor:
    """Columns ``G[:, d]`` (``d`` in ``idx``) of the GGN ``Jᵀ (∇²_f L) J`` over the trainable
    parameters in ``model.parameters()`` order: ``J e_d`` by the double-backward trick, the
    loss Hessian by differentiating ``∇_f L``, then ``Jᵀ``. Returns ``[len(idx), P]``."""
    params = trainable_params(model)
    cols = []
    with torch.enable_grad():
        out = model(*X) if isinstance(X, tuple) else model(X)
        loss = loss_fn(out, y)
        (g_out,) = torch.autograd.grad(loss, out, create_graph=True)
        for d in idx:
            e = torch.zeros(sum(p.numel() for p in params), dtype=out.dtype)
            e[int(d)] = 1.0
            w = torch.zeros_like(out, requires_grad=True)
            jt = torch.autograd.grad(out, params, w, create_graph=True, allow_unused=True)
            pairs = [(a, v) for a, v in zip(jt, _unflat(e, params)) if a is not None]
            (Jv,) = torch.autograd.grad([a for a, _ in pairs], w, [v for _, v in pairs])
            (HJv,) = torch.autograd.grad(g_out, out, Jv, retain_graph=True)
            JtHJv = torch.autograd.grad(out, params, HJv, retain_graph=True, allow_unused=True)
            cols.append(
                _flat([torch.zeros_like(p) if c is None else c for p, c in zip(params, JtHJv)])
            )
    return torch.stack(cols)


def hessian_block_product(loss: Tensor, p: Tensor, v: Tensor) -> Tensor:
    """``∇²_p loss · v`` for each row of ``v`` (``[V, *p.shape]``), by double backward."""
    (g,) = torch.autograd.grad(loss, p, create_graph=True)
    rows = [torch.autograd.grad(g, p, vi, retain_graph=True)[0] for vi in v]
    return torch.stack(rows)
