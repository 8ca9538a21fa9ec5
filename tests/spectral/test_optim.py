"""``DampedNewton`` (``backprism.spectral.optim``): training a logistic regression with closure
and context steps, adaptive damping; and on every device (the ``device`` fixture) one step
against ``θ ← θ + η Σ_d e_d (−ḡᵀe_d)/(λ_d + δ)`` over the top eigenpairs of the dense GGN.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import backprism
from backprism import extend
from backprism.spectral import DampedNewton
from tests.common import assert_on_device, build_on_device, resolved
from tests.reference import ggn_mean_over_samples, per_sample_grads


def _logreg(seed=0):
    torch.manual_seed(seed)
    X = torch.randn(32, 5)
    w = torch.randn(5, 3)
    y = (X @ w + 0.5 * torch.randn(32, 3)).argmax(1)
    model = backprism.extend(nn.Linear(5, 3))
    return model, backprism.extend(nn.CrossEntropyLoss()), X, y


@pytest.mark.parametrize("adaptive", [False, True])
def test_damped_newton_optimizer_closure(adaptive):
    model, lossf, X, y = _logreg()
    opt = DampedNewton(model.parameters(), damping=1.0, adaptive=adaptive)
    losses = [float(opt.step(lambda: lossf(model(X), y))) for _ in range(8)]
    final = float(lossf(model(X), y))
    assert final < 0.7 * losses[0]
    assert all(b <= a + 1e-6 for a, b in itertools.pairwise(losses))


def test_damped_newton_optimizer_context():
    model, lossf, X, y = _logreg(1)
    opt = DampedNewton(model.parameters(), lr=0.8, damping=0.5)
    start = float(lossf(model(X), y))
    for _ in range(5):
        with opt.collect():
            lossf(model(X), y).backward()
        opt.step()
    assert float(lossf(model(X), y)) < 0.8 * start
    with pytest.raises(RuntimeError, match="no Newton direction"):
        opt.step()


# -- on a device ----------------------------------------------------------------------------------
def _top(k: int):
    return lambda evals: list(range(evals.numel() - k, evals.numel()))


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_damped_newton_step_on_device(device):
    """One closure step: ``θ ← θ + η Σ_d e_d (−ḡᵀe_d)/(λ_d + δ)`` over the top 3 eigenpairs of
    the GGN (``λ̄_d = λ_d`` without sub-sampling); then a backward-in-context step and an
    adaptive step run on the device."""
    lr, damping, k = 0.7, 0.5, 3
    model, lossfunc, X, y, _ = build_on_device("mlp", device, seed=8)
    G = ggn_mean_over_samples(model, lossfunc, X, y)
    g = torch.cat([v.sum(0).flatten() for v in per_sample_grads(model, lossfunc, X, y).values()])
    evals, evecs = torch.linalg.eigh(G)
    lam, e = evals[-k:], evecs[:, -k:]
    expected = lr * e @ (-(g @ e) / (lam + damping))
    extend(model), extend(lossfunc)
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    opt = DampedNewton(model.parameters(), lr=lr, damping=damping, criterion=_top(k))
    loss = opt.step(lambda: lossfunc(model(X), y))
    assert_on_device(loss, device, "closure loss")
    for p in model.parameters():
        assert_on_device(p, device, "parameter")
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(after - before, expected, rtol=1e-6, atol=1e-10)

    with opt.collect():
        lossfunc(model(X), y).backward()
    opt.step()
    adaptive = DampedNewton(model.parameters(), damping=1.0, adaptive=True)
    adaptive.step(lambda: lossfunc(model(X), y))
    assert math.isfinite(adaptive.last_rho)
    for p in model.parameters():
        assert p.device == resolved(device) and torch.isfinite(p).all()
