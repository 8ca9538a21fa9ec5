"""End-to-end GGN extensions through ``extend``/``collect`` for every supported loss.

References: ``tests/reference.py::ggn_blocks`` (dense float64 per-sample GGN blocks from
``torch.func``). Exact quantities must match to 1e-9. Monte-Carlo quantities are checked in
expectation: with ``M`` columns ``V[m] = Jᵀ s_m/√M``, the ``M·V[m]V[m]ᵀ`` are i.i.d. unbiased
draws; the result must lie within 6 standard errors (estimated from the draws of
``SqrtGGNMC``) + 1e-10 of the reference.

The engine scales the columns by ``√(∂L_total/∂loss)``: the ``"sum"`` cases use
``0.5 * lossfunc(...)`` and compare with half the reference.

On every layer family (``layer → tanh → Linear`` heads from ``tests.common``: Linear, Conv,
ConvTranspose, Embedding, the norms, the generic rule), the MC extensions in expectation. On
every device (the ``device`` fixture), seven models (MLPs, a CNN, a residual block, a
transformer encoder, GPT-style decoders): exact quantities whole and chunked, MC quantities
within 15 % of the reference in norm (the device's RNG draws differently, and some GPT entries
are heavy-tailed), every stored tensor on the device and finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import (
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
)
from tests.common import (
    DEVICE_MC,
    DEVICE_MODELS,
    DEVICE_N,
    DEVICE_TOL,
    FAMILY_DT,
    FAMILY_N,
    Head,
    assert_mc_within,
    backward,
    build_on_device,
    check_mc,
    check_stored,
    fresh_backward,
    gather,
    generic_model,
    labels,
    norm_model,
)
from tests.reference import diag_blocks, ggn_blocks

DT = torch.float64
N, D_IN, HID = 3, 4, 5
M = 3000


class Residual(nn.Module):
    """``x + f(x)``."""

    def __init__(self, f: nn.Module) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: Tensor) -> Tensor:
        return x + self.f(x)


def chain(out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, HID), nn.Tanh(), nn.Linear(HID, out))


def resmlp(out: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(D_IN, HID),
        Residual(nn.Sequential(nn.Tanh(), nn.Linear(HID, HID))),
        nn.Tanh(),
        nn.Linear(HID, out),
    )


MODELS = {"chain": chain, "resmlp": resmlp}


class Case:
    """A model, its loss and the reference loss on the model output.

    ``run(model, lossfunc, X, y) -> loss`` computes the objective backprism sees (it may apply
    post-processing such as ``log_softmax`` or slicing); ``ref_model`` and ``ref_loss`` give
    the same GGN for :func:`ggn_blocks`.
    """

    def __init__(self, name: str, reduction: str, model_kind: str, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.name, self.reduction = name, reduction
        self.factor = 1.0 if reduction == "mean" else 0.5
        self.X = torch.randn(N, D_IN, dtype=DT)
        self.post: Callable[[Tensor], Tensor] = lambda o: o
        self.extra: tuple = ()
        f = self.factor
        if name == "ce":
            c = 3
            w = torch.tensor([0.5, 1.0, 2.0], dtype=DT)
            self.lossfunc = nn.CrossEntropyLoss(reduction=reduction, weight=w, label_smoothing=0.1)
            self.y = torch.tensor([0, 2, 1])
        elif name == "ce_rows":  # [N, T, C] flattened to [N·T, C], sample-major
            c = 3
            self.X = torch.randn(N, 2, D_IN, dtype=DT)
            self.lossfunc = nn.CrossEntropyLoss(reduction=reduction)
            self.y = torch.randint(0, c, (N, 2))
            self.post = lambda o: o.flatten(0, 1)
        elif name == "ce_spatial":  # [N, C, D] logits (Linear over [N, D, in], transposed)
            c = 3
            self.X = torch.randn(N, 2, D_IN, dtype=DT)
            self.lossfunc = nn.CrossEntropyLoss(reduction=reduction, ignore_index=1)
            self.y = torch.tensor([[0, 1], [2, 2], [1, 0]])
            self.post = lambda o: o.transpose(-1, -2)
        elif name == "nll":
            c = 3
            self.lossfunc = nn.NLLLoss(reduction=reduction)
            self.y = torch.tensor([1, 0, 2])
        elif name == "mse":
            c = 2
            self.lossfunc = nn.MSELoss(reduction=reduction)
            self.y = torch.randn(N, c, dtype=DT)
        elif name == "bce":
            c = 3
            self.lossfunc = nn.BCEWithLogitsLoss(
                reduction=reduction, pos_weight=torch.tensor([0.5, 2.0, 1.0], dtype=DT)
            )
            self.y = torch.rand(N, c, dtype=DT)
        elif name == "bce_plain":
            c = 2
            self.lossfunc = nn.BCEWithLogitsLoss(reduction=reduction)
            self.y = torch.randint(0, 2, (N, c)).to(DT)
        elif name == "gauss":
            c = 2
            self.lossfunc = nn.GaussianNLLLoss(reduction=reduction)
            self.y = torch.randn(N, c, dtype=DT)
            self.extra = (torch.rand(N, c, dtype=DT) + 0.5,)
        else:  # pragma: no cover
            raise ValueError(name)
        self.logits_model = MODELS[model_kind](c).to(DT)
        self.model = (
            nn.Sequential(self.logits_model, nn.LogSoftmax(dim=1))
            if name == "nll"
            else self.logits_model
        )
        lossfunc, post, extra = self.lossfunc, self.post, self.extra
        self.prep_y = (lambda t: t.flatten()) if name == "ce_rows" else (lambda t: t)
        prep_y = self.prep_y
        if name == "nll":
            self.ref_loss = lambda o, y: f * lossfunc(F.log_softmax(post(o), 1), y)
        else:
            self.ref_loss = lambda o, y: f * lossfunc(post(o), prep_y(y), *extra)

    def backward(self, *exts) -> None:
        model, lossfunc = extend(self.model), extend(self.lossfunc)
        out = self.post(model(self.X))
        loss = self.factor * lossfunc(out, self.prep_y(self.y), *self.extra)
        with collect(*exts):
            loss.backward()

    def reference(self) -> Tensor:
        G, _, _ = ggn_blocks(self.logits_model, self.ref_loss, self.X, self.y)
        return G

    def gather(self, field: str, lead: int) -> Tensor:
        """``[*lead dims, P]`` from a parameter attribute, parameters in model order."""
        parts = []
        for p in self.model.parameters():
            v = getattr(p, field)
            parts.append(v.reshape(*v.shape[:lead], -1))
            delattr(p, field)
        return torch.cat(parts, -1)


LOSSES = ["ce", "ce_rows", "ce_spatial", "nll", "mse", "bce", "bce_plain", "gauss"]
CASES = [
    (loss, red, kind) for loss in LOSSES for red in ("mean", "sum") for kind in ("chain", "resmlp")
]


@pytest.mark.parametrize(("loss", "reduction", "kind"), CASES)
def test_exact(loss, reduction, kind):
    case = Case(loss, reduction, kind)
    G = case.reference()  # [N, N, P, P]
    case.backward(DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact())
    diag = case.gather("diag_ggn_exact", 0)
    batch = case.gather("diag_ggn_exact_batch", 1)
    V = case.gather("sqrt_ggn_exact", 2)  # [K, N, P]
    full = G.sum((0, 1))
    torch.testing.assert_close(diag, torch.diagonal(full), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(batch, diag_blocks(G), atol=1e-9, rtol=1e-9)
    assert V.shape[1] == N
    for n in range(N):
        torch.testing.assert_close(V[:, n].T @ V[:, n], G[n, n], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(
        torch.einsum("knp,knq->pq", V, V), full, atol=1e-9, rtol=1e-9
    )


@pytest.mark.parametrize("loss", LOSSES)
def test_exact_sqrt_subsampling(loss):
    case = Case(loss, "mean", "resmlp", seed=1)
    G = case.reference()
    sub = [2, 0]
    case.backward(SqrtGGNExact(subsampling=sub))
    V = case.gather("sqrt_ggn_exact", 2)
    assert V.shape[1] == len(sub)
    for i, n in enumerate(sub):
        torch.testing.assert_close(V[:, i].T @ V[:, i], G[n, n], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize(("loss", "reduction", "kind"), [*CASES[::2], ("gauss", "sum", "resmlp")])
def test_mc_in_expectation(loss, reduction, kind):
    case = Case(loss, reduction, kind, seed=2)
    G = case.reference()
    torch.manual_seed(0)
    case.backward(DiagGGNMC(M), BatchDiagGGNMC(M), SqrtGGNMC(M))
    diag = case.gather("diag_ggn_mc", 0)
    batch = case.gather("diag_ggn_mc_batch", 1)
    V = case.gather("sqrt_ggn_mc", 2)  # [M, N, P]
    assert V.shape[:2] == (M, N)
    per = V.square() * M  # i.i.d. draws of the per-sample diagonals, [M, N, P]
    assert_mc_within(diag, per.sum(1), torch.diagonal(G.sum((0, 1))))
    assert_mc_within(batch, per, diag_blocks(G))
    n = 1
    outer = torch.einsum("mp,mq->mpq", V[:, n], V[:, n]) * M
    assert_mc_within(V[:, n].T @ V[:, n], outer, G[n, n])


def test_mc_sqrt_subsampling_and_seed():
    case = Case("ce", "mean", "chain", seed=3)
    G = case.reference()
    torch.manual_seed(5)
    case.backward(SqrtGGNMC(M, subsampling=[2]))
    V = case.gather("sqrt_ggn_mc", 2)
    assert V.shape[:2] == (M, 1)
    outer = torch.einsum("mp,mq->mpq", V[:, 0], V[:, 0]) * M
    assert_mc_within(V[:, 0].T @ V[:, 0], outer, G[2, 2])
    torch.manual_seed(5)
    case.backward(SqrtGGNMC(M, subsampling=[2]))
    torch.testing.assert_close(case.gather("sqrt_ggn_mc", 2), V, atol=0, rtol=0)


# --------------------------------------------- repeated sub-sampling indices (BackPACK's meaning)
#: ``index_select`` semantics: a row per occurrence, in the given order
REPEATED = [2, 0, 2, 1, 2]


def _occurrence_sum(G: Tensor, sub: list[int]) -> Tensor:
    """``Σ_{i} GGN_{sᵢ}`` over the occurrences (a repeated sample counted once per occurrence)."""
    return torch.stack([G[n, n] for n in sub]).sum(0)


@pytest.mark.parametrize("loss", LOSSES)
def test_exact_sqrt_repeated_subsampling(loss):
    """``SqrtGGNExact(subsampling=𝒮)`` with repeated indices is ``V[:, 𝒮]``: column block ``i``
    squares to the reference block ``GGN_{sᵢ}`` and ``V_𝒮 V_𝒮ᵀ = Σᵢ GGN_{sᵢ}``."""
    case = Case(loss, "mean", "resmlp", seed=4)
    G = case.reference()
    case.backward(SqrtGGNExact(subsampling=REPEATED))
    V = case.gather("sqrt_ggn_exact", 2)  # [K, N', P]
    assert V.shape[1] == len(REPEATED)
    for i, n in enumerate(REPEATED):
        torch.testing.assert_close(V[:, i].T @ V[:, i], G[n, n], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(
        torch.einsum("knp,knq->pq", V, V), _occurrence_sum(G, REPEATED), atol=1e-9, rtol=1e-9
    )
    torch.testing.assert_close(V[:, 0], V[:, 2], atol=0, rtol=0)
    torch.testing.assert_close(V[:, 0], V[:, 4], atol=0, rtol=0)
    case.backward(SqrtGGNExact())  # the block of the full factor, nothing rescaled
    full = case.gather("sqrt_ggn_exact", 2)
    torch.testing.assert_close(V, full[:, REPEATED], atol=1e-12, rtol=1e-12)


def test_exact_sqrt_repeated_subsampling_chunked_and_with_other_extensions():
    """Repeated indices with column chunks and next to the unsampled GGN extensions."""
    case = Case("ce_rows", "sum", "chain", seed=6)
    G = case.reference()
    model, lossfunc = extend(case.model), extend(case.lossfunc)
    out = case.post(model(case.X))
    loss = case.factor * lossfunc(out, case.prep_y(case.y))
    with collect(SqrtGGNExact(subsampling=REPEATED), DiagGGNExact(), chunk_size=2):
        loss.backward()
    V = case.gather("sqrt_ggn_exact", 2)
    for i, n in enumerate(REPEATED):
        torch.testing.assert_close(V[:, i].T @ V[:, i], G[n, n], atol=1e-9, rtol=1e-9)
    diag = case.gather("diag_ggn_exact", 0)
    torch.testing.assert_close(diag, torch.diagonal(G.sum((0, 1))), atol=1e-9, rtol=1e-9)


def test_mc_sqrt_repeated_subsampling():
    """``SqrtGGNMC(subsampling=𝒮)``: the labels are drawn once per mini-batch sample, so the
    result is the full factor's ``V[:, 𝒮]`` under the same seed (a repeated index repeats the
    same draw), and ``V_𝒮 V_𝒮ᵀ`` estimates ``Σᵢ GGN_{sᵢ}`` without bias."""
    case = Case("ce", "mean", "chain", seed=3)
    G = case.reference()
    torch.manual_seed(7)
    case.backward(SqrtGGNMC(M))
    full = case.gather("sqrt_ggn_mc", 2)
    torch.manual_seed(7)
    case.backward(SqrtGGNMC(M, subsampling=REPEATED))
    V = case.gather("sqrt_ggn_mc", 2)  # [M, N', P]
    assert V.shape[:2] == (M, len(REPEATED))
    torch.testing.assert_close(V, full[:, REPEATED], atol=0, rtol=0)
    draws = torch.einsum("mip,miq->mpq", V, V) * M  # i.i.d. over m
    ref = _occurrence_sum(G, REPEATED)
    assert_mc_within(torch.einsum("mip,miq->pq", V, V), draws, ref)


class _MeanVar(nn.Module):
    """Outputs ``[μ, softplus(·)]``: a mean and a positive variance head."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = resmlp(2 * c)
        self.c = c

    def forward(self, x: Tensor) -> Tensor:
        o = self.body(x)
        return torch.cat([o[..., : self.c], F.softplus(o[..., self.c :]) + 0.2], -1)


