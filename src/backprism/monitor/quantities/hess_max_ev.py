r"""Largest eigenvalue of the mini-batch loss Hessian (Cockpit's ``HessMaxEV``).

``λ_max(∇²_θ L)`` by Lanczos (:mod:`backprism.monitor.hessmaxev`) on Hessian-vector products
``Hv = ∂(∇L · v)/∂θ`` through the graph kept by ``loss.backward(create_graph=True)`` (the monitor
asks for it on this quantity's steps: ``create_graph=monitor.create_graph(step)``). The
iteration is warm-started from the previous step's eigenvector (plus a random component so the
Krylov space cannot miss a new leading direction) and stops at relative accuracy ``rtol``
(default ``1e-3``). Returns a float. Needs no engine extension; works with BatchNorm in train
mode.

**Host reads** (``check_every``). On a CPU (``check_every="auto"``) the convergence test runs
after every product, the cheapest choice where reading a value costs nothing. On accelerators
the iteration runs a fixed number of products, ``iterations`` (16; twice that on a cold start
without a previous eigenvector), entirely on the device: no host read during the step. The
exact Ritz value and the residual test are evaluated when the value reaches the host, with a
``RuntimeWarning`` if the residual is above ``rtol·|θ|`` (raise ``iterations``). An integer
``check_every = k`` evaluates the test every ``k`` products instead (one host read each).

**Distributed data parallelism** (a global step, :mod:`backprism.monitor.distributed`): the
Hessian is the global batch's, ``H = Σ_r ρ_r H_r`` (``ρ_r = N_r/N`` for a mean loss), so every
product is this rank's product with the Hessian of its local loss, all-reduced with weight
``ρ_r`` (one all-reduce of ``D`` numbers per product), and the random start vector is rank 0's
(broadcast). Every rank then runs the same iteration on the same numbers, so the convergence
test stops all ranks at the same product. DDP refuses ``backward(create_graph=True)``, so under
``torch.distributed`` with several ranks ``monitor.create_graph(step)`` is ``False`` and the
monitor takes the gradient of this rank's ``info['loss']`` with its graph on entering the step,
before the backward pass (``autograd.grad(..., create_graph=True)``, which keeps the graph for
the backward pass; it costs what the ``create_graph`` backward would). A step inside
``no_sync()`` uses this rank's Hessian.

Cost per tracked step: the ``create_graph`` backward plus one Hessian-vector product (about two
backward passes) per Lanczos iteration; warm-started steps typically need 4–8 iterations at
``rtol = 1e-3`` (the first ~25). Memory: the Lanczos basis, ``iterations × D`` numbers of the
parameters' dtype (e.g. 8 × 1.3 M float32 ≈ 42 MB for mnist_mlp), plus the kept graph.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from backprism.engine.double_backward import explain_double_backward
from backprism.monitor.deferred import host_fast_paths
from backprism.monitor.hessmaxev import lanczos_fixed, lanczos_max_eig, ritz_from_host
from backprism.monitor.quantities.base import Pending, Schedule, SingleStepQuantity, StepData

__all__ = ["HessMaxEV"]


class HessMaxEV(SingleStepQuantity):
    """Largest Hessian eigenvalue (float) by warm-started Lanczos.

    Args:
        track_schedule: steps at which it is computed.
        verbose: print values.
        rtol: relative accuracy of the eigenvalue (default ``1e-3``).
        max_iter: most Hessian-vector products per step (default 100).
        warm_start: start from the previous eigenvector (default ``True``).
        check_every: products between host-side convergence tests; ``None``: none, a fixed
            number of products; ``"auto"`` (default): 1 on a CPU, ``None`` on accelerators.
        iterations: products per step without host-side test (default 16, doubled on a cold
            start).
    """

    after_cleanup = True

    def __init__(
        self,
        track_schedule: Schedule,
        verbose: bool = False,
        rtol: float = 1e-3,
        max_iter: int = 100,
        warm_start: bool = True,
        check_every: int | str | None = "auto",
        iterations: int = 16,
    ) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._rtol = rtol
        self._max_iter = max_iter
        self._warm_start = warm_start
        if not (check_every is None or check_every == "auto" or int(check_every) >= 1):
            raise ValueError(f"check_every must be None, 'auto' or >= 1, got {check_every!r}")
        self._check_every = check_every
        self._fixed = max(1, int(iterations))
        self._vector: Tensor | None = None
        self.iterations: dict[int, int] = {}

    def hyperparameters(self) -> dict[str, Any]:
        return {"rtol": self._rtol, "max_iter": self._max_iter}

    def trim_history(self) -> None:
        """While the log is streamed, :attr:`iterations` keeps its latest 16 entries."""
        super().trim_history()
        for step in list(self.iterations)[:-16]:
            del self.iterations[step]

    def create_graph(self, global_step: int) -> bool:
        return self.should_compute(global_step)

    def info_keys(self, global_step: int) -> set[str]:
        return {"loss"} if self.should_compute(global_step) else set()

    def _grads(self, data: StepData) -> list[Tensor]:
        params = data.params
        if all(p.grad is not None and p.grad.requires_grad for p in params):
            return [p.grad for p in params]
        loss = data.get("loss", self)
        try:
            return list(torch.autograd.grad(loss, params, create_graph=True))
        except RuntimeError as err:
            raise RuntimeError(
                f"{self.key} needs the graph of the backward pass: call "
                f"loss.backward(create_graph=monitor.create_graph({data.step}))"
            ) from err

    def _compute(self, global_step: int, data: StepData) -> Pending:
        params = data.params
        glob = data.dist
        grads = self._grads(data) if data.graph_grads is None else data.graph_grads
        used = [(g, p) for g, p in zip(grads, params) if g is not None]
        sizes = [p.numel() for p in params]
        ref = params[0]

        def hvp(v: Tensor) -> Tensor:
            vs = {id(p): c.view_as(p) for c, p in zip(v.split(sizes), params)}
            with explain_double_backward(self.key):
                hv = torch.autograd.grad(
                    [g for g, _ in used],
                    params,
                    grad_outputs=[vs[id(p)] for _, p in used],
                    retain_graph=True,
                    allow_unused=True,
                )
            out = torch.cat(
                [
                    (h if h is not None else torch.zeros_like(p)).reshape(-1).detach()
                    for h, p in zip(hv, params)
                ]
            )
            # a global step: the global batch's Hessian, Σ_r ρ_r H_r v
            return out if glob is None else glob.loss_sum(out)

        dim = sum(sizes)
        rand = torch.randn(dim, dtype=ref.dtype, device=ref.device)
        if glob is not None:  # every rank iterates from the same vector
            rand = glob.broadcast(rand)
        v0 = rand / rand.norm()
        warm = self._warm_start and self._vector is not None and self._vector.numel() == dim
        if warm:
            assert self._vector is not None
            v0 = self._vector.to(ref.dtype) + 0.1 * v0
        check = self._check_every
        if check == "auto":
            check = 1 if host_fast_paths(ref) else None
        if check is not None:
            theta, vec, iters = lanczos_max_eig(
                hvp, v0, tol=self._rtol, max_iter=self._max_iter, check_every=int(check)
            )
            self._vector = vec.detach()
            self.iterations[global_step] = iters
            return Pending.ready(float(theta))
        count = min(self._max_iter, self._fixed if warm else 2 * self._fixed, dim)
        _, vec, alphas, betas = lanczos_fixed(hvp, v0, count)
        # a step that produced NaN/inf leaves no warm start behind
        ok = torch.isfinite(vec).all()
        self._vector = torch.where(ok, vec.detach(), v0 / v0.norm())
        self.iterations[global_step] = count
        return Pending([alphas, betas], lambda a: self._host_value(global_step, a))

    def _host_value(self, step: int, arrays: list[Any]) -> float:
        theta, residual = ritz_from_host(arrays[0], arrays[1])
        if residual > self._rtol * abs(theta):
            warnings.warn(
                f"{self.key} step {step}: the Lanczos residual {residual:.3g} after "
                f"{self.iterations.get(step)} products is above rtol·|θ| = "
                f"{self._rtol * abs(theta):.3g} (θ = {theta:.6g}); raise iterations= or set "
                "check_every=",
                RuntimeWarning,
                stacklevel=2,
            )
        return theta
