r"""The Hessian term of a product of two parameter-dependent values, as signed columns.

A product ``Z = X ∘ Y`` that is bilinear in its operands — ``X * Y`` (with broadcasting) or a
batched ``X @ Y`` (``bmm``; a ``matmul``/``einsum`` of 3 or more dimensions ends in one;
``baddbmm``'s ``α · X @ Y``, Bloom's ALiBi scores) — adds
to the Hessian of the loss ``L`` the term

.. math::  d^2 ⟨G, Z⟩ = 2 ⟨G, dX ∘ dY⟩, \qquad G = ∂L/∂Z,

pulled back through the operands' Jacobians: ``dX = J_X dθ``, ``dY = J_Y dθ``. It lies inside a
parameter's block only if the parameter is upstream of both operands (attention on hidden
features ``q kᵀ``, ``softmax(·) v``; SwiGLU's ``silu(g) * u``; a hand-written RMSNorm's
``x * rsqrt(mean(x²))``; GPT-2's ``x * (1 + tanh(…))``).

**Canonical form.** Every such product is, after moving axes,
``Z[b, i, j] = Σₖ X[b, i, k] Y[b, k, j]``: ``b`` the axes both operands carry, ``i`` those only
``X`` carries, ``j`` those only ``Y`` carries, ``k`` the contracted axis (``bmm``; none, size 1,
for ``*``). The term couples ``dX[b, i, k]`` with ``dY[b, k, j]`` through ``G[b, i, j]``: with
``G_b = Σᵣ σ_br u_br v_brᵀ`` (singular value decomposition), the symmetric form on
``(dX, dY)`` is

.. math::  M = Σ_{b,r,k} \frac{σ_{br}}{2} \Big[(a, b)(a, b)ᵀ − (a, −b)(a, −b)ᵀ\Big],
           \qquad a = u_{br} ⊗ e_k,\; b = e_k ⊗ v_{br},

its eigen-decomposition (eigenvalues ``±σ_br``): column ``(b, r, k, ±)`` is
``√(σ_br / 2) (u_br ⊗ eₖ, ±eₖ ⊗ v_br)``, entering the graph at both operands at once, with
weight ``±1``. ``2 · rank(G_b) · K`` columns per ``b``; ``b`` holds the samples, so one column
covers every sample (the samples' ``G_b`` are decomposed separately). For ``q kᵀ`` in attention
(``H`` heads, ``T`` positions, width ``D``) that is ``2 T D`` columns per sample, for
``softmax(·) v`` ``2 min(T, D/H) T H``; for an elementwise product ``2`` per element, for a
broadcast one (``[N, T, D] * [N, T, 1]``) ``2`` per row.

**Precision.** A pair's squares differ by its cross term, ``‖A + B‖² − ‖A − B‖² = 4⟨A, B⟩``
where ``A`` and ``B`` are its two parts where they meet; rounding leaves ``ε (‖A‖² + ‖B‖²)``.
The pair is therefore balanced, ``(α a, ±b/α)``, where one operand is computed from the other
(:func:`balance`), and a layer reached by one part only (``A = 0`` or ``B = 0``: the pair
arrives equal or opposite) drops it (``engine.backward._unmirrored``). Both leave the term
unchanged; extensions that modify the weights (PCHMP) take the pairs as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from backprism.engine.decompositions import decomposed

__all__ = ["BilinearForm", "balance", "bilinear_form", "signed_columns", "singular_triples"]


class BilinearForm:
    """The canonical form ``Z[b, i, j] = Σₖ X[b, i, k] Y[b, k, j]`` of one product node (module
    docstring): how ``G`` and the operands' columns map to and from it. Holds shapes and
    permutations, no tensors.

    Attributes:
        edges: the gradient edges of ``X`` and ``Y`` (where the columns enter the graph;
            ``None`` for a product rebuilt outside the graph, :mod:`~backprism.engine.attention`).
        x_shape, y_shape: the operands' shapes.
        lead: the size of the operands' axis 0, a ``b`` axis (it holds the samples, folded
            sample-major with other ``b`` axes where the pass's graph shows so).
        sizes: ``(B, I, J, K)``, the canonical sizes.
    """

    __slots__ = (
        "_g_perm", "_x_perm", "_y_perm", "edges", "lead", "scale", "sizes", "x_shape", "y_shape"
    )

    def __init__(
        self, edges: tuple[GradientEdge, GradientEdge] | None, x_shape: torch.Size,
        y_shape: torch.Size, sizes: tuple[int, int, int, int],
        perms: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None,
        scale: float = 1.0,
    ) -> None:
        self.edges = edges
        self.x_shape, self.y_shape = x_shape, y_shape
        self.sizes = sizes
        self.lead = x_shape[0]
        #: ``Z = scale · X ∘ Y`` (``baddbmm``'s ``alpha``)
        self.scale = scale
        # (``None``: ``bmm``, already canonical) axis orders of G, X, Y — the latter two
        # padded to Z's dimensions
        self._g_perm, self._x_perm, self._y_perm = perms or ((), (), ())

    def canonical_grad(self, grad: Tensor) -> Tensor:
        """``G`` (``∂L/∂Z`` in ``Z``'s shape) as ``[B, I, J]``."""
        B, I, J, _ = self.sizes
        g = grad.permute(self._g_perm) if self._g_perm else grad
        g = g.reshape(B, I, J)
        return g * self.scale if self.scale != 1.0 else g

    def x_columns(self, cols: Tensor) -> Tensor:
        """Columns ``[k, B, I, K]`` in ``X``'s shape, ``[k, *X.shape]``."""
        return self._back(cols, self._x_perm, self.x_shape)

    def y_columns(self, cols: Tensor) -> Tensor:
        """Columns ``[k, B, K, J]`` in ``Y``'s shape, ``[k, *Y.shape]``."""
        return self._back(cols, self._y_perm, self.y_shape)

    def _back(self, cols: Tensor, perm: tuple[int, ...], shape: torch.Size) -> Tensor:
        k = cols.shape[0]
        if not perm:
            return cols.reshape(k, *shape)
        padded = [1] * (len(perm) - len(shape)) + list(shape)
        moved = cols.reshape(k, *(padded[a] for a in perm))
        inverse = [0] * len(perm)
        for pos, a in enumerate(perm):
            inverse[a] = pos + 1
        return moved.permute(0, *inverse).reshape(k, *shape)


def bilinear_form(node: Any) -> BilinearForm | None:
    """The :class:`BilinearForm` of autograd node ``node`` if it is a product of two
    differentiable operands that this module decomposes (``MulBackward0`` of two tensors of
    ``Z``'s dimensions whose axis 0 both carry in full, ``BmmBackward0``, the product of
    ``BaddbmmBackward0``), else ``None``."""
    kind = type(node).__name__
    fns = node.next_functions
    if kind == "BaddbmmBackward0":  # β·input + α·(batch1 @ batch2): its product's operands
        fns = fns[1:]
    if len(fns) != 2 or fns[0][0] is None or fns[1][0] is None:
        return None
    edges = (GradientEdge(*fns[0]), GradientEdge(*fns[1]))
    saved = {
        "BmmBackward0": ("_saved_self", "_saved_mat2"),
        "BaddbmmBackward0": ("_saved_batch1", "_saved_batch2"),
        "MulBackward0": ("_saved_self", "_saved_other"),
        # (a division x / y: the form of the product x ∘ y, its gradient −G/y² given by the
        # caller, residual.DivisionSite)
        "DivBackward0": ("_saved_self", "_saved_other"),
    }.get(kind)
    if saved is None:
        return None
    try:
        x, y = (getattr(node, name) for name in saved)
        alpha = float(node._saved_alpha) if kind == "BaddbmmBackward0" else 1.0
    except RuntimeError:  # (saved tensors freed: a graph already backpropagated)
        return None
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        return None
    xs, ys = x.shape, y.shape
    if kind not in ("MulBackward0", "DivBackward0"):
        return BilinearForm(edges, xs, ys, (xs[0], xs[1], ys[2], xs[2]), None, alpha)
    if x.dim() == 0 or x.dim() != y.dim() or xs[0] != ys[0]:
        return None  # (axis 0 must be a shared axis: it carries the samples)
    zs = torch.broadcast_shapes(xs, ys)
    both = [a for a in range(len(zs)) if xs[a] == ys[a]]
    only_x = [a for a in range(len(zs)) if xs[a] != ys[a] and ys[a] == 1]
    only_y = [a for a in range(len(zs)) if xs[a] != ys[a] and xs[a] == 1]
    order = (*both, *only_x, *only_y)
    sizes = (
        math.prod(zs[a] for a in both), math.prod(zs[a] for a in only_x),
        math.prod(zs[a] for a in only_y), 1,
    )
    return BilinearForm(edges, xs, ys, sizes, (order, order, order))


def balance(form: BilinearForm, pull: Callable[[int], Tensor | None]) -> Tensor | None:
    r"""Scales ``αᵦ`` (``[B]``) that make the two parts of each pair of columns about equally
    large where they meet, when one operand is computed from the other (``Y = f(X)`` in a
    hand-written RMSNorm ``x · rsqrt(mean(x²) + ε)``, ``x · sigmoid(x)``), else ``None``.

    A pair's parts ``(a, ±b)`` have equal norms at the operands; pulled back to the operand
    the other is computed from they are ``a`` and ``J_fᵀ b``, whose cross term ``2⟨a, J_fᵀb⟩``
    the columns give as a difference of two squares. In floating point that difference loses
    ``ε (‖a‖² + ‖J_fᵀb‖²)``, which exceeds the term itself when the parts differ much in size
    (``‖J_f‖ = r²/√D`` for an RMSNorm of a small-scaled input, ``r = 1/rms(x)``: float32
    Hessian diagonals 1e-2 off on Hugging Face Gemma2). With ``α² = ‖J_fᵀ 1_b‖ / ‖1_b‖`` the
    parts ``α a`` and ``J_fᵀ b / α`` are of one size; the term is unchanged. ``pull(i)`` is
    ``J_fᵀ 1`` (all ones on operand ``i``'s output, pulled back to the other operand, in its
    shape), or ``None`` where operand ``i`` is not computed from the other."""
    B, I, J, K = form.sizes
    for derived, width in ((1, J * K), (0, I * K)):
        got = pull(derived)
        if got is None:
            continue
        # (the other operand in canonical form: X as [B, I·K], Y as [B, K·J])
        perm = form._y_perm if derived == 0 else form._x_perm
        shape = form.y_shape if derived == 0 else form.x_shape
        if perm:
            padded = [1] * (len(perm) - len(shape)) + list(shape)
            got = got.reshape(padded).permute(perm)
        norms = torch.linalg.vector_norm(got.reshape(B, -1), dim=1) / math.sqrt(width)
        alpha2 = norms if derived == 1 else 1 / norms
        alpha = alpha2.sqrt()
        return torch.where(torch.isfinite(alpha) & (alpha > 0), alpha, torch.ones_like(alpha))
    return None


def singular_triples(G: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``U [B, I, r]``, ``S [B, r]``, ``V [B, J, r]`` with ``G_b = U_b diag(S_b) V_bᵀ``,
    ``r = min(I, J)``; closed form for ``r = 1`` (a broadcast or elementwise product), in
    float32 for half precision (PyTorch has no half-precision SVD)."""
    B, I, J = G.shape
    if I == 1 or J == 1:
        vec = G.reshape(B, max(I, J))
        s = torch.linalg.vector_norm(vec, dim=1, keepdim=True)  # [B, 1]
        unit = torch.where(s > 0, vec / s.clamp_min(torch.finfo(G.dtype).tiny), 0)
        ones = G.new_ones(B, 1, 1)
        u, v = (unit[:, :, None], ones) if J == 1 else (ones, unit[:, :, None])
        return u, s, v
    U, S, Vh = decomposed(lambda t: torch.linalg.svd(t, full_matrices=False), G)
    return U, S, Vh.mT


def signed_columns(
    form: BilinearForm, grad: Tensor, n: int, alpha: Tensor | None = None
) -> tuple[Tensor, Callable[[Tensor, Tensor], list[Tensor]]]:
    """The product's columns for ``n`` samples on the leading ``b`` axis (``B = n·g``):
    ``values [n, C]`` (column ``(b', r, k, s)`` at ``((b'·r + ρ)·K + k)·2 + s``, its value
    ``±σ/2`` for each sample: the eigenvalue whose square root scales it and whose sign
    weighs it) and ``make(idx, scale)``, the columns ``idx`` (``[c]``) scaled by ``scale``
    (``[n, c]``, ``√|value|``) in the operands' shapes, ``[c, *X.shape]`` and
    ``[c, *Y.shape]``. ``alpha`` (``[B]``, positive): the pair's parts as
    ``(αᵦ a, ±b / αᵦ)`` — the same term for every ``α > 0`` (:func:`balance`)."""
    B, I, J, K = form.sizes
    g = B // n
    U, S, V = singular_triples(form.canonical_grad(grad))
    r = S.shape[1]
    half = S.reshape(n, g, r, 1, 1) / 2
    sign = torch.tensor([1.0, -1.0], dtype=S.dtype, device=S.device)
    values = (half * sign).expand(n, g, r, K, 2).reshape(n, g * r * K * 2)
    U4, V4 = U.reshape(n, g, I, r), V.reshape(n, g, J, r)

    def make(idx: Tensor, scale: Tensor) -> list[Tensor]:
        c = idx.numel()
        s = idx % 2
        kk = (idx // 2) % K
        rho = (idx // (2 * K)) % r
        bb = idx // (2 * K * r)
        at = torch.arange(c, device=idx.device)
        sc = scale.t()[:, :, None]  # [c, n, 1]
        xc = U4.new_zeros(c, n, g, I, K)
        xc[at, :, bb, :, kk] = sc * U4[:, bb, :, rho]  # [c, n, I]
        yc = V4.new_zeros(c, n, g, K, J)
        signs = (1 - 2 * s).to(V4.dtype)[:, None, None]
        yc[at, :, bb, kk, :] = signs * sc * V4[:, bb, :, rho]  # [c, n, J]
        if alpha is not None:
            scale_b = alpha.reshape(1, n, g, 1, 1).to(xc.dtype)
            xc.mul_(scale_b)
            yc.div_(scale_b)
        return [form.x_columns(xc.reshape(c, B, I, K)), form.y_columns(yc.reshape(c, B, K, J))]

    return values, make