def _gauss_def(o: Tensor, y: Tensor, c: int, reduction: str) -> Tensor:
    mu, var = o[..., :c], o[..., c:]
    loss = 0.5 * (var.log() + (mu - y) ** 2 / var)
    return loss.mean() if reduction == "mean" else loss.sum()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gaussian_nll_learned_variance_mc_is_fisher_ggn(reduction):
    """GGN w.r.t. (μ, var) with the Fisher ``E_y[∇²ℓ]`` (y ~ N(μ, var)) as loss curvature.

    ``∇²ℓ`` is affine in ``(y−μ)`` and ``(y−μ)²`` elementwise, so the expectation is exactly
    the mean of the Hessians at ``y = μ ± √var`` (taken at the current outputs)."""
    torch.manual_seed(4)
    c = 2
    model = _MeanVar(c).to(DT)
    X, y = torch.randn(N, D_IN, dtype=DT), torch.randn(N, c, dtype=DT)
    with torch.no_grad():
        o0 = model(X)
    mu0, sd0 = o0[:, :c], o0[:, c:].sqrt()

    def fisher_loss(o: Tensor, _: Tensor) -> Tensor:
        return 0.5 * (
            _gauss_def(o, mu0 + sd0, c, reduction) + _gauss_def(o, mu0 - sd0, c, reduction)
        )

    G, _, _ = ggn_blocks(model, fisher_loss, X, y)
    lossfunc = extend(nn.GaussianNLLLoss(reduction=reduction))
    extend(model)
    out = model(X)
    loss = lossfunc(out[:, :c], y, out[:, c:])
    torch.manual_seed(0)
    with collect(DiagGGNMC(M), SqrtGGNMC(M)):
        loss.backward()
    diag = torch.cat([p.diag_ggn_mc.reshape(-1) for p in model.parameters()])
    V = torch.cat([p.sqrt_ggn_mc.reshape(M, N, -1) for p in model.parameters()], -1)
    assert_mc_within(diag, (V.square() * M).sum(1), torch.diagonal(G.sum((0, 1))))
    outer = torch.einsum("mp,mq->mpq", V[:, 0], V[:, 0]) * M
    assert_mc_within(V[:, 0].T @ V[:, 0], outer, G[0, 0])


