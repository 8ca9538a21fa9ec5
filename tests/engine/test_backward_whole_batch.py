"""Whole-batch curvature through BatchNorm in train mode (samples mixed by batch statistics).

Per-sample quantities are undefined there, but the GGN of the batch is: ``G = Jᵀ (∇²_f L) J``
with ``J`` the Jacobian of the *whole batch's* outputs (every output depends on every sample
through the batch mean and variance). Reference: ``J`` by ``jacrev`` of the full-batch forward
in train mode, the loss Hessian by ``hessian``, float64 — from the definition, independent of
backprism. Checked: ``DiagGGNExact`` is ``diag G``; ``SqrtGGNExact``'s ``V`` (``[C, N, *p]``)
satisfies ``Σₖₙ vec V[k,n] vec V[k,n]ᵀ = G``; ``DiagGGNMC`` is unbiased; extensions that need
per-sample separation are still refused before anything is written.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

from backprism import collect, extend
from backprism.extensions import (
    BatchDiagGGNExact,
    BatchGrad,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
    Variance,
)
from tests.common import assert_mc_within

DT = torch.float64


def _problem(name: str) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    n = 5
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)
        )
        X, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
        lf: nn.Module = nn.CrossEntropyLoss()
    elif name == "conv":
        model = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
            nn.Linear(12, 2),
        )
        X, y = torch.randn(n, 2, 2, 2), torch.randn(n, 2)
        lf = nn.MSELoss(reduction="sum")
    else:  # no running statistics: batch statistics in eval mode too
        model = nn.Sequential(
            nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.Sigmoid(),
            nn.Linear(4, 2),
        )
        model.eval()
        X, y = torch.randn(n, 3), torch.randn(n, 2)
        lf = nn.MSELoss()
    model = model.to(DT)
    with torch.no_grad():  # non-trivial affine parameters
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model, lf, X.to(DT), y if y.dtype == torch.long else y.to(DT)


def _ggn(model: nn.Module, lf: nn.Module, X: Tensor, y: Tensor) -> tuple[Tensor, list]:
    """The whole batch's GGN ``[P, P]`` (parameters in ``named_parameters`` order)."""
    ref = copy.deepcopy(model)
    for m in ref.modules():  # train mode: batch statistics; no running-statistics update
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (
            m.training or not m.track_running_stats
        ):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None
    names = [k for k, _ in ref.named_parameters()]
    theta = {k: p.detach() for k, p in ref.named_parameters()}
    buffers = {k: b.clone() for k, b in ref.named_buffers()}

    def f(th: dict) -> Tensor:
        return functional_call(ref, {**th, **buffers}, (X,))

    out = f(theta)
    jac = jacrev(f)(theta)
    J = torch.cat([jac[k].reshape(out.numel(), -1) for k in names], 1)
    H = hessian(lambda o: lf(o, y))(out).reshape(out.numel(), out.numel())
    return J.T @ H @ J, [(k, theta[k].shape) for k in names]


def _blocks(G: Tensor, shapes: list) -> dict[str, Tensor]:
    out, start = {}, 0
    for k, shape in shapes:
        size = int(torch.Size(shape).numel())
        out[k] = G[start : start + size, start : start + size]
        start += size
    return out


@pytest.mark.parametrize("name", ["mlp", "conv", "no_running_stats"])
def test_diag_ggn_exact_of_the_whole_batch(name: str) -> None:
    model, lf, X, y = _problem(name)
    G, shapes = _ggn(model, lf, X, y)
    extend(model)
    extend(lf)
    with collect(DiagGGNExact()):
        lf(model(X), y).backward()
    for (k, p), (_, shape) in zip(model.named_parameters(), shapes):
        block = _blocks(G, shapes)[k]
        torch.testing.assert_close(p.diag_ggn_exact, torch.diagonal(block).reshape(shape))


@pytest.mark.parametrize("name", ["mlp", "conv"])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_sqrt_ggn_exact_of_the_whole_batch(name: str, chunk_size: int | None) -> None:
    model, lf, X, y = _problem(name)
    G, shapes = _ggn(model, lf, X, y)
    extend(model)
    extend(lf)
    with collect(SqrtGGNExact(), chunk_size=chunk_size):
        lf(model(X), y).backward()
    n = X.shape[0]
    for (k, p), (_, shape) in zip(model.named_parameters(), shapes):
        V = p.sqrt_ggn_exact
        assert V.shape[1:] == (n, *shape)
        flat = V.reshape(-1, p.numel())
        torch.testing.assert_close(flat.T @ flat, _blocks(G, shapes)[k])


def test_diag_ggn_mc_is_unbiased() -> None:
    model, lf, X, y = _problem("mlp")
    G, _ = _ggn(model, lf, X, y)
    extend(model)
    extend(lf)
    draws = []
    for seed in range(300):
        torch.manual_seed(seed)
        with collect(DiagGGNMC(mc_samples=2)):
            lf(model(X), y).backward()
        draws.append(torch.cat([p.diag_ggn_mc.reshape(-1) for p in model.parameters()]))
    stacked = torch.stack(draws)
    assert_mc_within(stacked.mean(0), stacked, torch.diagonal(G))


def test_sqrt_ggn_mc_shape_and_subsampling_refused() -> None:
    model, lf, X, y = _problem("mlp")
    extend(model)
    extend(lf)
    with collect(SqrtGGNMC(mc_samples=3)):
        lf(model(X), y).backward()
    for p in model.parameters():
        assert p.sqrt_ggn_mc.shape == (3, X.shape[0], *p.shape)
    with pytest.raises(ValueError, match="subsampling"), collect(SqrtGGNExact(subsampling=[0])):
        lf(model(X), y).backward()


@pytest.mark.parametrize("ext", [BatchGrad, Variance, BatchDiagGGNExact])
def test_per_sample_quantities_still_refused_before_writing(ext: type) -> None:
    model, lf, X, y = _problem("mlp")
    extend(model)
    extend(lf)
    with pytest.raises(RuntimeError, match="train mode mixes the samples"), collect(ext()):
        lf(model(X), y).backward()
    for p in model.parameters():
        assert p.grad is None and not hasattr(p, ext().savefield)
