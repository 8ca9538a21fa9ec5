"""The generic ``torch.func`` rule's guards: broken batching rules, 0-d parameters, tied
parameters — against float64 references from the definition, independent of backprism.

* **Broken batching rules.** PyTorch 2.13's batching rule of ``prelu``'s backward, under the
  rule's nested ``vmap`` (samples × columns), leaks the outer sample axis into the inner one:
  ``[N, N, *θ]`` for ``[M, N, *θ]``, the right values on the diagonal only. The rule checks
  every result's shape and spot-checks two off-diagonal entries against plain autograd, then
  falls back to its loop over samples (one warning). A module calling ``F.prelu`` on its own
  parameter takes the generic rule (``nn.PReLU`` has a closed form, ``tests/rules/
  test_prelu.py``). Checked: ``M = 1`` (the shape check), ``M = N`` (shapes agree, the spot
  check must catch it), and no false alarm on a module whose ``vmap`` is right, in float32
  and float64.
* **0-d parameters** (a learnable temperature, ReZero's ``α``): every first-order extension,
  and the GGN family, on a module with a scalar parameter.
* **Tied parameters**: a tensor under a name the call claims and one it does not (Hugging
  Face's ``BertLMPredictionHead.bias`` is ``decoder.bias``; the decoder's own call accounts for
  it), under two names the call claims (a sub-module used functionally), and frozen under two
  names; ``BertForMaskedLM`` end to end.

References: per-sample gradients ``∇(ℓₙ/N)`` from ``reference.per_sample_grads`` (one
``vmap`` over per-sample parameter copies with the real loss) checked against
``reference.per_sample_grads_loop`` (no ``vmap``) where ``prelu`` is involved; rule-level
vector-Jacobian products with ``torch.func.grad`` one sample and column at a time; GGN
diagonals from ``reference.batch_diag_ggn_loop``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad

from backprism import collect, extend
from backprism.engine.rule import get_rule
from backprism.extensions import (
    KFLR,
    BatchDiagGGNExact,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)
from backprism.extensions.projections import BatchDotWith, BatchProjGrad, GradHist
from backprism.rules import generic
from tests.common import make_call
from tests.reference import (
    batch_diag_ggn_loop,
    hist1d_ref,
    per_sample_grads,
    per_sample_grads_loop,
    per_sample_grads_multi,
    per_sample_grads_replacing,
)

DT = torch.float64
TOL = {"rtol": 1e-7, "atol": 1e-10}
FIRST_ORDER = (BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad)


class FunctionalPReLU(nn.Module):
    """``F.prelu(x, w)`` with its own slopes: no registered rule, so the generic one."""

    def __init__(self, slopes: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(slopes) * 2 - 1)

    def forward(self, x: Tensor) -> Tensor:
        return F.prelu(x, self.w)


class SmoothCustom(nn.Module):
    """A custom module whose ``vmap`` is right: ``tanh(x Wᵀ) ⊙ s``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.s = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.weight.T) * self.s


@pytest.fixture
def vmap_only(monkeypatch):
    """The generic rule's ``vmap`` path for every module: ``F.prelu`` is affine in its slopes,
    which the rule would otherwise compute in closed form (``rules.elementwise``), never
    reaching the broken batching rule these tests are about."""
    from backprism.rules import elementwise

    monkeypatch.setattr(elementwise, "affine_per_sample", lambda *args: None)


@pytest.fixture(autouse=True)
def _fresh_generic_state():
    """The generic rule remembers module types (warned, vmap broken) per process."""
    types = (FunctionalPReLU, SmoothCustom)
    for t in types:
        generic._WARNED.discard(t)
        generic._VMAP_BROKEN.discard(t)
    yield
    for t in types:
        generic._WARNED.discard(t)
        generic._VMAP_BROKEN.discard(t)


def _expected(gb: Tensor) -> dict[str, Tensor]:
    """What each first-order extension stores, from per-sample gradients ``gb = [N, *p]``
    (``p`` may be 0-d: ``gb = [N]``)."""
    f = gb.reshape(gb.shape[0], -1)
    return {
        "grad_batch": gb,
        "batch_l2": f.square().sum(1),
        "sum_grad_squared": gb.square().sum(0),
        "variance": gb.var(0, unbiased=False),
        "batch_dot": f @ f.t(),
    }


