"""Parameters used by several calls (tied weights) without dense per-sample gradients
(``backprism.engine.tied``).

* The cross terms ``Σₘ ⟨Vᵃₘₙ, Vᵇₘₙ⟩`` and ``Σₘₙ wₘₙ Vᵃₘₙ ⊙ Vᵇₘₙ`` of two outer-product factors
  against the per-sample gradients built from the definition, for every pairing of one-hot and
  dense rows, with several columns and weights.
* End to end (Hypothesis over sizes, padding and the kind of tie): BatchL2Grad, SumGradSquared,
  Variance and BatchGrad of tied models against float64 per-sample references, DiagGGNExact
  against the dense GGN, DiagGGNMC within its standard error of it, and the invariants between
  the extensions — an embedding tied to its output layer (module and functional), one Linear
  applied twice (bias included), one embedding looked up twice.
* A tied parameter's statistics do not build its per-sample gradients; a convolution and
  Hugging Face's ``Conv1D`` used twice likewise.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from backprism import collect, extend
from backprism.engine.rule import Outer
from backprism.engine.tied import cross_batch_l2, cross_sum_squared
from backprism.extensions import (
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)
from backprism.rules.embedding import EmbeddingRule
from backprism.rules.linear import LinearRule
from tests.common import assert_mc_within
from tests.reference import (
    ggn_blocks_loop,
    per_sample_grads,
    per_sample_grads_replacing,
    split,
)

DT = torch.float64
TOL = {"rtol": 1e-7, "atol": 1e-11}


# ------------------------------------------------------------------------------- cross terms
def _factor(kind: str, m: int, n: int, t: int, r: int, c: int, gen: torch.Generator) -> Outer:
    cols = torch.randn(m, n, t, c, dtype=DT, generator=gen)
    if kind == "one_hot":
        return Outer(torch.randint(0, r, (n, t), generator=gen), cols, r)
    # "dense_1": the columns shared by the M columns of g (a Linear's input)
    rows = torch.randn(m, n, t, r, dtype=DT, generator=gen)
    return Outer(rows, cols[:1] if kind == "dense_1" else cols, r)


def _dense(o: Outer, m: int) -> Tensor:
    """``Vₘₙ = Σₜ rₘₙₜ cₘₙₜᵀ`` from the definition, ``[M, N, R, C]``."""
    rows = o.rows
    if o.one_hot:
        rows = nn.functional.one_hot(rows, o.size).to(DT)[None]
    rows, cols = rows.expand(m, *rows.shape[1:]), o.cols.expand(m, *o.cols.shape[1:])
    return torch.einsum("mntr,mntc->mnrc", rows, cols)


KINDS = ["one_hot", "dense", "dense_1"]


@pytest.mark.parametrize("ka", KINDS)
@pytest.mark.parametrize("kb", KINDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_terms_against_the_definition(ka: str, kb: str, weighted: bool) -> None:
    gen = torch.Generator().manual_seed(10 * KINDS.index(ka) + 2 * KINDS.index(kb) + weighted)
    m, n, r, c = 3, 4, 6, 5
    a = _factor(ka, m, n, 2, r, c, gen)
    b = _factor(kb, m, n, 7, r, c, gen)
    va, vb = _dense(a, m), _dense(b, m)
    w = torch.randn(m, n, dtype=DT, generator=gen) if weighted else None
    expected = va * vb * (1 if w is None else w[:, :, None, None])
    torch.testing.assert_close(cross_batch_l2(a, b), (va * vb).sum((0, 2, 3)), **TOL)
    if a.one_hot or b.one_hot:
        torch.testing.assert_close(cross_sum_squared(a, b, w), expected.sum((0, 1)), **TOL)
    else:
        with pytest.raises(ValueError, match="one-hot"):
            cross_sum_squared(a, b, w)


@pytest.mark.parametrize("weighted", [False, True])
def test_statistics_of_the_sum_in_sample_chunks(monkeypatch: pytest.MonkeyPatch, weighted):
    """Where the cross terms would build per-sample gradients, the statistic of the sum is
    taken from them a chunk of samples at a time: one-hot and dense uses together."""
    import backprism.engine.tied as tied

    monkeypatch.setattr(tied, "CHUNK_ELEMENTS", 70)
    gen = torch.Generator().manual_seed(3)
    m, n, r, c = 2, 5, 3, 4
    outers = [
        _factor("dense", m, n, 9, r, c, gen),
        _factor("dense_1", m, n, 8, r, c, gen),
        _factor("one_hot", m, n, 2, r, c, gen),
    ]
    v = sum(_dense(o, m) for o in outers)
    w = torch.randn(m, n, dtype=DT, generator=gen) if weighted else None
    sq = v.square() * (1 if w is None else w[:, :, None, None])
    torch.testing.assert_close(
        tied.summed_in_chunks(outers, "batch_l2", None), v.square().sum((0, 2, 3)), **TOL
    )
    torch.testing.assert_close(
        tied.summed_in_chunks(outers, "sum_squared", w), sq.sum((0, 1)), **TOL
    )


# ---------------------------------------------------------------------------------- models
class TiedHead(nn.Module):
    """An embedding tied to the output layer: a module (``head.weight = emb.weight``) or
    functional (``h @ emb.weight.T``)."""

    def __init__(self, vocab: int, d: int, padding: bool, functional: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=1 if padding else None)
        self.lin = nn.Linear(d, d)
        self.functional = functional
        if not functional:
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        h = torch.tanh(self.lin(self.emb(idx)))
        logits = h @ self.emb.weight.T if self.functional else self.head(h)
        return logits.transpose(1, 2)  # [N, V, T]


class TwiceLinear(nn.Module):
    """One Linear (weight and bias) applied on two sequences of different lengths."""

    def __init__(self, vocab: int, d: int, padding: bool, functional: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lin = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        a = torch.tanh(self.lin(h))  # [N, T, d]
        b = self.lin(torch.sin(h[:, :1]))  # [N, 1, d]: the same weight and bias again
        return self.head(a + b).transpose(1, 2)


class TwiceLookup(nn.Module):
    """One embedding looked up for the tokens and for their reversed sequence."""

    def __init__(self, vocab: int, d: int, padding: bool, functional: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=1 if padding else None)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        h = torch.tanh(self.emb(idx) * self.emb(idx.flip(1)))
        return self.head(h).transpose(1, 2)


MODELS = {"head": TiedHead, "linear": TwiceLinear, "lookup": TwiceLookup}


def _data(seed: int, n: int, t: int, vocab: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=gen), torch.randint(
        0, vocab, (n, t), generator=gen
    )


def _build(kind: str, seed: int, vocab: int, d: int, padding: bool, functional: bool):
    torch.manual_seed(seed)
    model = MODELS[kind](vocab, d, padding, functional).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.7)
    return extend(model), extend(nn.CrossEntropyLoss())


def _reference(model: nn.Module, lossfunc: nn.Module, x: Tensor, y: Tensor, padded: bool):
    return (per_sample_grads_replacing if padded else per_sample_grads)(model, lossfunc, x, y)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(sorted(MODELS)),
    n=st.integers(1, 4),
    t=st.integers(1, 5),
    vocab=st.integers(3, 8),
    d=st.integers(1, 4),
    padding=st.booleans(),
    functional=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_first_order_of_tied_parameters(kind, n, t, vocab, d, padding, functional, seed):
    model, lossfunc = _build(kind, seed, vocab, d, padding, functional)
    x, y = _data(seed, n, t, vocab)
    ref = _reference(model, lossfunc, x, y, padding and kind != "linear")
    model.zero_grad()
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        r = ref[name]
        torch.testing.assert_close(p.grad_batch, r, **TOL)
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, **TOL)
        torch.testing.assert_close(p.batch_l2, r.flatten(1).square().sum(1), **TOL)
        torch.testing.assert_close(p.sum_grad_squared, r.square().sum(0), **TOL)
        torch.testing.assert_close(p.variance, r.var(0, unbiased=False), **TOL)


@settings(max_examples=10, deadline=None)
@given(
    kind=st.sampled_from(sorted(MODELS)),
    n=st.integers(1, 3),
    t=st.integers(1, 3),
    padding=st.booleans(),
    functional=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_ggn_diagonal_of_tied_parameters(kind, n, t, padding, functional, seed):
    vocab, d = 4, 3
    model, lossfunc = _build(kind, seed, vocab, d, padding, functional)
    x, y = _data(seed, n, t, vocab)
    G = ggn_blocks_loop(model, lossfunc, x, y)
    expected = split(torch.diagonal(G.sum((0, 1))), model)
    model.zero_grad()
    with collect(DiagGGNExact()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, expected[name], **TOL)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_mc_ggn_diagonal_of_tied_parameters(kind: str) -> None:
    """``diag_ggn_mc`` is the mean of the draws ``M·V[m]²`` of ``SqrtGGNMC(M)`` (the same
    columns, summed over the uses of a tied parameter before squaring) and within 6 standard
    errors of the dense GGN's diagonal."""
    mc, vocab, d = 4000, 4, 3
    model, lossfunc = _build(kind, 0, vocab, d, padding=True, functional=False)
    x, y = _data(0, 2, 3, vocab)
    G = ggn_blocks_loop(model, lossfunc, x, y)
    expected = split(torch.diagonal(G.sum((0, 1))), model)
    torch.manual_seed(1)
    model.zero_grad()
    with collect(DiagGGNMC(mc), SqrtGGNMC(mc)):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        draws = (p.sqrt_ggn_mc.square() * mc).sum(1)  # [M, *p]
        assert_mc_within(p.diag_ggn_mc, draws, expected[name])