def test_gaussian_nll_learned_variance_exact_is_refused():
    model = extend(_MeanVar(2).to(DT))
    lossfunc = extend(nn.GaussianNLLLoss())
    out = model(torch.randn(N, D_IN, dtype=DT))
    loss = lossfunc(out[:, :2], torch.zeros(N, 2, dtype=DT), out[:, 2:])
    with pytest.raises(ValueError, match="indefinite"), collect(DiagGGNExact()):
        loss.backward()


def test_unsupported_loss_error_names_it():
    model = extend(chain(2).to(DT))
    lossfunc = extend(nn.L1Loss())
    loss = lossfunc(model(torch.randn(N, D_IN, dtype=DT)), torch.zeros(N, 2, dtype=DT))
    with pytest.raises(NotImplementedError, match="L1Loss"), collect(DiagGGNExact()):
        loss.backward()


def test_nll_without_log_softmax_is_refused():
    model = extend(chain(3).to(DT))
    lossfunc = extend(nn.NLLLoss())
    loss = lossfunc(model(torch.randn(N, D_IN, dtype=DT)), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="log_softmax"), collect(DiagGGNExact()):
        loss.backward()


def test_chunked_columns():
    """Columns generated lazily in chunks: exact results unchanged; MC columns do not depend
    on the chunking (one generator per column, seeded from the global RNG)."""
    case = Case("ce_spatial", "mean", "resmlp", seed=6)
    G = case.reference()
    model, lossfunc = extend(case.model), extend(case.lossfunc)

    def run(*exts, chunk_size=None):
        loss = lossfunc(case.post(model(case.X)), case.y)
        with collect(*exts, chunk_size=chunk_size):
            loss.backward()

    run(DiagGGNExact(), chunk_size=4)
    diag = case.gather("diag_ggn_exact", 0)
    torch.testing.assert_close(diag, torch.diagonal(G.sum((0, 1))), atol=1e-9, rtol=1e-9)
    torch.manual_seed(1)
    run(SqrtGGNMC(11), chunk_size=3)
    chunked = case.gather("sqrt_ggn_mc", 2)
    torch.manual_seed(1)
    run(SqrtGGNMC(11))
    torch.testing.assert_close(case.gather("sqrt_ggn_mc", 2), chunked, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------- MC on every layer family
def _mc_models() -> dict[str, Any]:
    def conv():
        torch.manual_seed(5)
        X = torch.randn(FAMILY_N, 2, 4, 4, dtype=FAMILY_DT)
        layer = nn.Conv2d(2, 2, 2, stride=2, groups=2, padding=1, padding_mode="reflect")
        return Head(layer, X).to(FAMILY_DT), X

    def convt():
        torch.manual_seed(6)
        X = torch.randn(FAMILY_N, 2, 3, dtype=FAMILY_DT)
        return Head(nn.ConvTranspose1d(2, 2, 2, stride=2, dilation=2), X).to(FAMILY_DT), X

    def linear():
        torch.manual_seed(7)
        X = torch.randn(FAMILY_N, 2, 3, dtype=FAMILY_DT)
        return Head(nn.Linear(3, 2), X).to(FAMILY_DT), X

    def embedding():
        torch.manual_seed(8)
        X = torch.tensor([[1, 1, 3], [1, 0, 2]])
        return Head(nn.Embedding(4, 2), X).to(FAMILY_DT), X

    return {
        "linear": linear,
        "conv": conv,
        "convt": convt,
        "embedding": embedding,
        "layernorm": lambda: norm_model("layernorm", 9),
        "groupnorm": lambda: norm_model("groupnorm", 9),
        "rmsnorm": lambda: norm_model("rmsnorm", 9),
        "batchnorm2d": lambda: norm_model("batchnorm2d", 9),
        "mha": lambda: generic_model("mha", 10),
        "bilinear": lambda: generic_model("bilinear", 10),
        "custom": lambda: generic_model("custom", 10),
    }


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("kind", list(_mc_models()))
def test_mc_in_expectation_every_family(kind):
    model, X = _mc_models()[kind]()
    y = labels(FAMILY_N, seed=11)
    lossfunc = nn.CrossEntropyLoss()
    G = ggn_blocks(model, lossfunc, X, y)[0]
    check_mc(model, lossfunc, X, y, G)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("kind", list(_mc_models()))
def test_exact_sqrt_repeated_subsampling_every_family(kind):
    """Every layer family's rule on the distinct samples, rows repeated: block ``i`` of
    ``SqrtGGNExact(subsampling=[1, 0, 1, 1])`` squares to ``GGN_{sᵢ}``."""
    model, X = _mc_models()[kind]()
    y = labels(FAMILY_N, seed=11)
    lossfunc = nn.CrossEntropyLoss()
    G = ggn_blocks(model, lossfunc, X, y)[0]
    sub = [1, 0, 1, 1]
    extend(model), extend(lossfunc)
    backward(model, lossfunc, X, y, SqrtGGNExact(subsampling=sub))
    V = gather(model, "sqrt_ggn_exact", 2)
    assert V.shape[1] == len(sub)
    for i, n in enumerate(sub):
        torch.testing.assert_close(V[:, i].T @ V[:, i], G[n, n], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(
        torch.einsum("knp,knq->pq", V, V), _occurrence_sum(G, sub), atol=1e-9, rtol=1e-9
    )


# -------------------------------------------------------------------------------------- on a device
@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("chunking", [{}, {"chunk_size": 2}], ids=["whole", "chunked"])
@pytest.mark.parametrize("name", DEVICE_MODELS)
def test_ggn_exact_on_device(name, chunking, device):
    model, lossfunc, X, y, ref_loss = build_on_device(name, device, seed=1)
    G = ggn_blocks(model, ref_loss, X, y)[0]
    extend(model), extend(lossfunc)
    exts = (DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact())
    fresh_backward(model, lossfunc, X, y, *exts, **chunking)
    check_stored(model, device, *(e.savefield for e in exts))
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact", 0), torch.diagonal(G.sum((0, 1))), **DEVICE_TOL
    )
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact_batch", 1), diag_blocks(G), **DEVICE_TOL
    )
    V = gather(model, "sqrt_ggn_exact", 2)
    for n in range(DEVICE_N):
        torch.testing.assert_close(V[:, n].T @ V[:, n], G[n, n], **DEVICE_TOL)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("name", DEVICE_MODELS)
