"""Loss-Hessian square roots against dense float64 Hessians of the real loss modules.

Exact columns must reproduce every per-sample diagonal block of ``∇²_f L`` (``torch.func``
Hessian of the loss module w.r.t. its differentiable inputs) to 1e-10. Monte-Carlo columns
(``M`` large, scaled by ``1/√M``) are i.i.d. draws ``M·sₖsₖᵀ`` of an unbiased estimator: their
mean must lie within 6 standard errors (estimated from the same draws) + 1e-10 of the
reference, entry by entry.

Language-model layouts (``backprism.engine.loss_hessian`` for cross-entropy): logits ``[N, V, T]``
(CrossEntropyLoss's layout for a decoder) and ``[N·T, V]`` (flattened), class weights,
``ignore_index``, label smoothing, probability targets; exact columns written straight into the
input layout and generated in arbitrary vocabulary chunks; MC columns (binary-search sampling,
no one-hot) unbiased within 6 standard errors; the warning above ``EXACT_COLUMNS_WARNING``
exact columns per sample (once per ``(C, positions)``); a decoder's ``DiagGGNExact`` under a
small ``memory_budget`` (many vocabulary chunks) against ``reference``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import hessian

from backprism import collect, extend
from backprism.engine import loss_hessian as lh
from backprism.engine.loss_hessian import CurvatureCostWarning, loss_hessian_sqrt
from backprism.extensions import DiagGGNExact, DiagGGNMC
from tests.common import TinyGPT
from tests.reference import diag_ggn

DT = torch.float64
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)
MC_M = 4000
N_SE = 6.0


# -- references ---------------------------------------------------------------------------------


def dense_hessian(
    loss_of: Callable[..., Tensor], tensors: list[Tensor], vmap: bool = True
) -> Tensor:
    """Hessian of ``loss_of(*tensors)`` w.r.t. all tensors, flattened and concatenated."""
    sizes = [t.numel() for t in tensors]
    shapes = [t.shape for t in tensors]
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])

    def f(v: Tensor) -> Tensor:
        parts = [p.reshape(s) for p, s in zip(torch.split(v, sizes), shapes)]
        return loss_of(*parts)

    if vmap:
        return hessian(f)(flat)
    return torch.autograd.functional.hessian(f, flat)


def sample_index(tensors: list[Tensor], n_samples: int) -> list[Tensor]:
    """Flat indices (into the concatenation) of every sample's entries (rows sample-major)."""
    out = []
    for n in range(n_samples):
        idx, off = [], 0
        for t in tensors:
            e = t.numel() // n_samples
            idx.append(off + n * e + torch.arange(e))
            off += t.numel()
        out.append(torch.cat(idx))
    return out


def reference_blocks(loss_of, tensors, n_samples, vmap=True) -> list[Tensor]:
    H = dense_hessian(loss_of, tensors, vmap)
    return [H[i][:, i] for i in sample_index(tensors, n_samples)]


def column_samples(cols: list[Tensor], n_samples: int) -> list[Tensor]:
    """``[K, E_n]`` per sample: the columns restricted to sample ``n``, inputs concatenated."""
    k = cols[0].shape[0]
    return [
        torch.cat([c.reshape(k, n_samples, -1)[:, n] for c in cols], 1) for n in range(n_samples)
    ]


def check_exact(module, args, diff, n_samples, loss_of=None, vmap=True) -> None:
    """``diff``: indices of the differentiable args; ``loss_of`` defaults to the module."""
    tensors = [args[i] for i in diff]

    def default(*parts):
        full = list(args)
        for i, p in zip(diff, parts):
            full[i] = p
        return module(*full)

    ref = reference_blocks(loss_of or default, tensors, n_samples, vmap)
    live = [a.detach().requires_grad_(True) if i in diff else a for i, a in enumerate(args)]
    cols = loss_hessian_sqrt(module, live, ("exact",), n_samples)
    assert cols.inputs == list(diff)
    mats = cols.materialize()
    assert cols.num == mats[0].shape[0]
    for m, i in zip(mats, diff):
        assert m.shape == (cols.num, *args[i].shape)
        assert m.dtype == DT
    for S, H in zip(column_samples(mats, n_samples), ref):
        torch.testing.assert_close(S.T @ S, H, atol=1e-10, rtol=1e-10)


