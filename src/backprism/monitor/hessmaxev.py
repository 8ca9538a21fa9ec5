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

**Host reads.** The products, the basis and ``T``'s entries stay on the operator's device. The
convergence test needs ``T``'s eigenvalues on the host:

* :func:`lanczos_max_eig` evaluates it every ``check_every`` products (one transfer of ``T``'s
  new entries each time; ``check_every = 1`` is the classic iteration, the cheapest on a CPU);
* :func:`lanczos_fixed` runs a fixed number of products without any host read: the Ritz pair
  of the small ``T`` is found on the device by repeated squaring of ``T − σI`` (``σ`` a
  Gershgorin lower bound, so the top eigenvalue dominates; 48 squarings separate eigenvalues
  closer than ``1e-13`` relative), and :func:`ritz_from_host` evaluates the exact Ritz value
  and the residual test later, when ``T``'s entries reach the host with the other values.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from backprism.monitor.deferred import to_host

__all__ = ["lanczos_fixed", "lanczos_max_eig", "ritz_from_host"]

_SQUARINGS = 48


class _Basis:
    """The Lanczos basis in one growing buffer (rows ``0..k``), ``T``'s entries as tensors."""

    def __init__(self, v0: Tensor, max_iter: int) -> None:
        self.dim = v0.numel()
        self.max_iter = max_iter
        cap = min(max_iter + 1, 16)
        self.rows = v0.new_empty(cap, self.dim)
        self.rows[0] = v0 / v0.norm()
        self.alphas: list[Tensor] = []
        self.betas: list[Tensor] = []
        self.tiny = torch.finfo(v0.dtype).tiny

    def step(self, matvec: Callable[[Tensor], Tensor]) -> None:
        """One product: appends ``α_k`` and ``β_k`` and the next basis vector."""
        k = len(self.alphas)
        q = self.rows[k]
        w = matvec(q)
        self.alphas.append(torch.dot(w, q))
        stack = self.rows[: k + 1]  # [k + 1, D]
        for _ in range(2):  # full re-orthogonalization, twice
            w = w - stack.t() @ (stack @ w)
        b = w.norm()
        self.betas.append(b)
        if k + 1 == self.rows.shape[0]:  # grow (doubling, at most max_iter + 1 rows)
            grown = self.rows.new_empty(min(2 * self.rows.shape[0], self.max_iter + 1), self.dim)
            grown[: k + 1] = self.rows
            self.rows = grown
        if k + 1 < self.rows.shape[0]:
            self.rows[k + 1] = w / b.clamp_min(self.tiny)

    def ritz_vector(self, s: Tensor) -> Tensor:
        stack = self.rows[: s.numel()]
        y = stack.t() @ s.to(stack)
        return y / y.norm()


def _host_ritz(alphas: np.ndarray, betas: np.ndarray) -> tuple[float, np.ndarray, float, int]:
    """``(θ, s, residual, k)`` of the tridiagonal matrix of the first ``k`` products, ``k`` the
    number before the first breakdown (``β ≈ 0``: an invariant subspace, exact Ritz values)."""
    k = len(alphas)
    for i, b in enumerate(betas[: k - 1]):
        if b <= 1e-12 * max(1.0, float(np.abs(alphas[: i + 1]).max())):
            k = i + 1
            break
    t = np.diag(alphas[:k].astype(np.float64))
    if k > 1:
        off = betas[: k - 1].astype(np.float64)
        t = t + np.diag(off, 1) + np.diag(off, -1)
    if not np.all(np.isfinite(t)):
        raise FloatingPointError("lanczos_max_eig: the operator produced NaN")
    evals, evecs = np.linalg.eigh(t)
    theta, s = float(evals[-1]), evecs[:, -1]
    residual = abs(float(betas[k - 1]) * float(s[-1]))
    return theta, s, residual, k


