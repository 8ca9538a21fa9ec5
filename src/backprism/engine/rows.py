r"""The Hessian term of a row-wise nonlinearity, as signed columns.

A smooth ``a = fn(z)`` acting on each row of ``z`` alone — the last ``trailing`` axes (the
``normalized_shape`` of ``layer_norm``/``rms_norm``) or one axis ``dim`` (``softmax``,
``softmin``), ``d`` entries per row — adds to the Hessian of the loss the term
``J_zᵀ R J_z`` with ``R`` block-diagonal over the rows:

.. math::  R_ρ = Σₖ \frac{∂L}{∂a_{ρk}} ∇² a_{ρk}(z_ρ) \quad (d × d).

``R`` comes from ``d`` Hessian-vector products of the whole tensor (probe ``k``: the unit
vector ``eₖ`` in every row at once), in chunks bounded by a memory budget. With
``R_ρ = Σⱼ λ_ρⱼ u_ρⱼ u_ρⱼᵀ`` (eigen-decomposition), column ``(ρ, j)`` is ``√|λ_ρⱼ| u_ρⱼ`` in
row ``ρ`` (zero elsewhere) with weight ``sign(λ_ρⱼ)``: one column per element of a sample.
Eigenvalues below ``10⁻¹²`` of the largest are dropped (round-off of the exact zeros of a
normalisation's invariant directions). Cost: ``d`` Hessian-vector products and a batched
``d × d`` eigen-decomposition per row — for small ``d`` (a norm over a few hundred features, a
softmax over a few hundred positions) like one more layer's columns; large ``d`` is cubic. In
half precision the blocks are eigen-decomposed in float32 (PyTorch has no half-precision
``eigh``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from backprism.engine.decompositions import decomposed

__all__ = ["row_axes", "row_columns", "row_hessians"]


def row_axes(dim: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...] | None:
    """``dim`` (an axis or several, or ``None``) as non-negative axes of an ``ndim``-tensor."""
    if dim is None:
        return None
    return tuple(d % ndim for d in ((dim,) if isinstance(dim, int) else dim))


def row_columns(
    fn: Callable[[Tensor], Tensor], z: Tensor, grad_a: Tensor,
    dim: int | tuple[int, ...] | None, trailing: int, n: int, budget: int,
) -> tuple[Tensor, Callable[[Tensor, Tensor], list[Tensor]]]:
    """The row term's columns for ``a = fn(z)`` (``grad_a = ∂L/∂a``), rows the last
    ``trailing`` axes of ``z`` after moving axis ``dim`` (if given; several axes: all of them,
    in order) last; ``n``: the samples on ``z``'s first axis (one column covers them all), or
    ``1`` (columns of the whole batch).

    Returns ``values [n, rows·d]`` (column ``(ρ, j)`` at ``ρ·d + j``: its eigenvalue
    ``λ_ρⱼ`` per sample) and ``make(idx, scale)``: the columns ``idx`` (``[c]``), each
    eigenvector scaled by ``scale`` (``[n, c]``, ``√|λ|``), as ``[[c, *z.shape]]``."""
    axes = row_axes(dim, z.dim())
    last = tuple(range(z.dim() - len(axes), z.dim())) if axes is not None else ()
    moved = axes is not None and axes != last
    zm = z.detach().movedim(axes, last) if moved else z.detach()
    ga = grad_a.detach().movedim(axes, last) if moved else grad_a.detach()
    f = (lambda t: fn(t.movedim(last, axes)).movedim(axes, last)) if moved else fn
    d = math.prod(zm.shape[zm.dim() - trailing:])
    rows = zm.numel() // (n * d)  # per sample
    H = row_hessians(f, zm, ga, d, budget)  # [n·rows, d, d]
    lam, vecs = decomposed(torch.linalg.eigh, H)
    # (a row whose gradient is NaN already keeps NaN values: its results are NaN, as .grad)
    tol = lam.abs().nan_to_num(0.0).max().clamp_min(torch.finfo(lam.dtype).tiny) * 1e-12
    lam = torch.where((lam.abs() > tol) | lam.isnan(), lam, torch.zeros_like(lam))
    values = lam.reshape(n, rows * d)
    vecs = vecs.reshape(n, rows, d, d)  # [..., entry, j]
    shape = zm.shape

    def make(idx: Tensor, scale: Tensor) -> list[Tensor]:
        k = idx.numel()
        r, j = idx // d, idx % d
        cols = values.new_zeros(k, n, rows, d)
        # vecs[:, r, :, j]: [k, n, d], column j of row r's eigenvectors for every sample
        cols[torch.arange(k, device=idx.device), :, r, :] = vecs[:, r, :, j] * scale.t()[..., None]
        cols = cols.reshape(k, *shape)
        if not moved:
            return [cols]
        return [cols.movedim(tuple(a + 1 for a in last), tuple(a + 1 for a in axes))]

    return values, make


def row_hessians(
    fn: Callable[[Tensor], Tensor], z: Tensor, ga: Tensor, d: int, budget: int
) -> Tensor:
    """``[rows, d, d]``: the Hessian of ``⟨ga, fn(z)⟩`` within each row of ``z`` (rows of the
    last ``d`` entries, flattened), by Hessian-vector products with the unit vectors ``eₖ``
    placed in every row at once, in chunks of ``k`` bounded by ``budget`` bytes."""
    rows = z.numel() // d
    out = z.new_empty(d, rows, d)
    with torch.enable_grad():
        zz = z.detach().requires_grad_(True)
        (g1,) = torch.autograd.grad((fn(zz) * ga).sum(), zz, create_graph=True)
        if not g1.requires_grad:  # fn is linear in z: no Hessian term
            return z.new_zeros(rows, d, d)
        step = max(1, budget // max(1, 2 * z.numel() * z.element_size()))
        for k0 in range(0, d, step):
            k1 = min(d, k0 + step)
            probes = z.new_zeros(k1 - k0, rows, d)
            probes[torch.arange(k1 - k0), :, torch.arange(k0, k1)] = 1
            (hv,) = torch.autograd.grad(
                g1, zz, probes.reshape(k1 - k0, *z.shape), retain_graph=True,
                is_grads_batched=True,
            )
            out[k0:k1] = hv.reshape(k1 - k0, rows, d)
    H = out.permute(1, 2, 0)  # [rows, entry, k]: column k of each row's Hessian
    return (H + H.transpose(1, 2)) / 2