def assert_mc_close(S: Tensor, H: Tensor, m: int) -> None:
    """``S``: ``[M, E]`` MC columns (scaled 1/√M) of one sample; ``H``: ``[E, E]`` target."""
    draws = torch.einsum("ki,kj->kij", S, S) * m  # i.i.d. unbiased draws
    mean = draws.mean(0)
    torch.testing.assert_close(mean, S.T @ S, atol=1e-12, rtol=1e-9)
    se = draws.std(0) / math.sqrt(m)
    err = (mean - H).abs()
    bad = err > N_SE * se + 1e-10
    assert not bad.any(), f"MC mean off by {err[bad]} (se {se[bad]})"


def check_mc(module, args, diff, n_samples, ref_blocks, m=MC_M) -> None:
    live = [a.detach().requires_grad_(True) if i in diff else a for i, a in enumerate(args)]
    cols = loss_hessian_sqrt(module, live, ("mc", m), n_samples)
    assert cols.num == m and cols.inputs == list(diff)
    mats = cols.materialize()
    for S, H in zip(column_samples(mats, n_samples), ref_blocks):
        assert_mc_close(S, H, m)


# -- cross-entropy ------------------------------------------------------------------------------


@st.composite
def ce_problem(draw):
    n = draw(st.integers(1, 3))
    p = draw(st.integers(1, 2))
    c = draw(st.integers(2, 4))
    spatial = draw(st.lists(st.integers(1, 3), max_size=2))
    reduction = draw(st.sampled_from(["mean", "sum"]))
    weighted = draw(st.booleans())
    smoothing = draw(st.sampled_from([0.0, 0.2]))
    probs = draw(st.booleans())
    ignore = draw(st.sampled_from([None, -100, 1]))
    seed = draw(st.integers(0, 2**16))
    return n, p, c, spatial, reduction, weighted, smoothing, probs, ignore, seed


