r"""Lanczos iteration for the largest eigenvalue of a symmetric operator given by products.

For a symmetric ``H`` (here the mini-batch loss Hessian, applied by Hessian-vector products),
``k`` Lanczos steps from a unit vector ``q₁`` build an orthonormal basis ``Q_k`` of the Krylov
space ``span{q₁, Hq₁, …, H^{k−1}q₁}`` and the tridiagonal ``T_k = Q_kᵀ H Q_k``. The largest
eigenvalue ``θ`` of ``T_k`` (Ritz value) with eigenvector ``s`` satisfies
``‖H y − θ y‖ = |β_k s_k|`` for the Ritz vector ``y = Q_k s``, and for symmetric ``H`` some
eigenvalue lies within that residual of ``θ``. We stop once ``|β_k s_k| ≤ tol·|θ|`` (default
``tol = 1e-3``), which bounds the relative error of ``θ`` by ``tol`` (in practice the error is
``O(residual²/gap)``, far smaller). Full re-orthogonalization (applied twice) keeps ``Q_k``
orthonormal in floating point. Unlike a power iteration, which converges to the eigenvalue of
largest *magnitude* (possibly a large negative one), Lanczos targets the algebraically largest.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["lanczos_max_eig"]


def lanczos_max_eig(
    matvec: Callable[[Tensor], Tensor],
    v0: Tensor,
    tol: float = 1e-3,
    max_iter: int = 100,
) -> tuple[float, Tensor, int]:
    """Largest eigenvalue of the symmetric operator ``matvec`` and its eigenvector.

    Args:
        matvec: ``v ↦ H v`` on flat vectors of ``v0``'s shape and dtype.
        v0: start vector (need not be normalized; e.g. a previous eigenvector).
        tol: stop when the Ritz residual is at most ``tol·|θ|``.
        max_iter: at most this many products (capped at the dimension); warns if reached.

    Returns:
        ``(θ, y, iterations)``: eigenvalue estimate, unit Ritz vector, number of products.
    """
    dim = v0.numel()
    max_iter = max(1, min(int(max_iter), dim))
    norm = v0.norm()
    if not torch.isfinite(norm) or norm == 0:
        raise ValueError("lanczos_max_eig: the start vector must be finite and non-zero")
    # the basis lives in one growing buffer (rows 0..k), so re-orthogonalization is two
    # matrix-vector products on a view instead of stacking k vectors every iteration
    cap = min(max_iter + 1, 16)
    basis = v0.new_empty(cap, dim)
    basis[0] = v0 / norm
    alphas: list[float] = []
    betas: list[float] = []
    theta, s = float("nan"), None
    residual = float("nan")
    for k in range(max_iter):
        q = basis[k]
        w = matvec(q)
        a = float(torch.dot(w, q))
        alphas.append(a)
        stack = basis[: k + 1]  # [k + 1, D]
        for _ in range(2):  # full re-orthogonalization, twice
            w = w - stack.t() @ (stack @ w)
        b = float(w.norm())
        t = torch.diag(torch.tensor(alphas, dtype=torch.float64, device="cpu"))
        if betas:
            off = torch.tensor(betas, dtype=torch.float64, device="cpu")
            t = t + torch.diag(off, 1) + torch.diag(off, -1)
        evals, evecs = torch.linalg.eigh(t)
        theta, s = float(evals[-1]), evecs[:, -1]
        residual = abs(b * float(s[-1]))
        if not (theta == theta):  # NaN
            raise FloatingPointError("lanczos_max_eig: the operator produced NaN")
        if residual <= tol * abs(theta) or b <= 1e-12 * max(1.0, abs(theta)) or k + 1 == dim:
            break
        betas.append(b)
        if k + 1 == basis.shape[0]:  # grow (doubling, at most max_iter + 1 rows)
            grown = basis.new_empty(min(2 * basis.shape[0], max_iter + 1), dim)
            grown[: k + 1] = basis
            basis = grown
        basis[k + 1] = w / b
    else:
        warnings.warn(
            f"lanczos_max_eig: not converged to rtol {tol} in {max_iter} iterations "
            f"(residual {residual:.3g}, eigenvalue {theta:.6g}); returning the estimate",
            RuntimeWarning,
            stacklevel=2,
        )
    assert s is not None
    stack = basis[: len(s)]
    y = stack.t() @ s.to(stack)  # the tridiagonal problem is solved on the CPU
    return theta, y / y.norm(), len(alphas)