def _check_first_order(model: nn.Module, ref: dict[str, Tensor]) -> None:
    """The five first-order fields and ``.grad`` of every parameter (shared ones once, under
    their first name) against per-sample references ``{name: [N, *p]}``."""
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        for field, value in _expected(ref[name]).items():
            got = getattr(p, field)
            assert got.shape == value.shape, (name, field, got.shape, value.shape)
            torch.testing.assert_close(got, value, **TOL, msg=f"{name}.{field}")
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, **TOL, msg=f"{name}: Σ ≠ grad")
        torch.testing.assert_close(p.grad, ref[name].sum(0), **TOL, msg=f"{name}.grad")


# -- broken batching rules --------------------------------------------------------------------
def _prelu_vjps(module: FunctionalPReLU, x: Tensor, g: Tensor) -> Tensor:
    """``V[m, n] = ∇_w ⟨prelu(xₙ; w), g[m, n]⟩``, ``[M, N, *w.shape]``, by ``grad`` one sample
    and one column at a time (no ``vmap``)."""
    w = module.w.detach()

    def contribution(w: Tensor, xn: Tensor, gn: Tensor) -> Tensor:
        return (F.prelu(xn.unsqueeze(0), w).squeeze(0) * gn).sum()

    return torch.stack(
        [
            torch.stack([grad(contribution)(w, x[i], g[k, i]) for i in range(x.shape[0])])
            for k in range(g.shape[0])
        ]
    )


