r"""Monte-Carlo draws through ``backprism.compat.backpack`` are BackPACK 1.7's draws.

BackPACK samples the targets of its MC extensions from the likelihood whose negative log is the
loss — cross-entropy: ``ŷ ~ Categorical(softmax(f))``; ``MSELoss``: ``y ~ N(f, ½ I)``;
``BCEWithLogitsLoss``: ``ŷ ~ Binomial(1, σ(f))`` — all ``M`` at once on torch's global RNG,
one call per extension at the loss, in the order the extensions were given. The columns are
the gradients at the sampled targets over ``√M`` (and ``√Z`` for a mean loss), e.g.
``S[m, n] = (p_n − e_{ŷ_mn}) / √(M N)`` for a mean cross-entropy. The shim makes the same
calls, so after ``torch.manual_seed(s)`` a script gets BackPACK's numbers:

(a) against the original BackPACK package where it is installed (skipped otherwise);
(b) against the draw written out by hand from that definition (no BackPACK needed);
(c) backprism's own ``collect`` keeps its per-column generators, whatever the shim did before.
"""

from __future__ import annotations

import importlib
import math
import sys
from types import ModuleType

import pytest
import torch
from torch import nn

from backprism import collect
from backprism import extend as native_extend
from backprism.compat.backpack import backpack, extend
from backprism.compat.backpack import extensions as shim_ext
from backprism.compat.backpack.core import CrossEntropyLossDerivatives
from backprism.engine.loss_hessian import loss_hessian_sqrt
from backprism.extensions import DiagGGNMC as NativeDiagGGNMC

N, D_IN, HID, C = 6, 4, 5, 3
SEED = 11


def _problem(loss: str, seed: int = 0):
    """A float64 MLP ``D_IN → HID → C`` with a ``loss`` of its outputs (fresh every call)."""
    torch.manual_seed(seed)
    d_out = 1 if loss == "bce" else C
    model = nn.Sequential(nn.Linear(D_IN, HID), nn.Tanh(), nn.Linear(HID, d_out)).double()
    X = torch.randn(N, D_IN, dtype=torch.double)
    if loss == "ce":
        return model, nn.CrossEntropyLoss(), X, torch.randint(0, C, (N,))
    if loss == "ce_sum":
        return model, nn.CrossEntropyLoss(reduction="sum"), X, torch.randint(0, C, (N,))
    if loss == "mse":
        return model, nn.MSELoss(), X, torch.randn(N, C, dtype=torch.double)
    return model, nn.BCEWithLogitsLoss(), X, torch.randint(0, 2, (N, 1)).double()


def _run(lib: ModuleType, ext_mod: ModuleType, loss: str, specs, **kw) -> tuple[dict, float]:
    """Results of the extensions ``specs`` (``[(name, kwargs)]``) in one ``backpack`` context,
    seeded with ``SEED`` right before the backward pass, and the next draw of the global RNG."""
    model, lossfunc, X, y = _problem(loss)
    model, lossfunc = lib.extend(model), lib.extend(lossfunc)
    exts = [getattr(ext_mod, name)(**args) for name, args in specs]
    out = lossfunc(model(X), y)
    torch.manual_seed(SEED)
    with lib.backpack(*exts, **kw):
        out.backward()
    res = {}
    for pname, p in model.named_parameters():
        for e in exts:
            v = getattr(p, e.savefield)
            res[pname, e.savefield] = [t.clone() for t in v] if isinstance(v, list) else v.clone()
    return res, torch.rand(()).item()


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        va = a[k] if isinstance(a[k], list) else [a[k]]
        vb = b[k] if isinstance(b[k], list) else [b[k]]
        assert len(va) == len(vb), k
        for x, y in zip(va, vb):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-14, msg=str(k))


# -- (a) against the original BackPACK -----------------------------------------------------------
def _original_backpack() -> tuple[ModuleType, ModuleType]:
    """The original ``backpack`` package and its ``extensions`` — skip when it is absent or when
    ``backpack`` resolves to the shim (e.g. under an alias installed by a conftest)."""
    mod = sys.modules.get("backpack")
    if mod is None:
        try:
            mod = importlib.import_module("backpack")
        except ImportError:
            pytest.skip("the original BackPACK package is not installed")
    if mod.__name__ != "backpack" or "backprism" in str(getattr(mod, "__file__", "") or ""):
        pytest.skip("`backpack` resolves to the backprism shim, not the original package")
    exts = importlib.import_module("backpack.extensions")
    if exts.__name__ != "backpack.extensions" or exts is shim_ext:
        pytest.skip("`backpack.extensions` resolves to the backprism shim")
    return mod, exts


