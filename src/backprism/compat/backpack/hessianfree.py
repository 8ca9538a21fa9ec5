r"""BackPACK's ``backpack.hessianfree``: matrix-free products with autograd.

=======================================================  =====================================
``hessianfree.rop.R_op(ys, xs, vs)``                     ``J v`` (Jacobian of ``ys`` w.r.t.
``hessianfree.rop.jacobian_vector_product(f, x, v)``     ``xs`` times ``vs``)
``hessianfree.lop.L_op(ys, xs, ws)``                     ``Jᵀ w``
``hessianfree.lop.transposed_jacobian_vector_product``
``hessianfree.hvp.hessian_vector_product(f, params, v)``  ``H v`` (Hessian of scalar ``f``)
``hessianfree.ggnvp.ggn_vector_product(loss, output,``   ``Jᵀ (∇²_output loss) J v`` over the
``model, v)``, ``ggn_vector_product_from_plist``         trainable parameters / ``plist``
=======================================================  =====================================

All return tuples of tensors shaped like ``xs``/``params``, detached unless ``detach=False``,
and keep the graph (``retain_graph=True``), so they can be called repeatedly on one loss.
``R_op`` uses the double-backward trick ``J v = ∂/∂w ⟨Jᵀ w, v⟩``. Inputs that ``ys`` does not
depend on get zeros. Call them outside ``backpack(...)``: inside it, their backward passes
would run the active extensions too (as in BackPACK).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from backprism.compat._modules import alias_module

__all__ = [
    "L_op",
    "R_op",
    "ggn_vector_product",
    "ggn_vector_product_from_plist",
    "hessian_vector_product",
    "jacobian_vector_product",
    "transposed_jacobian_vector_product",
]

__path__: list[str] = []

TensorOrList = Tensor | Sequence[Tensor]


def _as_list(x: TensorOrList) -> list[Tensor]:
    return [x] if isinstance(x, Tensor) else list(x)


def _grad(
    ys: list[Tensor],
    xs: list[Tensor],
    ws: list[Tensor],
    retain_graph: bool,
    create_graph: bool,
) -> tuple[Tensor, ...]:
    pairs = [(y, w) for y, w in zip(ys, ws) if y.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(x) for x in xs)
    grads = torch.autograd.grad(
        [y for y, _ in pairs],
        xs,
        grad_outputs=[w for _, w in pairs],
        retain_graph=retain_graph,
        create_graph=create_graph,
        allow_unused=True,
    )
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads))


def R_op(
    ys: TensorOrList,
    xs: TensorOrList,
    vs: TensorOrList,
    retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """``J vs``: the Jacobian of ``ys`` w.r.t. ``xs`` applied to ``vs`` (shaped like ``xs``);
    returns a tuple shaped like ``ys``."""
    ys_, xs_, vs_ = _as_list(ys), _as_list(xs), _as_list(vs)
    ws = [torch.zeros_like(y, requires_grad=True) for y in ys_]
    with torch.enable_grad():
        gs = _grad(ys_, xs_, ws, retain_graph=True, create_graph=True)
        pairs = [(g, v) for g, v in zip(gs, vs_) if g.requires_grad]
        if pairs:
            re = torch.autograd.grad(
                [g for g, _ in pairs],
                ws,
                grad_outputs=[v for _, v in pairs],
                retain_graph=retain_graph,
                create_graph=not detach,
                allow_unused=True,
            )
        else:
            re = (None,) * len(ws)
    out = tuple(torch.zeros_like(y) if r is None else r for y, r in zip(ys_, re))
    return tuple(r.detach() for r in out) if detach else out


def L_op(
    ys: TensorOrList,
    xs: TensorOrList,
    ws: TensorOrList,
    retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """``Jᵀ ws``: the transposed Jacobian of ``ys`` w.r.t. ``xs`` applied to ``ws`` (shaped
    like ``ys``); returns a tuple shaped like ``xs``."""
    out = _grad(_as_list(ys), _as_list(xs), _as_list(ws), retain_graph, create_graph=not detach)
    return tuple(o.detach() for o in out) if detach else out


def jacobian_vector_product(
    f: TensorOrList, x: TensorOrList, v: TensorOrList, retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """``J v`` of ``f`` w.r.t. ``x`` (the R-operator, :func:`R_op`)."""
    return R_op(f, x, v, retain_graph=retain_graph, detach=detach)


def transposed_jacobian_vector_product(
    f: TensorOrList, x: TensorOrList, v: TensorOrList, retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """``Jᵀ v`` of ``f`` w.r.t. ``x`` (the L-operator, :func:`L_op`)."""
    return L_op(f, x, v, retain_graph=retain_graph, detach=detach)


def hessian_vector_product(
    f: Tensor,
    params: TensorOrList,
    v: TensorOrList,
    grad_params: TensorOrList | None = None,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """``H v`` with ``H`` the Hessian of the scalar ``f`` w.r.t. ``params``.

    Args:
        f: scalar.
        params: tensors (or one tensor) ``f`` is differentiated by.
        v: shaped like ``params``.
        grad_params: ``∇f`` computed before with ``create_graph=True`` (saves one backward).
        detach: detach the result.
    """
    ps, vs = _as_list(params), _as_list(v)
    with torch.enable_grad():
        if grad_params is None:
            gs = torch.autograd.grad(f, ps, create_graph=True, allow_unused=True)
            gs = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(ps, gs))
        else:
            gs = tuple(_as_list(grad_params))
        out = _grad(list(gs), ps, vs, retain_graph=True, create_graph=not detach)
    return tuple(o.detach() for o in out) if detach else out


def ggn_vector_product_from_plist(
    loss: Tensor, output: Tensor, plist: Sequence[Tensor], v: TensorOrList
) -> tuple[Tensor, ...]:
    """``G v = Jᵀ (∇²_output loss) J v`` for the block of ``plist`` (``J``: Jacobian of
    ``output`` w.r.t. ``plist``); ``v`` and the result are lists shaped like ``plist``."""
    plist = list(plist)
    Jv = R_op(output, plist, _as_list(v))  # one tensor for a one-parameter plist, as BackPACK
    (HJv,) = hessian_vector_product(loss, [output], list(Jv))
    return L_op(output, plist, [HJv])


def ggn_vector_product(
    loss: Tensor, output: Tensor, model: nn.Module, v: Sequence[Tensor]
) -> tuple[Tensor, ...]:
    """``G v`` over the trainable parameters of ``model`` (in ``model.parameters()`` order)."""
    plist = [p for p in model.parameters() if p.requires_grad]
    return ggn_vector_product_from_plist(loss, output, plist, v)


alias_module(
    f"{__name__}.hvp", "BackPACK's hessianfree.hvp.", hessian_vector_product=hessian_vector_product
)
alias_module(
    f"{__name__}.ggnvp",
    "BackPACK's hessianfree.ggnvp.",
    ggn_vector_product=ggn_vector_product,
    ggn_vector_product_from_plist=ggn_vector_product_from_plist,
)
alias_module(
    f"{__name__}.rop",
    "BackPACK's hessianfree.rop.",
    R_op=R_op,
    jacobian_vector_product=jacobian_vector_product,
)
alias_module(
    f"{__name__}.lop",
    "BackPACK's hessianfree.lop.",
    L_op=L_op,
    transposed_jacobian_vector_product=transposed_jacobian_vector_product,
)