@pytest.mark.parametrize(("slopes", "columns"), [(1, 1), (6, 1), (1, 4), (6, 4), (6, 3)])
def test_broken_batching_rule_falls_back_to_the_loop(
    slopes: int, columns: int, vmap_only: None
) -> None:
    """``per_sample`` with ``M`` columns on ``N = 4`` samples: the nested ``vmap`` of
    ``F.prelu`` is wrong (``M = 1``: wrong shape; ``M = N``: right shape, wrong values off the
    diagonal); the rule notices, warns once and returns the loop's (right) values."""
    torch.manual_seed(slopes + columns)
    n = 4
    module = FunctionalPReLU(slopes).to(DT)
    x = torch.randn(n, 6, dtype=DT)
    call, out_shape = make_call(module, x)
    g = torch.randn(columns, *out_shape, dtype=DT)
    rule = get_rule(module)
    assert isinstance(rule, generic.GenericRule)
    # M ∉ {1, N}: torch's vmap itself raises (sizes mismatch), the older fallback
    match = "batching rule is broken" if columns in (1, n) else "cannot vmap FunctionalPReLU"
    with pytest.warns(RuntimeWarning, match=match):
        got = rule.per_sample(call, g)["w"]
    torch.testing.assert_close(got, _prelu_vjps(module, x, g), rtol=1e-10, atol=1e-13)
    assert (FunctionalPReLU in generic._VMAP_BROKEN) == (columns in (1, n))
    # later calls go straight to the loop, without another warning
    g2 = torch.randn(columns, *out_shape, dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got2 = rule.per_sample(call, g2)["w"]
    torch.testing.assert_close(got2, _prelu_vjps(module, x, g2), rtol=1e-10, atol=1e-13)


def test_spot_check_catches_right_shapes_with_wrong_values(vmap_only: None) -> None:
    """``M = N``: the leaked axis has the size of the column axis, so only the spot check of
    an off-diagonal entry sees the error."""
    torch.manual_seed(0)
    n = 4
    module = FunctionalPReLU(1).to(DT)
    x = torch.randn(n, 6, dtype=DT)
    call, out_shape = make_call(module, x)
    g = torch.randn(n, *out_shape, dtype=DT)
    with pytest.warns(RuntimeWarning, match="differ from plain autograd"):
        got = get_rule(module).per_sample(call, g)["w"]
    torch.testing.assert_close(got, _prelu_vjps(module, x, g), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("columns", [1, 4])
def test_no_false_alarm_when_vmap_is_right(dtype: torch.dtype, columns: int) -> None:
    torch.manual_seed(1)
    n = 4
    module = SmoothCustom(5).to(dtype)
    x = torch.randn(n, 5, dtype=dtype)
    call, out_shape = make_call(module, x)
    g = torch.randn(columns, *out_shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        get_rule(module).per_sample(call, g)
    assert SmoothCustom not in generic._VMAP_BROKEN


def test_broken_batching_end_to_end(vmap_only: None) -> None:
    """First-order extensions and DiagGGNExact through ``F.prelu`` in a custom module (the
    QA's ``Linear → PReLU → Linear``, with the PReLU as generic module)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 6), FunctionalPReLU(6), nn.Linear(6, 3)).to(DT)
    x = torch.randn(4, 5, dtype=DT)
    y = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(2))
    lf = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lf, x, y)
    loop = per_sample_grads_loop(model, lf, x, y)
    for k in ref:
        torch.testing.assert_close(ref[k], loop[k], rtol=1e-10, atol=1e-13)
    ggn = batch_diag_ggn_loop(model, lf, x, y)
    extend(model)
    extend(lf)
    warned = pytest.warns(RuntimeWarning, match="batching rule is broken")
    with warned, collect(*(e() for e in FIRST_ORDER)):
        lf(model(x), y).backward()
    _check_first_order(model, ref)
    with collect(DiagGGNExact()):
        lf(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ggn[name].sum(0), **TOL, msg=name)


# -- 0-d parameters ---------------------------------------------------------------------------
class ScalarParams(nn.Module):
    """``(x Wᵀ + b) · α / τ``: a ReZero-style gate ``α`` and a temperature ``τ``, both 0-d."""

    def __init__(self, d: int, c: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, c)
        self.alpha = nn.Parameter(torch.tensor(0.7))
        self.temp = nn.Parameter(torch.tensor(1.3))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.alpha / self.temp


def _scalar_problem() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(3)
    model = nn.Sequential(ScalarParams(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    x = torch.randn(4, 5, dtype=DT)
    y = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(3))
    return model, x, y


def test_zero_dim_parameters_first_order() -> None:
    """BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad, BatchDotWith and
    BatchProjGrad with 0-d parameters (``grad_batch`` ``[N]``, ``batch_l2`` ``[N]``,
    ``sum_grad_squared``/``variance`` 0-d, ``batch_dot`` ``[N, N]``)."""
    model, x, y = _scalar_problem()
    lf = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lf, x, y)
    extend(model)
    extend(lf)
    gen = torch.Generator().manual_seed(4)
    vectors = {p: torch.randn(p.shape, generator=gen, dtype=DT) for p in model.parameters()}
    with collect(*(e() for e in FIRST_ORDER), BatchDotWith(vectors), BatchProjGrad()):
        lf(model(x), y).backward()
    _check_first_order(model, ref)
    for name, p in model.named_parameters():
        r = ref[name].reshape(x.shape[0], -1)
        torch.testing.assert_close(p.batch_dot_with, r @ vectors[p].reshape(-1), **TOL)
        torch.testing.assert_close(p.batch_proj_grad, r @ r.sum(0), **TOL)
    assert model[0].alpha.grad_batch.shape == (x.shape[0],)
    assert model[0].alpha.sum_grad_squared.shape == ()


def test_zero_dim_parameters_second_order() -> None:
    """DiagGGNExact (0-d), BatchDiagGGNExact (``[N]``), SqrtGGNExact (``[C, N]``, squares summing
    to the diagonal) and KFLR (one ``[1, 1]`` diagonal factor) for 0-d parameters."""
    model, x, y = _scalar_problem()
    lf = nn.CrossEntropyLoss()
    ref = batch_diag_ggn_loop(model, lf, x, y)
    extend(model)
    extend(lf)
    with collect(DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), KFLR()):
        lf(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref[name].sum(0), **TOL, msg=name)
        torch.testing.assert_close(p.diag_ggn_exact_batch, ref[name], **TOL, msg=name)
        torch.testing.assert_close(p.sqrt_ggn_exact.square().sum((0, 1)), ref[name].sum(0), **TOL)
    for p in (model[0].alpha, model[0].temp):
        (factor,) = p.kflr
        torch.testing.assert_close(factor, p.diag_ggn_exact.reshape(1, 1), **TOL)


def test_zero_dim_parameter_in_two_forwards() -> None:
    """The parameter is used by two calls (two forwards, one backward): the engine sums each
    sample's contributions before the statistics (``from_dense``)."""
    model, x, y = _scalar_problem()
    x2 = x.flip(0) + 0.5
    lf = nn.CrossEntropyLoss()

    def total(o1: Tensor, o2: Tensor) -> Tensor:
        return lf(o1, y) + lf(o2, y)

    ref = per_sample_grads_multi(model, total, [x, x2])
    extend(model)
    extend(lf)
    with collect(*(e() for e in FIRST_ORDER)):
        (lf(model(x), y) + lf(model(x2), y)).backward()
    _check_first_order(model, ref)


def test_zero_dim_parameter_grad_hist() -> None:
    model, x, y = _scalar_problem()
    lf = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lf, x, y)
    extend(model)
    extend(lf)
    with collect(GradHist(bins=8, range=(-1.0, 1.0))):
        lf(model(x), y).backward()
    p = model[0].alpha
    want = hist1d_ref((x.shape[0] * ref["0.alpha"]).numpy(), 8, -1.0, 1.0)
    np.testing.assert_array_equal(p.grad_hist["hist"].numpy(), want)


# -- tied parameters --------------------------------------------------------------------------
class TiedToCalled(nn.Module):
    """Own ``bias`` tied to ``proj.bias`` of a sub-module that runs (as Hugging Face's
    ``BertLMPredictionHead``), also used directly: ``proj(x) + ½ bias``."""

    def __init__(self, d: int, c: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, c)
        self.bias = self.proj.bias

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x) + 0.5 * torch.tanh(self.bias)


class TiedToUncalled(nn.Module):
    """Own ``w`` tied to ``sub.weight`` of a sub-module that never runs (used functionally):
    both names belong to this call."""

    def __init__(self, d: int, c: int) -> None:
        super().__init__()
        self.sub = nn.Linear(d, c)
        self.w = self.sub.weight

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.w.T) + F.linear(x, self.sub.weight, self.sub.bias)


