"""Cross-entropy loss-Hessian square roots at language-model layouts, against dense float64
Hessians of the real loss module (``torch.func``), and the cost warning.

Covered: logits ``[N, V, T]`` (CrossEntropyLoss's layout for a decoder) and ``[N·T, V]``
(flattened), class weights, ``ignore_index``, label smoothing, probability targets; exact columns
written straight into the input layout and generated in arbitrary vocabulary chunks; MC columns
(binary-search sampling, no one-hot) unbiased within 6 standard errors; the warning above
``EXACT_COLUMNS_WARNING`` exact columns per sample (once per ``(C, positions)``); a decoder's
``DiagGGNExact`` under a small ``memory_budget`` (many vocabulary chunks) against ``reference``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from backprism import collect, extend
from backprism.engine import loss_hessian as lh
from backprism.engine.loss_hessian import CurvatureCostWarning, loss_hessian_sqrt
from backprism.extensions import DiagGGNExact, DiagGGNMC
from common import TinyGPT
from test_losses import column_samples, reference_blocks

from reference import diag_ggn

DT = torch.float64
MC_M = 4000
N_SE = 6.0


def _problem(layout: str, n: int = 2, v: int = 7, t: int = 3, seed: int = 0, **kw):
    """Logits and class-index targets for ``n`` samples of ``t`` positions and ``v`` classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, t, generator=g, dtype=DT)
    y = torch.randint(0, v, (n, t), generator=g)
    if kw.get("ignore_index") is not None:
        y[0, 1] = kw["ignore_index"]
    if kw.pop("probs", False):
        y = torch.softmax(torch.randn(n, v, t, generator=g, dtype=DT), 1)
        if layout == "flat":
            y = y.transpose(1, 2).reshape(n * t, v)
    elif layout == "flat":
        y = y.reshape(n * t)
    if layout == "flat":
        x = x.transpose(1, 2).reshape(n * t, v).contiguous()
    if "weight" in kw:
        kw["weight"] = torch.rand(v, generator=g, dtype=DT) + 0.5
    return nn.CrossEntropyLoss(**kw), x, y


OPTIONS = {
    "plain": {},
    "sum": {"reduction": "sum"},
    "weighted_ignore": {"weight": True, "ignore_index": 2},
    "smoothing": {"label_smoothing": 0.2},
    "probs": {"probs": True, "label_smoothing": 0.1},
}


