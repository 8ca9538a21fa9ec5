"""Hessian-vector products through attention: a forward run inside a ``collect`` holding an
extension that differentiates the backward graph twice (``HutchinsonDiagHessian``) computes
attention with PyTorch's math kernel, so the fused kernels' missing second derivative never
stops it; a forward outside the context gets the clear error naming the fix."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian

from backprism import collect, extend
from backprism.extensions import HutchinsonDiagHessian
from tests.common import assert_mc_within

DT = torch.float64


def _problem() -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(12, 3)).to(DT)
    return model, nn.CrossEntropyLoss(), torch.randn(3, 3, 4, dtype=DT), torch.tensor([0, 2, 1])


def _hessian_diag(model: nn.Module, lf: nn.Module, X: Tensor, y: Tensor) -> Tensor:
    theta = {k: p.detach() for k, p in model.named_parameters()}
    names = list(theta)
    flat = torch.cat([v.reshape(-1) for v in theta.values()])
    sizes = [v.numel() for v in theta.values()]

    def f(vec: Tensor) -> Tensor:
        parts = dict(zip(names, torch.split(vec, sizes)))
        th = {k: parts[k].reshape(theta[k].shape) for k in names}
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            return lf(functional_call(model, th, (X,)), y)

    return torch.diagonal(hessian(f)(flat))


def test_hutchinson_through_attention_is_unbiased() -> None:
    model, lf, X, y = _problem()
    ref = _hessian_diag(model, lf, X, y)
    extend(model)
    extend(lf)
    draws = []
    for seed in range(200):
        torch.manual_seed(seed)
        with collect(HutchinsonDiagHessian()):
            lf(model(X), y).backward()
        draws.append(torch.cat([p.diag_h_hutchinson.reshape(-1) for p in model.parameters()]))
    stacked = torch.stack(draws)
    assert_mc_within(stacked.mean(0), stacked, ref)


def test_forward_outside_the_context_gets_the_way_out() -> None:
    model, lf, X, y = _problem()
    extend(model)
    extend(lf)
    loss = lf(model(X), y)  # forward outside collect: the fused kernel
    with pytest.raises(RuntimeError, match=r"SDPBackend\.MATH"), collect(HutchinsonDiagHessian()):
        loss.backward()