def test_ggn_mc_in_expectation_on_device(name, device):
    model, lossfunc, X, y, ref_loss = build_on_device(name, device, seed=2)
    G = ggn_blocks(model, ref_loss, X, y)[0]
    extend(model), extend(lossfunc)
    torch.manual_seed(0)
    exts = (DiagGGNMC(DEVICE_MC), BatchDiagGGNMC(DEVICE_MC), SqrtGGNMC(DEVICE_MC))
    fresh_backward(model, lossfunc, X, y, *exts)
    check_stored(model, device, *(e.savefield for e in exts))
    V = gather(model, "sqrt_ggn_mc", 2)
    assert V.shape[:2] == (DEVICE_MC, DEVICE_N)
    per = V.square() * DEVICE_MC
    assert_unbiased(gather(model, "diag_ggn_mc", 0), per.sum(1), torch.diagonal(G.sum((0, 1))))
    assert_unbiased(gather(model, "diag_ggn_mc_batch", 1), per, diag_blocks(G))


def assert_unbiased(value: Tensor, draws: Tensor, ref: Tensor, rtol: float = 0.15) -> None:
    """``value`` is the mean of the i.i.d. draws and within ``rtol`` of ``ref`` in norm.

    A norm criterion rather than per-entry standard errors: the device's RNG gives other draws
    than the CPU's, and some GPT entries are heavy-tailed (rare draws 60× the mean), where the
    sample standard error underestimates the spread at a few thousand draws."""
    torch.testing.assert_close(value, draws.mean(0), atol=1e-10, rtol=1e-8)
    rel = float((value - ref).norm() / ref.norm())
    assert rel < rtol, f"MC mean off by {rel:.3f} (relative, norm) from the exact value"
