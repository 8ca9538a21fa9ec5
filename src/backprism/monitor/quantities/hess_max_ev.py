r"""Largest eigenvalue of the mini-batch loss Hessian (Cockpit's ``HessMaxEV``).

``λ_max(∇²_θ L)`` by Lanczos (:mod:`backprism.monitor.hessmaxev`) on Hessian-vector products
``Hv = ∂(∇L · v)/∂θ`` through the graph kept by ``loss.backward(create_graph=True)`` (the monitor
asks for it on this quantity's steps: ``create_graph=monitor.create_graph(step)``). The
iteration is warm-started from the previous step's eigenvector (plus a random component so the
Krylov space cannot miss a new leading direction) and stops at relative accuracy ``rtol``
(default ``1e-3``). Returns a float. Needs no engine extension; works with BatchNorm in train
mode.

Cost per tracked step: the ``create_graph`` backward plus one Hessian-vector product (about two
backward passes) per Lanczos iteration; warm-started steps typically need 4–8 iterations at
``rtol = 1e-3`` (the first ~25). Memory: the Lanczos basis, ``iterations × D`` numbers of the
parameters' dtype (e.g. 8 × 1.3 M float32 ≈ 42 MB for mnist_mlp), plus the kept graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from backprism.engine.double_backward import explain_double_backward
from backprism.monitor.hessmaxev import lanczos_max_eig
from backprism.monitor.quantities.base import Schedule, SingleStepQuantity, StepData

__all__ = ["HessMaxEV"]


class HessMaxEV(SingleStepQuantity):
    """Largest Hessian eigenvalue (float) by warm-started Lanczos.

    Args:
        track_schedule: steps at which it is computed.
        verbose: print values.
        rtol: relative accuracy of the eigenvalue (default ``1e-3``).
        max_iter: most Hessian-vector products per step (default 100).
        warm_start: start from the previous eigenvector (default ``True``).
    """

    after_cleanup = True

    def __init__(
        self,
        track_schedule: Schedule,
        verbose: bool = False,
        rtol: float = 1e-3,
        max_iter: int = 100,
        warm_start: bool = True,
    ) -> None:
        super().__init__(track_schedule, verbose=verbose)
        self._rtol = rtol
        self._max_iter = max_iter
        self._warm_start = warm_start
        self._vector: Tensor | None = None
        self.iterations: dict[int, int] = {}

    def hyperparameters(self) -> dict[str, Any]:
        return {"rtol": self._rtol, "max_iter": self._max_iter}

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

    def _compute(self, global_step: int, data: StepData) -> float:
        params = data.params
        grads = self._grads(data)
        sizes = [p.numel() for p in params]
        ref = params[0]

        def hvp(v: Tensor) -> Tensor:
            vs = [c.view_as(p) for c, p in zip(v.split(sizes), params)]
            with explain_double_backward(self.key):
                hv = torch.autograd.grad(
                    grads, params, grad_outputs=vs, retain_graph=True, allow_unused=True
                )
            return torch.cat(
                [
                    (h if h is not None else torch.zeros_like(p)).reshape(-1).detach()
                    for h, p in zip(hv, params)
                ]
            )

        dim = sum(sizes)
        rand = torch.randn(dim, dtype=ref.dtype, device=ref.device)
        v0 = rand / rand.norm()
        if self._warm_start and self._vector is not None and self._vector.numel() == dim:
            v0 = self._vector.to(ref.dtype) + 0.1 * v0
        theta, vec, iters = lanczos_max_eig(hvp, v0, tol=self._rtol, max_iter=self._max_iter)
        self._vector = vec.detach()
        self.iterations[global_step] = iters
        return float(theta)