@pytest.mark.parametrize("layout", ["nvt", "flat"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_exact_columns(layout: str, option: str):
    module, x, y = _problem(layout, **OPTIONS[option])
    n = 2
    ref = reference_blocks(lambda z: module(z, y), [x], n)
    cols = loss_hessian_sqrt(module, [x.detach().requires_grad_(True), y], ("exact",), n)
    assert cols.num == 7 * 3
    whole = cols.materialize()[0]
    assert whole.shape == (cols.num, *x.shape) and whole.is_contiguous()
    for S, H in zip(column_samples([whole], n), ref):
        torch.testing.assert_close(S.T @ S, H, atol=1e-12, rtol=1e-10)
    # vocabulary chunks of any size give the same columns
    for step in (1, 4, 10):
        parts = torch.cat([cols.chunk(a, a + step)[0] for a in range(0, cols.num, step)])
        torch.testing.assert_close(parts, whole, atol=0, rtol=0)


@pytest.mark.parametrize("layout", ["nvt", "flat"])
@pytest.mark.parametrize("option", ["plain", "weighted_ignore", "smoothing"])
def test_mc_columns_unbiased(layout: str, option: str):
    module, x, y = _problem(layout, v=5, t=2, **OPTIONS[option])
    n = 2
    ref = reference_blocks(lambda z: module(z, y), [x], n)
    torch.manual_seed(0)
    cols = loss_hessian_sqrt(module, [x.detach().requires_grad_(True), y], ("mc", MC_M), n)
    S = cols.materialize()[0]
    assert S.shape == (MC_M, *x.shape)
    for Sn, H in zip(column_samples([S], n), ref):
        draws = MC_M * torch.einsum("ki,kj->kij", Sn, Sn)  # i.i.d. draws of the estimator
        mean = draws.mean(0)
        torch.testing.assert_close(Sn.T @ Sn, mean, atol=1e-10, rtol=1e-8)
        se = draws.std(0) / math.sqrt(MC_M)
        assert ((mean - H).abs() <= N_SE * se + 1e-10).all()


def test_mc_column_structure():
    """Each MC column is ``f·(p − e_ŷ)/√M`` per position: it sums to zero over classes and has
    one negative entry ``f(p_ŷ − 1)/√M`` — also at a vocabulary of 5000."""
    n, v, t = 2, 5000, 3
    module, x, y = _problem("nvt", n=n, v=v, t=t)
    torch.manual_seed(1)
    cols = loss_hessian_sqrt(module, [x.detach().requires_grad_(True), y], ("mc", 3), n)
    S = cols.materialize()[0]  # [3, N, V, T]
    p = torch.softmax(x, 1)
    f = math.sqrt(1.0 / (n * t))  # mean reduction over N·T positions
    torch.testing.assert_close(S.sum(2), torch.zeros(3, n, t, dtype=DT), atol=1e-12, rtol=0)
    neg = S < 0
    assert (neg.sum(2) == 1).all()
    yhat = neg.double().argmax(2)  # [3, N, T]
    picked = S.gather(2, yhat.unsqueeze(2)).squeeze(2)
    p_hat = torch.stack([p.gather(1, yhat[m].unsqueeze(1)).squeeze(1) for m in range(3)])
    torch.testing.assert_close(picked, f * (p_hat - 1) / math.sqrt(3), atol=1e-12, rtol=1e-10)


def test_cost_warning_once(monkeypatch):
    monkeypatch.setattr(lh, "_WARNED_COST", set())
    module, x, y = _problem("nvt", n=1, v=1100, t=4)  # K = 4400 > 4096
    x.requires_grad_(True)
    with pytest.warns(CurvatureCostWarning, match="4400 columns per sample"):
        loss_hessian_sqrt(module, [x, y], ("exact",), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CurvatureCostWarning)
        loss_hessian_sqrt(module, [x, y], ("exact",), 1)  # same (C, positions): quiet
        loss_hessian_sqrt(module, [x, y], ("mc", 1), 1)  # MC: no warning
        small_module, xs, ys = _problem("nvt", n=1, v=1000, t=4)  # K = 4000
        loss_hessian_sqrt(small_module, [xs.requires_grad_(True), ys], ("exact",), 1)


def test_decoder_diag_ggn_in_vocabulary_chunks(monkeypatch):
    """A tied-embedding decoder's exact GGN diagonal with columns pushed back a few at a time
    (tiny ``memory_budget``), against the dense reference; the warning threshold lowered to
    this vocabulary shows the warning along the way."""
    monkeypatch.setattr(lh, "EXACT_COLUMNS_WARNING", 10)
    monkeypatch.setattr(lh, "_WARNED_COST", set())
    torch.manual_seed(2)
    model = TinyGPT(vocab=5, d=4, heads=2, t_max=4).to(DT)
    x, y = torch.randint(0, 5, (2, 4)), torch.randint(0, 5, (2, 4))
    ref = diag_ggn(model, nn.CrossEntropyLoss(), x, y)
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    with pytest.warns(CurvatureCostWarning, match="20 columns"), collect(
        DiagGGNExact(), memory_budget=4096
    ):
        lossfunc(model(x), y).backward()
    seen = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            torch.testing.assert_close(p.diag_ggn_exact, ref[name], atol=1e-11, rtol=1e-8)


def test_decoder_diag_ggn_mc_runs_at_large_vocabulary():
    """MC columns at a 3000-token vocabulary: one sampled column per step, right shapes."""
    torch.manual_seed(3)
    model = extend(TinyGPT(vocab=3000, d=4, heads=2, t_max=4))
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randint(0, 3000, (2, 4)), torch.randint(0, 3000, (2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CurvatureCostWarning)
        with collect(DiagGGNMC()):
            lossfunc(model(x), y).backward()
    for p in model.parameters():
        assert p.diag_ggn_mc.shape == p.shape and bool((p.diag_ggn_mc >= 0).all())