def test_tied_statistics_build_no_per_sample_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """An embedding tied to its output layer: ``batch_l2``, ``sum_grad_squared`` and
    ``variance`` of the shared ``[V, d]`` matrix come from the two calls' closed forms and
    cross terms, never from ``[N, V, d]`` per-sample gradients."""
    built: list[str] = []
    for rule in (LinearRule, EmbeddingRule):
        original = rule.per_sample

        def spy(self, call, g, original=original, rule=rule):
            built.append(rule.__name__)
            return original(self, call, g)

        monkeypatch.setattr(rule, "per_sample", spy)
    model, lossfunc = _build("head", 0, 7, 3, padding=True, functional=False)
    x, y = _data(0, 3, 4, 7)
    ref = _reference(model, lossfunc, x, y, padded=True)["emb.weight"]
    with collect(BatchL2Grad(), SumGradSquared(), Variance()):
        lossfunc(model(x), y).backward()
    assert built == []
    w = model.emb.weight
    torch.testing.assert_close(w.batch_l2, ref.flatten(1).square().sum(1), **TOL)
    torch.testing.assert_close(w.variance, ref.var(0, unbiased=False), **TOL)


class TwiceConv(nn.Module):
    """One convolution (weight and bias) applied to the image and to its 2×-pooled copy."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 2, padding=1)
        self.head = nn.Linear(3, 4)

    def forward(self, x: Tensor) -> Tensor:
        a = torch.tanh(self.conv(x)).mean((2, 3))
        b = self.conv(nn.functional.avg_pool2d(x, 2)).amax((2, 3))
        return self.head(a * b)


class TwiceConv1D(nn.Module):
    """Hugging Face's ``Conv1D`` (GPT-2's projections, weight ``[in, out]``) applied twice."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.proj = Conv1D(3, 3)
        self.head = nn.Linear(3, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.proj(x)) + self.proj(x[:, :1].sin())).mean(1)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 3), size=st.integers(2, 5), seed=st.integers(0, 2**16))