def make_ce(n, p, c, spatial, reduction, weighted, smoothing, probs, ignore, seed, scale=2.0):
    """Logits ``scale·N(0, 1)``; MC tests use small logits so that no class is so rare that
    the standard error estimated from the draws is unreliable."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * p, c, *spatial, generator=g, dtype=DT) * scale
    weight = torch.rand(c, generator=g, dtype=DT) + 0.2 if weighted else None
    kw = {"reduction": reduction, "weight": weight, "label_smoothing": smoothing}
    if probs:
        y = torch.softmax(torch.randn(x.shape, generator=g, dtype=DT), 1)
    else:
        y = torch.randint(0, c, (n * p, *spatial), generator=g)
        if ignore is not None:
            kw["ignore_index"] = ignore
            y.view(-1)[0] = ignore  # at least one ignored position
    return nn.CrossEntropyLoss(**kw), x, y


@SETTINGS
@given(ce_problem())
def test_cross_entropy_exact(problem):
    module, x, y = make_ce(*problem)
    n, p, c, spatial = problem[:4]
    check_exact(module, [x, y], [0], n)
    cols = loss_hessian_sqrt(module, [x.requires_grad_(True), y], ("exact",), n)
    assert cols.num == c * p * math.prod(spatial)


def test_cross_entropy_column_layout():
    """Column (c, p, d), k = c·P·D + p·D + d, is nonzero only at row n·P + p, position d."""
    n, p, c, d = 2, 2, 3, 2
    module, x, y = make_ce(n, p, c, [d], "mean", False, 0.0, False, None, 0)
    cols = loss_hessian_sqrt(module, [x.requires_grad_(True), y], ("exact",), n)
    S = cols.materialize()[0]  # [K, N·P, C, D]
    for k in range(cols.num):
        _, pos = divmod(k, p * d)
        row, dd = divmod(pos, d)
        mask = torch.zeros_like(S[k], dtype=torch.bool)
        for i in range(n):
            mask[i * p + row, :, dd] = True
        assert (S[k][~mask] == 0).all()
        assert (S[k][mask] != 0).all()


def test_cross_entropy_chunks_match_whole():
    module, x, y = make_ce(2, 1, 3, [2], "mean", True, 0.1, False, -100, 1)
    cols = loss_hessian_sqrt(module, [x.requires_grad_(True), y], ("exact",), 2)
    whole = cols.materialize()[0]
    parts = torch.cat([cols.chunk(a, a + 5)[0] for a in range(0, cols.num, 5)])
    torch.testing.assert_close(parts, whole, atol=0, rtol=0)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(ce_problem())
def test_cross_entropy_mc(problem):
    module, x, y = make_ce(*problem, scale=0.5)
    n = problem[0]
    ref = reference_blocks(lambda z: module(z, y), [x], n)
    check_mc(module, [x, y], [0], n, ref, m=2000)


def test_cross_entropy_mc_reproducible_and_chunk_independent():
    module, x, y = make_ce(2, 1, 3, [], "mean", False, 0.0, False, None, 0)
    x.requires_grad_(True)
    torch.manual_seed(3)
    a = loss_hessian_sqrt(module, [x, y], ("mc", 7), 2)
    whole = a.materialize()[0]
    torch.manual_seed(3)
    b = loss_hessian_sqrt(module, [x, y], ("mc", 7), 2)
    parts = torch.cat([b.chunk(s, s + 3)[0] for s in range(0, 7, 3)])
    torch.testing.assert_close(parts, whole, atol=0, rtol=0)
    # columns are (p − e_ŷ)/√(N·M): one-hot structure
    p = torch.softmax(x.detach(), 1)
    onehot = p - whole * math.sqrt(2 * 7)
    assert torch.allclose(onehot.sum(-1), torch.ones(7, 2, dtype=DT))
    assert ((onehot.abs() < 1e-12) | ((onehot - 1).abs() < 1e-12)).all()


# -- NLL after log_softmax ------------------------------------------------------------------------


@st.composite
def nll_problem(draw):
    n = draw(st.integers(1, 3))
    p = draw(st.integers(1, 2))
    c = draw(st.integers(2, 4))
    spatial = draw(st.lists(st.integers(1, 3), max_size=1))
    reduction = draw(st.sampled_from(["mean", "sum"]))
    weighted = draw(st.booleans())
    ignore = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return n, p, c, spatial, reduction, weighted, ignore, seed


def _nll_setup(n, p, c, spatial, reduction, weighted, ignore, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * p, c, *spatial, generator=g, dtype=DT) * scale
    y = torch.randint(0, c, (n * p, *spatial), generator=g)
    kw = {"reduction": reduction}
    if weighted:
        kw["weight"] = torch.rand(c, generator=g, dtype=DT) + 0.2
    if ignore:
        kw["ignore_index"] = 0
    return nn.NLLLoss(**kw), x, y


def _through_log_softmax(cols: Tensor, x: Tensor) -> Tensor:
    """Backprop each column at log_softmax(x) to x with plain autograd."""
    x = x.detach().requires_grad_(True)
    lp = F.log_softmax(x, 1)
    return torch.stack([torch.autograd.grad(lp, x, c, retain_graph=True)[0] for c in cols])


@SETTINGS
@given(nll_problem())
def test_nll_exact_backprop_gives_cross_entropy_hessian(problem):
    module, x, y = _nll_setup(*problem)
    n = problem[0]
    ref = reference_blocks(lambda z: module(F.log_softmax(z, 1), y), [x], n)
    lp = F.log_softmax(x.detach().requires_grad_(True), 1)
    cols = loss_hessian_sqrt(module, [lp, y], ("exact",), n)
    S = cols.materialize()[0]
    assert S.shape == (cols.num, *x.shape)
    # at lp the columns are √(a/Z)·√p_c e_c (diagonal square root of a·diag(p)/Z)
    for Sn in column_samples([S], n):
        assert ((Sn != 0).sum(1) <= 1).all()
    for Sn, H in zip(column_samples([_through_log_softmax(S, x)], n), ref):
        torch.testing.assert_close(Sn.T @ Sn, H, atol=1e-10, rtol=1e-10)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(nll_problem())
def test_nll_mc(problem):
    module, x, y = _nll_setup(*problem, scale=0.5)
    n, m = problem[0], 1500
    ref = reference_blocks(lambda z: module(F.log_softmax(z, 1), y), [x], n)
    lp = F.log_softmax(x.detach().requires_grad_(True), 1)
    S = loss_hessian_sqrt(module, [lp, y], ("mc", m), n).materialize()[0]
    for Sn, H in zip(column_samples([_through_log_softmax(S, x)], n), ref):
        assert_mc_close(Sn, H, m)


def test_nll_refuses_input_not_from_log_softmax():
    x = torch.randn(3, 4, dtype=DT, requires_grad=True)
    y = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="log_softmax"):
        loss_hessian_sqrt(nn.NLLLoss(), [x * 2, y], ("exact",), 3)
    with pytest.raises(ValueError, match="log_softmax"):
        loss_hessian_sqrt(nn.NLLLoss(), [F.log_softmax(x, 0), y], ("exact",), 3)
    with pytest.raises(ValueError, match="log_softmax"):
        loss_hessian_sqrt(nn.NLLLoss(), [torch.log(torch.softmax(x, 1)), y], ("exact",), 3)


# -- MSE ------------------------------------------------------------------------------------------


@st.composite
def elem_problem(draw):
    n = draw(st.integers(1, 3))
    p = draw(st.integers(1, 2))
    trailing = draw(st.lists(st.integers(1, 3), max_size=2))
    reduction = draw(st.sampled_from(["mean", "sum"]))
    seed = draw(st.integers(0, 2**16))
    return n, p, trailing, reduction, seed


@SETTINGS
@given(elem_problem(), st.booleans())
def test_mse_exact(problem, target_grad):
    n, p, trailing, reduction, seed = problem
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * p, *trailing, generator=g, dtype=DT)
    y = torch.randn(x.shape, generator=g, dtype=DT)
    diff = [0, 1] if target_grad else [0]
    check_exact(nn.MSELoss(reduction=reduction), [x, y], diff, n)


def test_mse_broadcast_target_requiring_grad():
    x = torch.randn(4, 3, dtype=DT)
    y = torch.randn(4, 1, dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_exact(nn.MSELoss(), [x, y], [0, 1], 2)
        check_exact(nn.MSELoss(reduction="sum"), [x, y], [0, 1], 4)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(elem_problem(), st.booleans())
def test_mse_mc(problem, target_grad):
    n, p, trailing, reduction, seed = problem
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * p, *trailing, generator=g, dtype=DT)
    y = torch.randn(x.shape, generator=g, dtype=DT)
    module = nn.MSELoss(reduction=reduction)
    diff = [0, 1] if target_grad else [0]
    if target_grad:
        ref = reference_blocks(module, [x, y], n)
    else:
        ref = reference_blocks(lambda z: module(z, y), [x], n)
    check_mc(module, [x, y], diff, n, ref)


# -- BCEWithLogits --------------------------------------------------------------------------------


def _bce_setup(problem, weighted, pos_weighted, scale=2.0):
    n, p, trailing, reduction, seed = problem
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * p, 2, *trailing, generator=g, dtype=DT) * scale
    y = torch.rand(x.shape, generator=g, dtype=DT)
    last = x.shape[-1]
    kw = {"reduction": reduction}
    if weighted:
        kw["weight"] = torch.rand(x.shape[1:], generator=g, dtype=DT) + 0.1
    if pos_weighted:
        kw["pos_weight"] = torch.rand(last, generator=g, dtype=DT) * 3
    return nn.BCEWithLogitsLoss(**kw), x, y, n


@SETTINGS
@given(elem_problem(), st.booleans(), st.booleans())
def test_bce_with_logits_exact(problem, weighted, pos_weighted):
    module, x, y, n = _bce_setup(problem, weighted, pos_weighted)
    check_exact(module, [x, y], [0], n)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(elem_problem(), st.booleans(), st.booleans())
def test_bce_with_logits_mc(problem, weighted, pos_weighted):
    module, x, y, n = _bce_setup(problem, weighted, pos_weighted, scale=0.5)
    ref = reference_blocks(lambda z: module(z, y), [x], n)
    check_mc(module, [x, y], [0], n, ref)


# -- GaussianNLL ----------------------------------------------------------------------------------


def _gauss_setup(problem, var_kind):
    n, p, trailing, reduction, seed = problem
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(n * p, 3, *trailing, generator=g, dtype=DT)
    y = torch.randn(mu.shape, generator=g, dtype=DT)
    if var_kind == "full":
        var = torch.rand(mu.shape, generator=g, dtype=DT) + 0.3
    elif var_kind == "short":  # input.shape[:-1]: unsqueezed by PyTorch
        var = torch.rand(mu.shape[:-1], generator=g, dtype=DT) + 0.3
    elif var_kind == "one":  # one broadcast dimension
        var = torch.rand(mu.shape[0], 1, *mu.shape[2:], generator=g, dtype=DT) + 0.3
    else:
        var = 0.7
    return mu, y, var, n, reduction


@SETTINGS
@given(elem_problem(), st.sampled_from(["full", "short", "one", "float"]), st.booleans(),
       st.booleans())
def test_gaussian_nll_exact(problem, var_kind, full, target_grad):
    mu, y, var, n, reduction = _gauss_setup(problem, var_kind)
    module = nn.GaussianNLLLoss(full=full, reduction=reduction)
    if target_grad:
        check_exact(module, [mu, y, var], [0, 1], n, lambda a, b: module(a, b, var))
    else:
        check_exact(module, [mu, y, var], [0], n, lambda a: module(a, y, var))


def test_gaussian_nll_eps_clamp():
    mu = torch.randn(3, 2, dtype=DT)
    y = torch.randn(3, 2, dtype=DT)
    var = torch.tensor([[1e-3, 0.5], [2.0, 1e-4], [0.3, 0.3]], dtype=DT)
    module = nn.GaussianNLLLoss(eps=1e-2)
    check_exact(module, [mu, y, var], [0], 3, lambda a: module(a, y, var))


def _gauss_def(mu: Tensor, var: Tensor, y: Tensor, reduction: str) -> Tensor:
    """½(log v + (μ − y)²/v) from the definition, var broadcast as PyTorch does."""
    if var.shape != mu.shape and mu.shape[:-1] == var.shape:
        var = var.unsqueeze(-1)
    loss = 0.5 * (var.log() + (mu - y) ** 2 / var)
    return loss.mean() if reduction == "mean" else loss.sum()


@settings(max_examples=8, deadline=None, derandomize=True)
@given(elem_problem(), st.sampled_from(["full", "short", "one"]))
def test_gaussian_nll_mc_with_var_is_fisher(problem, var_kind):
    """Reference: E_y[∇²ℓ] over y ~ N(μ, v). ∇²ℓ is affine in (y−μ) and (y−μ)² elementwise,
    so the expectation is exactly the mean of the Hessians at y = μ ± √v."""
    mu, _, var, n, reduction = _gauss_setup(problem, var_kind)
    vb = var.unsqueeze(-1) if var.shape == mu.shape[:-1] else var
    blocks = []
    for sign in (1.0, -1.0):
        y = mu + sign * vb.sqrt()
        blocks.append(
            reference_blocks(lambda a, v, y=y: _gauss_def(a, v, y, reduction), [mu, var], n)
        )
    ref = [(a + b) / 2 for a, b in zip(*blocks)]
    module = nn.GaussianNLLLoss(reduction=reduction)
    check_mc(module, [mu, torch.zeros_like(mu), var], [0, 2], n, ref)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(elem_problem(), st.sampled_from(["full", "float"]), st.booleans())
def test_gaussian_nll_mc_mean_only(problem, var_kind, target_grad):
    mu, y, var, n, reduction = _gauss_setup(problem, var_kind)
    module = nn.GaussianNLLLoss(reduction=reduction)
    if target_grad:
        ref = reference_blocks(lambda a, b: module(a, b, var), [mu, y], n)
    else:
        ref = reference_blocks(lambda a: module(a, y, var), [mu], n)
    check_mc(module, [mu, y, var], [0, 1] if target_grad else [0], n, ref)


def test_gaussian_nll_exact_refuses_var_grad():
    mu = torch.randn(2, 3, dtype=DT, requires_grad=True)
    var = torch.rand(2, 3, dtype=DT, requires_grad=True)
    with pytest.raises(ValueError, match="indefinite"):
        loss_hessian_sqrt(nn.GaussianNLLLoss(), [mu, torch.zeros(2, 3), var], ("exact",), 2)


# -- rows as positions, errors --------------------------------------------------------------------


def test_rows_must_be_sample_major_multiple():
    x = torch.randn(5, 3, dtype=DT, requires_grad=True)
    y = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of the model's batch size 2"):
        loss_hessian_sqrt(nn.CrossEntropyLoss(), [x, y], ("exact",), 2)
    with pytest.raises(ValueError, match="multiple"):
        loss_hessian_sqrt(nn.MSELoss(), [x, torch.zeros(5, 3)], ("exact",), 2)


@pytest.mark.parametrize(
    "module",
    [nn.L1Loss(), nn.BCELoss(), nn.KLDivLoss(), nn.HuberLoss(), nn.SmoothL1Loss()],
)
def test_unsupported_loss(module):
    x = torch.rand(2, 3, dtype=DT, requires_grad=True)
    with pytest.raises(NotImplementedError, match=type(module).__name__) as err:
        loss_hessian_sqrt(module, [x, torch.rand(2, 3)], ("exact",), 2)
    assert "CrossEntropyLoss" in str(err.value)


@pytest.mark.parametrize(
    "module", [nn.CrossEntropyLoss(reduction="none"), nn.MSELoss(reduction="none")]
)
def test_reduction_none(module):
    x = torch.randn(2, 3, dtype=DT, requires_grad=True)
    with pytest.raises(ValueError, match="reduction='none'"):
        loss_hessian_sqrt(module, [x, torch.zeros(2, dtype=torch.long)], ("exact",), 2)


def test_bad_key_and_targets():
    x = torch.randn(2, 3, dtype=DT, requires_grad=True)
    y = torch.zeros(2, dtype=torch.long)
    for key in [("mc", 0), ("mc",), "exact", ("mc", 2.0)]:
        with pytest.raises(ValueError, match="column key"):
            loss_hessian_sqrt(nn.CrossEntropyLoss(), [x, y], key, 2)
    with pytest.raises(ValueError, match="Detach the target"):
        loss_hessian_sqrt(
            nn.CrossEntropyLoss(), [x, torch.rand(2, 3, requires_grad=True)], ("exact",), 2
        )
    with pytest.raises(ValueError, match="Detach the target"):
        loss_hessian_sqrt(
            nn.BCEWithLogitsLoss(), [x, torch.rand(2, 3, requires_grad=True)], ("exact",), 2
        )
    with pytest.raises(ValueError, match="does not require grad"):
        loss_hessian_sqrt(nn.CrossEntropyLoss(), [x.detach(), y], ("exact",), 2)


# --------------------------------------------------------------------------- language-model layouts
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


class _TemperatureCE(nn.CrossEntropyLoss):
    """A cross-entropy subclass that computes another function (``CE(x / 2, y)``)."""

    def forward(self, input, target):
        return super().forward(input / 2.0, target)


class _PlainSubclassCE(nn.CrossEntropyLoss):
    """A subclass that keeps ``CrossEntropyLoss.forward``: the same loss."""


def test_loss_subclass_overriding_forward_is_refused_for_curvature() -> None:
    """Curvature of a loss subclass with its own ``forward`` is refused before anything is
    written; first-order results are right; a subclass without its own ``forward`` is the
    base loss (its GGN diagonal equals the dense one)."""
    from backprism import collect, extend
    from backprism.extensions import BatchGrad, DiagGGNExact
    from tests.reference import diag_ggn, per_sample_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    extend(model)
    lf = extend(_TemperatureCE())
    with pytest.raises(NotImplementedError, match="overrides forward"), collect(DiagGGNExact()):
        lf(model(X), y).backward()
    assert all(not hasattr(p, "diag_ggn_exact") for p in model.parameters())
    ref = per_sample_grads(model, _TemperatureCE(), X, y)
    model.zero_grad()
    with collect(BatchGrad()):
        lf(model(X), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, ref[name])
    plain = extend(_PlainSubclassCE())
    expected = diag_ggn(model, nn.CrossEntropyLoss(), X, y)
    with collect(DiagGGNExact()):
        plain(model(X), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, expected[name])


def test_unsupported_loss_named_before_reduction_advice() -> None:
    """Curvature through a loss without a Hessian form (``KLDivLoss(reduction="batchmean")``)
    names the loss, not the reduction (whose advice would lead to the next refusal)."""
    from backprism import collect, extend
    from backprism.extensions import DiagGGNExact

    model = extend(nn.Sequential(nn.Linear(3, 4), nn.LogSoftmax(-1)))
    lf = extend(nn.KLDivLoss(reduction="batchmean"))
    target = torch.softmax(torch.randn(2, 4), -1)
    with pytest.raises(NotImplementedError, match="KLDivLoss"), collect(DiagGGNExact()):
        lf(model(torch.randn(2, 3)), target).backward()