SPECS = {
    "DiagGGNMC": [("DiagGGNMC", {"mc_samples": 3})],
    "DiagGGNMC-1": [("DiagGGNMC", {"mc_samples": 1})],
    "KFAC": [("KFAC", {"mc_samples": 2})],
    "SqrtGGNMC": [("SqrtGGNMC", {"mc_samples": 4})],
    "BatchDiagGGNMC": [("BatchDiagGGNMC", {"mc_samples": 2})],
    # several MC extensions at once: one draw each, in the order given
    "all": [
        ("DiagGGNMC", {"mc_samples": 3}),
        ("KFAC", {"mc_samples": 2}),
        ("DiagGGNExact", {}),
        ("SqrtGGNMC", {"mc_samples": 1}),
        ("BatchDiagGGNMC", {"mc_samples": 2}),
    ],
}


@pytest.mark.parametrize("loss", ["ce", "ce_sum", "mse", "bce"])
@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
def test_mc_extensions_match_original_backpack(loss, spec):
    bp, bp_ext = _original_backpack()
    import backprism.compat.backpack as shim

    ours, next_ours = _run(shim, shim_ext, loss, SPECS[spec])
    theirs, next_theirs = _run(bp, bp_ext, loss, SPECS[spec])
    _assert_same(ours, theirs)
    assert next_ours == next_theirs  # the global RNG advanced by the same calls


def test_chunked_columns_match_original_backpack():
    """All ``M`` columns are drawn at once: chunking the pushes does not change the draw."""
    bp, bp_ext = _original_backpack()
    import backprism.compat.backpack as shim

    spec = [("DiagGGNMC", {"mc_samples": 5}), ("SqrtGGNMC", {"mc_samples": 3})]
    ours, _ = _run(shim, shim_ext, "ce", spec, chunk_size=2)
    theirs, _ = _run(bp, bp_ext, "ce", spec)
    _assert_same(ours, theirs)


def test_sqrt_hessian_sampled_matches_original_backpack():
    """The derivatives API: ``CrossEntropyLossDerivatives().sqrt_hessian_sampled``."""
    _original_backpack()
    from backpack.core.derivatives.crossentropyloss import (
        CrossEntropyLossDerivatives as Original,
    )

    torch.manual_seed(0)
    module = nn.CrossEntropyLoss()
    module.input0 = torch.randn(N, C, dtype=torch.double)
    module.input1 = torch.randint(0, C, (N,))
    module.output = module(module.input0, module.input1)
    results = []
    for derivs in (CrossEntropyLossDerivatives(), Original()):
        torch.manual_seed(SEED)
        results.append(derivs.sqrt_hessian_sampled(module, None, None, mc_samples=7))
    torch.testing.assert_close(results[0], results[1], rtol=1e-10, atol=1e-14)