def test_convolutions_used_twice(n: int, size: int, seed: int) -> None:
    """A convolution and a ``Conv1D`` each used by two calls: their outer factors' cross terms
    against float64 per-sample references, without per-sample gradients of the shared weight
    for ``BatchL2Grad``/``SumGradSquared``/``Variance``."""
    pytest.importorskip("transformers")
    from backprism.rules.conv import Conv2dRule

    gen = torch.Generator().manual_seed(seed)
    cases = [
        (TwiceConv, torch.randn(n, 2, size, size, dtype=DT, generator=gen), Conv2dRule),
        (TwiceConv1D, torch.randn(n, size, 3, dtype=DT, generator=gen), LinearRule),
    ]
    for make, x, rule in cases:
        torch.manual_seed(seed)
        model, lossfunc = extend(make().to(DT)), extend(nn.CrossEntropyLoss())
        y = torch.randint(0, 4, (n,), generator=gen)
        ref = per_sample_grads(model, lossfunc, x, y)
        calls: list[int] = []
        original = rule.per_sample

        def spy(self, call, g, original=original, calls=calls):
            calls.append(1)
            return original(self, call, g)

        rule.per_sample = spy  # type: ignore[method-assign]
        try:
            with collect(BatchL2Grad(), SumGradSquared(), Variance()):
                lossfunc(model(x), y).backward()
        finally:
            rule.per_sample = original  # type: ignore[method-assign]
        assert calls == [], make.__name__
        for name, p in model.named_parameters():
            r = ref[name]
            torch.testing.assert_close(p.batch_l2, r.flatten(1).square().sum(1), **TOL)
            torch.testing.assert_close(p.sum_grad_squared, r.square().sum(0), **TOL)
            torch.testing.assert_close(p.variance, r.var(0, unbiased=False), **TOL)