def lanczos_max_eig(
    matvec: Callable[[Tensor], Tensor],
    v0: Tensor,
    tol: float = 1e-3,
    max_iter: int = 100,
    check_every: int = 1,
) -> tuple[float, Tensor, int]:
    """Largest eigenvalue of the symmetric operator ``matvec`` and its eigenvector.

    Args:
        matvec: ``v ↦ H v`` on flat vectors of ``v0``'s shape and dtype.
        v0: start vector (need not be normalized; e.g. a previous eigenvector).
        tol: stop when the Ritz residual is at most ``tol·|θ|``.
        max_iter: at most this many products (capped at the dimension); warns if reached.
        check_every: evaluate the convergence test (one host transfer) every this many
            products; the estimate uses all products made.

    Returns:
        ``(θ, y, iterations)``: eigenvalue estimate, unit Ritz vector, number of products.
    """
    dim = v0.numel()
    max_iter = max(1, min(int(max_iter), dim))
    check_every = max(1, int(check_every))
    norm = v0.norm()
    if not torch.isfinite(norm) or norm == 0:
        raise ValueError("lanczos_max_eig: the start vector must be finite and non-zero")
    basis = _Basis(v0, max_iter)
    theta, s, residual, k = float("nan"), np.ones(1), float("nan"), 0
    host_a: list[float] = []
    host_b: list[float] = []
    while True:
        done = len(basis.alphas)
        for _ in range(min(check_every, max_iter - done)):
            basis.step(matvec)
        fresh = to_host([torch.stack(basis.alphas[done:]), torch.stack(basis.betas[done:])])
        host_a += fresh[0].tolist()
        host_b += fresh[1].tolist()
        theta, s, residual, k = _host_ritz(np.asarray(host_a), np.asarray(host_b))
        breakdown = k < len(host_a) or host_b[k - 1] <= 1e-12 * max(1.0, abs(theta))
        if residual <= tol * abs(theta) or breakdown or k == dim:
            break
        if len(host_a) >= max_iter:
            warnings.warn(
                f"lanczos_max_eig: not converged to rtol {tol} in {max_iter} iterations "
                f"(residual {residual:.3g}, eigenvalue {theta:.6g}); returning the estimate",
                RuntimeWarning,
                stacklevel=2,
            )
            break
    y = basis.ritz_vector(torch.as_tensor(s, dtype=torch.float64).to(v0.device))
    return theta, y, len(host_a)


def _device_top_eigenpair(alphas: Tensor, betas: Tensor) -> tuple[Tensor, Tensor]:
    """Top eigenpair ``(θ, s)`` of the symmetric tridiagonal matrix with diagonal ``alphas``
    and off-diagonal ``betas`` (float64), on their device without host reads: repeated squaring
    of ``M = T − σI`` (``σ`` Gershgorin's lower bound, ``M ⪰ 0``), normalised each time, is a
    projector onto the top eigenspace; ``s`` is its largest column, ``θ = sᵀTs``."""
    k = alphas.numel()
    t = torch.diag(alphas)
    if k > 1:
        t = t + torch.diag(betas, 1) + torch.diag(betas, -1)
    radius = t.abs().sum(1) - alphas.abs()
    sigma = (alphas - radius).min()
    eye = torch.eye(k, dtype=t.dtype, device=t.device)
    p = t - sigma * eye
    tiny = torch.finfo(t.dtype).tiny
    p = p / torch.linalg.matrix_norm(p).clamp_min(tiny)
    for _ in range(_SQUARINGS):
        p = p @ p
        p = p / torch.linalg.matrix_norm(p).clamp_min(tiny)
    col = torch.linalg.vector_norm(p, dim=0).argmax()
    s = p.index_select(1, col.reshape(1))[:, 0]
    s = s / torch.linalg.vector_norm(s).clamp_min(tiny)
    theta = s @ (t @ s)
    return theta, s


def lanczos_fixed(
    matvec: Callable[[Tensor], Tensor], v0: Tensor, iterations: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``iterations`` Lanczos products (capped at the dimension) without host reads.

    Returns:
        ``(θ, y, alphas, betas)`` as device tensors: the device estimate of the top Ritz value,
        the unit Ritz vector (for a warm start) and ``T``'s entries (``betas[-1]`` is the last
        residual norm), for :func:`ritz_from_host` once they reach the host.
    """
    iterations = max(1, min(int(iterations), v0.numel()))
    basis = _Basis(v0, iterations)
    for _ in range(iterations):
        basis.step(matvec)
    alphas = torch.stack(basis.alphas).double()
    betas = torch.stack(basis.betas).double()
    theta, s = _device_top_eigenpair(alphas, betas[:-1])
    return theta, basis.ritz_vector(s), alphas, betas


def ritz_from_host(alphas: np.ndarray, betas: np.ndarray) -> tuple[float, float]:
    """``(θ, residual)``: the exact top Ritz value of :func:`lanczos_fixed`'s ``T`` and its
    residual bound ``|β_k s_k|`` (``T`` truncated at a breakdown)."""
    theta, _, residual, _ = _host_ritz(np.asarray(alphas), np.asarray(betas))
    return theta, residual
