"""ViViT 1.0's ``vivit.hessianfree``: the Hessian and the GGN of a loss over a data set as
SciPy linear operators (``HessianLinearOperator(model, loss_func, data, device) @ v``).

The matrix is that of the loss over the whole data set: each mini-batch's matrix-vector product
is weighted by ``N_batch / N_data`` for a ``reduction="mean"`` loss and by ``1`` for
``reduction="sum"``. With ``check_deterministic`` (default) the constructor computes loss,
gradient and one product twice and raises ``RuntimeError`` if they differ (a model with Dropout,
BatchNorm in train mode with shuffled data, a loader with ``drop_last`` and shuffling).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator
from torch import Tensor
from torch.nn import Module
from torch.nn.utils import parameters_to_vector

__all__ = ["GGNLinearOperator", "HessianLinearOperator"]


def _split(vec: Tensor, params: list[Tensor]) -> list[Tensor]:
    out, i = [], 0
    for p in params:
        out.append(vec[i : i + p.numel()].view_as(p))
        i += p.numel()
    return out


class _LinearOperator(LinearOperator):
    """A curvature matrix of ``loss_func(model(X), y)`` over ``data`` (``[(X, y), …]`` or a
    ``DataLoader``), applied on ``device``."""

    def __init__(
        self,
        model: Module,
        loss_func: Module,
        data: Iterable[tuple[Tensor, Tensor]],
        device: torch.device,
        dtype: Any = np.float32,
        progressbar: bool = False,
        check_deterministic: bool = True,
    ) -> None:
        self._params = [p for p in model.parameters() if p.requires_grad]
        dim = sum(p.numel() for p in self._params)
        super().__init__(shape=(dim, dim), dtype=np.dtype(dtype))
        self._model, self._loss_func, self._data = model, loss_func, data
        self._progressbar = progressbar
        self.to_device(device)
        self._N_data = sum(X.shape[0] for X, _ in self._loop_over_data())
        if check_deterministic:
            old = self._device
            self.to_device(torch.device("cpu"))
            try:
                self._check_deterministic()
            finally:
                self.to_device(old)

    def to_device(self, device: torch.device) -> None:
        """Move model and loss function to ``device`` (in place)."""
        self._device = torch.device(device)
        self._model = self._model.to(self._device)
        self._loss_func = self._loss_func.to(self._device)

    def _loop_over_data(self) -> Iterator[tuple[Tensor, Tensor]]:
        for X, y in self._data:
            yield X.to(self._device), y.to(self._device)

    def _normalization(self, X: Tensor) -> float:
        reduction = getattr(self._loss_func, "reduction", None)
        if reduction == "sum":
            return 1.0
        if reduction == "mean":
            return X.shape[0] / self._N_data
        raise ValueError("Loss must have reduction 'mean' or 'sum'.")

    def gradient_and_loss(self) -> tuple[list[Tensor], Tensor]:
        """Gradient (per parameter) and loss over the data set."""
        total_loss = torch.zeros(1, device=self._device)
        total_grad = [torch.zeros_like(p) for p in self._params]
        for X, y in self._loop_over_data():
            loss = self._loss_func(self._model(X), y)
            w = self._normalization(X)
            for acc, g in zip(total_grad, torch.autograd.grad(loss, self._params)):
                acc.add_(g, alpha=w)
            total_loss.add_(loss.detach(), alpha=w)
        return total_grad, total_loss

    def _check_deterministic(self) -> None:
        rtol, atol = 5e-5, 1e-6
        g1, l1 = self.gradient_and_loss()
        g2, l2 = self.gradient_and_loss()
        if not torch.allclose(l1, l2, rtol=rtol, atol=atol):
            raise RuntimeError("Check for deterministic loss failed.")
        if not torch.allclose(parameters_to_vector(g1), parameters_to_vector(g2), rtol=rtol,
                              atol=atol):
            raise RuntimeError("Check for deterministic gradient failed.")
        v = np.random.rand(self.shape[0])
        if not np.allclose(self @ v, self @ v, rtol=rtol, atol=atol):
            raise RuntimeError("Check for deterministic matvec failed.")

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        ref = self._params[0]
        vec = torch.from_numpy(np.asarray(x).reshape(-1)).to(self._device, ref.dtype)
        v_list = _split(vec, self._params)
        out = [torch.zeros_like(p) for p in self._params]
        for X, y in self._loop_over_data():
            w = self._normalization(X)
            for acc, cur in zip(out, self._matvec_batch(X, y, v_list)):
                acc.add_(cur.detach(), alpha=w)
        return parameters_to_vector([o.contiguous() for o in out]).cpu().numpy()

    def _matvec_batch(self, X: Tensor, y: Tensor, v: list[Tensor]) -> list[Tensor]:
        raise NotImplementedError


class HessianLinearOperator(_LinearOperator):
    """The Hessian of the loss over the data set, as a SciPy linear operator."""

    def _matvec_batch(self, X: Tensor, y: Tensor, v: list[Tensor]) -> list[Tensor]:
        loss = self._loss_func(self._model(X), y)
        grads = torch.autograd.grad(loss, self._params, create_graph=True)
        return list(torch.autograd.grad(grads, self._params, v))


class GGNLinearOperator(_LinearOperator):
    """The generalized Gauss-Newton matrix ``Jᵀ (∇²_f ℓ) J`` of the loss over the data set, as
    a SciPy linear operator."""

    def _matvec_batch(self, X: Tensor, y: Tensor, v: list[Tensor]) -> list[Tensor]:
        output = self._model(X)
        loss = self._loss_func(output, y)
        # J v (forward mode through the double-backward trick)
        u = torch.zeros_like(output, requires_grad=True)
        jt_u = torch.autograd.grad(output, self._params, u, create_graph=True)
        jv = torch.autograd.grad(jt_u, u, v)[0]
        # (∇²_f ℓ) J v
        g_out = torch.autograd.grad(loss, output, create_graph=True)[0]
        hjv = torch.autograd.grad(g_out, output, jv, retain_graph=True)[0]
        # Jᵀ (∇²_f ℓ) J v
        return list(torch.autograd.grad(output, self._params, hjv))
