"""ViViT 1.0's Gram-matrix hooks, ``vivit.utils`` and ``vivit.hessianfree`` through
``backprism.compat.vivit``, against float64 ``torch.func``/autograd references."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from torch import nn

from backprism.compat.backpack import backpack, extend, extensions
from backprism.compat.vivit.extensions.firstorder.batch_grad.gram_batch_grad import (
    CenteredBatchGrad,
    CenteredGramBatchGrad,
    GramBatchGrad,
)
from backprism.compat.vivit.extensions.secondorder.sqrt_ggn.gram_sqrt_ggn import (
    GramSqrtGGNExact,
)
from tests.reference import ggn, loss_hessian, per_sample_grads

DT = torch.double


def _problem(seed: int = 0, n: int = 5, reduction: str = "mean"):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Sigmoid(), nn.Linear(3, 3)).to(DT)
    X = torch.randn(n, 4, dtype=DT)
    y = torch.randint(0, 3, (n,))
    return model, nn.CrossEntropyLoss(reduction=reduction), X, y


def _flat_per_sample(model, loss_fn, X, y) -> torch.Tensor:
    gb = per_sample_grads(model, loss_fn, X, y)
    return torch.cat([g.reshape(X.shape[0], -1) for g in gb.values()], 1)


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("layerwise", [False, True])
def test_gram_batch_grad(centered, layerwise):
    """``[N, N]`` Gram matrix of the (centered) individual gradients, summed over parameters;
    ``layerwise`` stores each parameter's contribution, else ``None``."""
    model, loss_fn, X, y = _problem()
    G = _flat_per_sample(model, loss_fn, X, y)
    if centered:
        G = G - G.mean(0)
    cls = CenteredGramBatchGrad if centered else GramBatchGrad
    hook = cls(layerwise=layerwise)
    m, lf = extend(model), extend(loss_fn)
    with backpack(extensions.BatchGrad(), extension_hook=hook):
        lf(m(X), y).backward()
    torch.testing.assert_close(hook.get_result(), G @ G.T, rtol=1e-10, atol=1e-12)
    total = 0
    for p in model.parameters():
        stored = getattr(p, hook.savefield)
        assert (stored is not None) == layerwise
        if layerwise:
            total = total + stored
        assert hasattr(p, cls._SAVEFIELD_GRAD_BATCH)
    if layerwise:
        torch.testing.assert_close(total, G @ G.T, rtol=1e-10, atol=1e-12)


def test_gram_batch_grad_frees_grad_batch_and_centered_batch_grad():
    model, loss_fn, X, y = _problem(1)
    gb = per_sample_grads(model, loss_fn, X, y)
    m, lf = extend(model), extend(loss_fn)
    hook = GramBatchGrad(free_grad_batch=True)
    with backpack(extensions.BatchGrad(), extension_hook=hook):
        lf(m(X), y).backward()
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())
    for p in model.parameters():
        del p.gram_grad_batch
    hook = CenteredBatchGrad()
    with backpack(extensions.BatchGrad(), extension_hook=hook):
        lf(m(X), y).backward()
    for p, g in zip(model.parameters(), gb.values()):
        torch.testing.assert_close(p.centered_grad_batch, g - g.mean(0))


def test_gram_sqrt_ggn_exact_spectrum():
    """The nonzero eigenvalues of the ``[C·N, C·N]`` Gram matrix ``Vᵀ V`` are the GGN's."""
    from backprism.compat.vivit.utils.eig import symeig

    model, loss_fn, X, y = _problem(2, reduction="sum")
    G = ggn(model, loss_fn, X, y)
    m, lf = extend(model), extend(loss_fn)
    hook = GramSqrtGGNExact()
    with backpack(extensions.SqrtGGNExact(), extension_hook=hook):
        lf(m(X), y).backward()
    gram = hook.get_result()
    assert gram.shape == (3 * X.shape[0],) * 2
    ev_gram, _ = symeig(gram)
    ev_ggn, _ = symeig(G)
    torch.testing.assert_close(ev_gram, ev_ggn, rtol=1e-8, atol=1e-10)


def test_utils_gram_eig_checks():
    from backprism.compat.vivit.utils import checks, eig, gram

    torch.manual_seed(3)
    t = torch.randn(2, 3, 4, dtype=DT)
    flat = t.reshape(6, 4)
    torch.testing.assert_close(gram.pairwise_dot(t, start_dim=2), flat @ flat.T)
    assert gram.pairwise_dot(t, start_dim=2, flatten=False).shape == (2, 3, 2, 3)
    assert gram.reshape_as_square(torch.arange(9.0)).shape == (3, 3)
    A = flat.T @ flat  # 4×4 rank 4 → shifted PSD
    B = torch.randn(4, 2, dtype=DT)
    low = B @ B.T  # rank 2
    evals, evecs = eig.symeig(low, eigenvectors=True)
    assert evals.numel() == 2
    torch.testing.assert_close(evecs @ torch.diag(evals) @ evecs.T, low)
    ref = torch.linalg.eigvalsh(A)
    ev, _ = eig.symeig_psd(A, shift=1.0)
    torch.testing.assert_close(ev, ref)
    C = A.clone()
    eig.symeig_psd(C, shift=2.0, shift_inplace=True)
    torch.testing.assert_close(C, A)
    torch.testing.assert_close(eig.shift_diag(A, 1.5), A + 1.5 * torch.eye(4, dtype=DT))
    with pytest.raises(ValueError):
        eig.symeig(torch.zeros(2, 2, 2))
    p = torch.zeros(1)
    with pytest.raises(ValueError):
        checks.check_key_exists([{"params": [p]}, {}], "params")
    with pytest.raises(ValueError):
        checks.check_unique_params([{"params": [p]}, {"params": [p]}])
    with pytest.raises(ValueError):
        checks.check_subsampling_unique([0, 1, 0])
    checks.check_subsampling_unique(None)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_hessianfree_linear_operators(reduction):
    """Hessian/GGN of the loss over a data set of several mini-batches as SciPy operators,
    against the dense float64 matrices of the merged batch."""
    hf = importlib.import_module("backprism.compat.vivit.hessianfree")
    model, loss_fn, X, y = _problem(4, n=8, reduction=reduction)
    data = [(X[:3], y[:3]), (X[3:], y[3:])]
    v = np.random.default_rng(0).standard_normal(sum(p.numel() for p in model.parameters()))
    H = loss_hessian(model, loss_fn, X, y).detach().numpy()
    G = ggn(model, loss_fn, X, y).detach().numpy()
    Hv = hf.HessianLinearOperator(model, loss_fn, data, torch.device("cpu")) @ v
    Gv = hf.GGNLinearOperator(model, loss_fn, data, torch.device("cpu")) @ v
    np.testing.assert_allclose(Hv, H @ v, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(Gv, G @ v, rtol=1e-10, atol=1e-12)


def test_hessianfree_detects_nondeterminism():
    hf = importlib.import_module("backprism.compat.vivit.hessianfree")
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(), nn.ReLU(), nn.Linear(6, 2)).to(DT)
    data = [(torch.randn(3, 4, dtype=DT), torch.randint(0, 2, (3,))) for _ in range(2)]
    with pytest.raises(RuntimeError, match="deterministic"):
        hf.HessianLinearOperator(model, nn.CrossEntropyLoss(), data, torch.device("cpu"))