# -- (b) against the draw written out by hand ------------------------------------------------------
def _last_layer_input(model: nn.Sequential, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ``h`` ``[N, HID]`` and output ``f`` of the last Linear layer."""
    with torch.no_grad():
        h = model[1](model[0](X))
        return h, model[2](h)


def _ce_columns(f: torch.Tensor, m: int, reduction: str = "mean") -> torch.Tensor:
    """BackPACK's cross-entropy draw from its definition, ``[M, N, C]``: labels
    ``torch.multinomial(p / Σp, M, replacement=True)ᵀ`` with ``p = softmax(f)``, columns
    ``(p − e_ŷ)/√M`` (``/√N`` for a mean loss)."""
    p = torch.softmax(f, dim=1)
    labels = torch.multinomial(p / p.sum(-1, keepdim=True), m, replacement=True).t()  # [M, N]
    onehot = nn.functional.one_hot(labels, p.shape[1]).to(p.dtype)
    cols = (p.unsqueeze(0) - onehot) / math.sqrt(m)
    return cols / math.sqrt(f.shape[0]) if reduction == "mean" else cols


def _mse_columns(f: torch.Tensor, m: int) -> torch.Tensor:
    """BackPACK's ``MSELoss`` draw from its definition, ``[M, N, D]``: targets
    ``y ~ N(f, σ²)`` with ``σ = torch.tensor(√½)`` (torch's default dtype), columns
    ``2(y − f)/√(M·N·D)`` (mean reduction)."""
    sd = torch.tensor(math.sqrt(0.5))
    y = torch.normal(f.expand(m, *f.shape), sd.expand(m, *f.shape))
    return 2 * (y - f) / math.sqrt(m) / math.sqrt(f.numel())


def _diag_last_layer(cols: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGN-diagonal MC estimate of the last layer from its output columns ``[M, N, C]``:
    ``Σₘₙ (S[m,n,i] h[n,j])²`` (weight) and ``Σₘₙ S[m,n,i]²`` (bias)."""
    return torch.einsum("mni,nj->ij", cols**2, h**2), (cols**2).sum((0, 1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("m", [1, 4])
def test_diag_ggn_mc_last_layer_cross_entropy_by_hand(m, reduction):
    model, _, X, y = _problem("ce")
    lossfunc = extend(nn.CrossEntropyLoss(reduction=reduction))
    extend(model)
    h, f = _last_layer_input(model, X)
    torch.manual_seed(SEED)
    weight, bias = _diag_last_layer(_ce_columns(f, m, reduction), h)
    loss = lossfunc(model(X), y)
    torch.manual_seed(SEED)
    with backpack(shim_ext.DiagGGNMC(mc_samples=m)):
        loss.backward()
    torch.testing.assert_close(model[2].weight.diag_ggn_mc, weight, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(model[2].bias.diag_ggn_mc, bias, rtol=1e-10, atol=1e-14)


def test_diag_ggn_mc_last_layer_mse_by_hand():
    model, lossfunc, X, y = _problem("mse")
    extend(model), extend(lossfunc)
    h, f = _last_layer_input(model, X)
    torch.manual_seed(SEED)
    weight, bias = _diag_last_layer(_mse_columns(f, 3), h)
    loss = lossfunc(model(X), y)
    torch.manual_seed(SEED)
    with backpack(shim_ext.DiagGGNMC(mc_samples=3)):
        loss.backward()
    torch.testing.assert_close(model[2].weight.diag_ggn_mc, weight, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(model[2].bias.diag_ggn_mc, bias, rtol=1e-10, atol=1e-14)


def test_two_mc_extensions_draw_in_turn_by_hand():
    """``DiagGGNMC(2)`` then ``SqrtGGNMC(3)``: two draws, in that order; the last bias's
    ``sqrt_ggn_mc`` is the second draw's columns themselves."""
    model, lossfunc, X, y = _problem("ce")
    extend(model), extend(lossfunc)
    h, f = _last_layer_input(model, X)
    torch.manual_seed(SEED)
    first = _ce_columns(f, 2)
    second = _ce_columns(f, 3)
    loss = lossfunc(model(X), y)
    torch.manual_seed(SEED)
    with backpack(shim_ext.DiagGGNMC(mc_samples=2), shim_ext.SqrtGGNMC(mc_samples=3)):
        loss.backward()
    weight, bias = _diag_last_layer(first, h)
    torch.testing.assert_close(model[2].weight.diag_ggn_mc, weight, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(model[2].bias.diag_ggn_mc, bias, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(model[2].bias.sqrt_ggn_mc, second, rtol=1e-10, atol=1e-14)


# -- (c) backprism's own API keeps its stream ------------------------------------------------------
def _native_diag_ggn_mc(m: int = 3) -> tuple[dict[str, torch.Tensor], float]:
    model, lossfunc, X, y = _problem("ce")
    native_extend(model), native_extend(lossfunc)
    loss = lossfunc(model(X), y)
    torch.manual_seed(SEED)
    with collect(NativeDiagGGNMC(mc_samples=m)):
        loss.backward()
    return {n: p.diag_ggn_mc.clone() for n, p in model.named_parameters()}, torch.rand(()).item()


def test_native_collect_unchanged_after_shim_use():
    before, next_before = _native_diag_ggn_mc()
    shim_res, _ = _run(
        importlib.import_module("backprism.compat.backpack"), shim_ext, "ce",
        [("DiagGGNMC", {"mc_samples": 3}), ("KFAC", {"mc_samples": 2})],
    )
    after, next_after = _native_diag_ggn_mc()
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0)
    assert next_after == next_before
    # the native pass takes one draw from the global RNG (the seed of its per-column
    # generators), not BackPACK's multinomial call, and its numbers differ from the shim's
    torch.manual_seed(SEED)
    torch.randint(0, 2**62, (1,))
    assert next_before == torch.rand(()).item()
    assert any(
        not torch.allclose(before[name], shim_res[name, "diag_ggn_mc"]) for name in before
    )


def test_native_columns_unchanged_after_shim_use():
    """``loss_hessian_sqrt(..., ("mc", M))`` gives the same columns before and after."""
    torch.manual_seed(1)
    f = torch.randn(N, C, dtype=torch.double, requires_grad=True)
    target = torch.randint(0, C, (N,))

    def cols() -> torch.Tensor:
        torch.manual_seed(SEED)
        return loss_hessian_sqrt(nn.CrossEntropyLoss(), [f, target], ("mc", 4), N).materialize()[0]

    before = cols()
    _run(importlib.import_module("backprism.compat.backpack"), shim_ext, "ce",
         [("SqrtGGNMC", {"mc_samples": 4})])
    torch.testing.assert_close(cols(), before, rtol=0, atol=0)