class FrozenTied(nn.Module):
    """A frozen tensor under two names (``a``, ``sub.a``), next to a trainable one."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(d) + 0.5)
        self.a = nn.Parameter(torch.randn(d), requires_grad=False)
        self.sub = nn.Module()
        self.sub.a = self.a

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.scale + self.a) * self.sub.a


@pytest.mark.parametrize("kind", ["called", "uncalled", "frozen"])
def test_tied_parameters(kind: str) -> None:
    torch.manual_seed(5)
    d, c, n = 5, 3, 4
    first: nn.Module
    if kind == "called":
        first = TiedToCalled(d, d)
    elif kind == "uncalled":
        first = TiedToUncalled(d, d)
    else:
        first = FrozenTied(d)
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(d, c)).to(DT)
    x = torch.randn(n, d, dtype=DT)
    y = torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(5))
    lf = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lf, x, y)
    extend(model)
    extend(lf)
    with collect(*(e() for e in FIRST_ORDER)):
        lf(model(x), y).backward()
    _check_first_order(model, ref)


def test_bert_for_masked_lm_tied_bias() -> None:
    """``BertForMaskedLM`` (small config, no download): ``cls.predictions.bias`` is
    ``cls.predictions.decoder.bias`` (and the decoder weight is the word embedding); the five
    first-order extensions of every parameter against ``∇(ℓₙ/N)`` per sequence."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=12, max_position_embeddings=16,
    )
    torch.manual_seed(0)

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = transformers.BertForMaskedLM(cfg)

        def forward(self, ids: Tensor) -> Tensor:
            return self.bert(input_ids=ids).logits

    model = Logits().to(DT).eval()
    head = model.bert.cls.predictions
    assert head.bias is head.decoder.bias
    n, t = 3, 6
    ids = torch.randint(0, cfg.vocab_size, (n, t), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, cfg.vocab_size, (n, t), generator=torch.Generator().manual_seed(2))
    lf = nn.CrossEntropyLoss()

    def loss(out: Tensor, y: Tensor) -> Tensor:  # out: [N, T, V]
        return lf(out.reshape(-1, cfg.vocab_size), y.reshape(-1))

    # no vmap: the batching rule of embedding's backward masks padding_idx (BERT's token 0)
    # for the first sample only (torch 2.13), see reference.per_sample_grads_replacing
    ref = per_sample_grads_loop(model, loss, ids, y)
    other = per_sample_grads_replacing(model, loss, ids, y)
    for k in ref:
        torch.testing.assert_close(ref[k], other[k], rtol=1e-9, atol=1e-12)
    assert (ids == model.bert.config.pad_token_id).any()  # the padding row is exercised
    extend(model)
    extend(lf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic rule's announcement
        with collect(*(e() for e in FIRST_ORDER)):
            loss(model(ids), y).backward()
    _check_first_order(model, ref)


class _FoldedOutput(nn.Module):
    """WavLM's attention: besides its output it returns a per-sample value with the batch
    folded into another axis, ``[N·H, T]``, which later layers use."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(2, 4) + 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x[:, None] * self.scale  # [N, H, T]
        return h.sum(1), h.reshape(-1, h.shape[-1])


class _UsesFolded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _FoldedOutput()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, folded = self.inner(x)
        return self.head(out + folded.view(x.shape[0], -1, 4).mean(1))


def test_an_output_with_the_batch_folded_is_refused_before_the_pass() -> None:
    """The generic rule cannot split an output with no axis of the batch's size: refused
    before anything is written (it failed mid-pass before, after autograd had written part of
    ``.grad``)."""
    from backprism.extensions import BatchGrad

    torch.manual_seed(0)
    model = extend(_UsesFolded().double())
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the generic rule's notice)
        loss = nn.functional.cross_entropy(model(x), y)
    with pytest.raises(RuntimeError, match="no axis of the batch's size 3"), collect(BatchGrad()):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
