"""Embedding and normalisation-layer rules against dense float64 references from ``torch.func``.

Rule level: every rule method is compared with per-sample vector-Jacobian products of the
module's own forward (``vmap`` over samples and columns of ``vjp``), with random cotangents for
``M = 3`` columns and random signed column weights. End to end: ``extend``/``collect`` with the
first-order extensions on small models against ``tests/reference.py::per_sample_grads``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev, vjp, vmap

import backprism
from backprism.engine.rule import Call, get_rule
from backprism.extensions import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance

from reference import per_sample_grads

M = 3
SETTINGS = settings(max_examples=20, deadline=None)
ATOL, RTOL = 1e-10, 1e-8


# --------------------------------------------------------------------------- reference helpers
def ref_per_sample(module: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
    """``{name: [M, N, *p]}``: ``vjp`` of the module's forward on sample ``n`` with ``g[m, n]``."""
    params = {k: v.detach() for k, v in module.named_parameters()}

    def one(xn: Tensor, gn: Tensor) -> dict[str, Tensor]:
        def f(p: dict[str, Tensor]) -> Tensor:
            return functional_call(module, p, (xn.unsqueeze(0),)).squeeze(0)

        return vjp(f, params)[1](gn)[0]

    over_columns = vmap(one, in_dims=(None, 0))
    return vmap(over_columns, in_dims=(0, 1), out_dims=1)(x, g)


def _replace_sample(model: nn.Module, x: Tensor, n: int, params: dict[str, Tensor]) -> Tensor:
    """Model outputs of the batch, with sample ``n``'s output computed from ``params``."""
    with torch.no_grad():
        out = model(x)
    out_n = functional_call(model, params, (x[n : n + 1],))
    return torch.cat([out[:n], out_n, out[n + 1 :]])


def per_sample_grads_loop(model: nn.Module, loss_fn: nn.Module, x: Tensor, y: Tensor):
    """``{name: [N, *p]}``: ``∂L/∂θ`` through sample ``n``'s output only, one sample at a time.

    ``reference.per_sample_grads`` vmaps over per-sample weights, and PyTorch's batching rule of
    ``embedding`` backward with a batched weight masks ``padding_idx`` for the first sample only
    (torch 2.13), so padded embeddings are checked against this loop instead."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    rows = []
    for n in range(x.shape[0]):
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        loss = loss_fn(_replace_sample(model, x, n, p), y)
        rows.append(dict(zip(p, torch.autograd.grad(loss, list(p.values())))))
    return {k: torch.stack([r[k] for r in rows]) for k in params}


def batch_diag_ggn_loop(model: nn.Module, loss_fn: nn.Module, x: Tensor, y: Tensor):
    """``{name: [N, *p]}``: ``diag(Jₙᵀ (∂²L/∂fₙ²) Jₙ)`` from dense Jacobians and Hessians."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    rows = []
    with torch.no_grad():
        out = model(x)
    for n in range(x.shape[0]):
        xn, before, after = x[n : n + 1], out[:n], out[n + 1 :]

        def f_n(p: dict[str, Tensor], xn: Tensor = xn) -> Tensor:
            return functional_call(model, p, (xn,))[0]

        def loss_n(o: Tensor, before: Tensor = before, after: Tensor = after) -> Tensor:
            return loss_fn(torch.cat([before, o[None], after]), y)

        jac = jacrev(f_n)(params)
        hess = hessian(loss_n)(out[n])
        rows.append({k: torch.einsum("c...,cd,d...->...", j, hess, j) for k, j in jac.items()})
    return {k: torch.stack([r[k] for r in rows]) for k in params}


def make_call(module: nn.Module, x: Tensor) -> tuple[Call, torch.Size]:
    with torch.no_grad():
        out = module(x)
    call = Call(
        module=module,
        args=(x,),
        kwargs={},
        out_shapes=[out.shape],
        batch_size=x.shape[0],
        training=module.training,
        params=dict(module.named_parameters()),
    )
    return call, out.shape


def close(actual: Tensor, expected: Tensor) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def check_rule(module: nn.Module, x: Tensor, seed: int) -> None:
    """Every statistic of ``module``'s rule against the dense per-sample reference."""
    gen = torch.Generator().manual_seed(seed)
    call, out_shape = make_call(module, x)
    n = x.shape[0]
    g = torch.randn(M, *out_shape, generator=gen, dtype=torch.float64)
    w = torch.randn(M, n, generator=gen, dtype=torch.float64)
    ref = ref_per_sample(module, x, g)
    rule = get_rule(module)
    assert type(rule).__module__ != "backprism.rules.generic"

    def stats(p: Tensor) -> dict[str, Tensor]:
        wsq = p.square() * w.reshape(M, n, *([1] * (p.dim() - 2)))
        f = p.flatten(2)
        return {
            "per_sample": p,
            "summed": p.sum(1),
            "sum_squared": p.square().sum((0, 1)),
            "sum_squared_w": wsq.sum((0, 1)),
            "batch_sum_squared": p.square().sum(0),
            "batch_sum_squared_w": wsq.sum(0),
            "batch_l2": f.square().sum((0, 2)),
            "batch_dot": torch.einsum("mni,mki->nk", f, f),
        }

    expected = {k: stats(p) for k, p in ref.items()}
    computed = {
        "per_sample": rule.per_sample(call, g),
        "summed": rule.summed(call, g),
        "sum_squared": rule.sum_squared(call, g),
        "sum_squared_w": rule.sum_squared(call, g, w),
        "batch_sum_squared": rule.batch_sum_squared(call, g),
        "batch_sum_squared_w": rule.batch_sum_squared(call, g, w),
        "batch_l2": rule.batch_l2(call, g),
        "batch_dot": rule.batch_dot(call, g),
    }
    results = {
        what: (got, {k: expected[k][what] for k in expected}) for what, got in computed.items()
    }
    for what, (got, want) in results.items():
        assert set(got) == set(want), (what, set(got), set(want))
        for k in want:
            try:
                close(got[k], want[k])
            except AssertionError as err:
                raise AssertionError(f"{what}[{k}]: {err}") from err


# --------------------------------------------------------------------------------- Embedding
@st.composite
def embedding_cases(draw):
    n = draw(st.integers(1, 3))
    positions = draw(st.lists(st.integers(1, 3), max_size=2))
    vocab = draw(st.integers(2, 5))
    dim = draw(st.integers(1, 3))
    padding = draw(st.one_of(st.none(), st.integers(-vocab, vocab - 1)))
    seed = draw(st.integers(0, 2**16))
    return n, positions, vocab, dim, padding, seed


def _embedding(n, positions, vocab, dim, padding, seed) -> tuple[nn.Embedding, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    module = nn.Embedding(vocab, dim, padding_idx=padding).double()
    idx = torch.randint(0, vocab, (n, *positions), generator=gen)
    if padding is not None and idx.numel() > 1:
        idx.view(-1)[0] = padding % vocab  # make sure a padding position occurs
    return module, idx


@SETTINGS
@given(embedding_cases())
def test_embedding_rule(case):
    module, idx = _embedding(*case)
    check_rule(module, idx, case[-1])


def test_embedding_repeated_tokens_and_padding():
    """All positions hold the same token or padding: per-sample sums before squaring."""
    module = nn.Embedding(4, 2, padding_idx=1).double()
    idx = torch.tensor([[2, 2, 2, 1], [1, 1, 1, 1], [3, 2, 3, 2]])
    check_rule(module, idx, 0)
    call, shape = make_call(module, idx)
    g = torch.randn(M, *shape, dtype=torch.float64)
    ps = get_rule(module).per_sample(call, g)["weight"]
    assert ps[:, :, 1].abs().max() == 0  # the padding row gets no gradient
    close(ps[:, 0, 2], g[:, 0, :3].sum(1))
    assert ps[:, 1].abs().max() == 0  # a sample made only of padding


@SETTINGS
@given(embedding_cases())
def test_embedding_kronecker_factors(case):
    module, idx = _embedding(*case)
    n, _, vocab, dim, padding, seed = case
    call, shape = make_call(module, idx)
    g = torch.randn(M, *shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    a, b = get_rule(module).kronecker_factors(call, g)["weight"]
    onehot = nn.functional.one_hot(idx.reshape(-1), vocab).double()  # [N·T, V]
    gf = g.reshape(M, -1, dim)
    if padding is not None:
        mask = (idx.reshape(-1) != padding % vocab).double()
        onehot = onehot * mask[:, None]
        gf = gf * mask[None, :, None]
    close(a, torch.einsum("pu,pv->uv", onehot, onehot) / n)
    close(b, torch.einsum("mpd,mpe->de", gf, gf))
    assert a.shape == (vocab, vocab) and b.shape == (dim, dim)


def test_embedding_kflr_exact_for_one_token():
    """One sample, one position: ``A_tokens ⊗ B`` is the exact GGN block of the weight."""
    pytest.importorskip("backprism.extensions.kronecker")
    from backprism.extensions.kronecker import KFLR

    from reference import ggn

    model = _randomize(nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 5)).double(), 4)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.tensor([2]), torch.tensor([1])
    block = ggn(model, loss_fn, x, y)[:12, :12]
    backprism.extend(model)
    backprism.extend(loss_fn)
    with backprism.collect(KFLR(), chunk_size=2):  # B summed over 3 chunks, A_tokens once
        loss_fn(model(x), y).backward()
    a, b = model[0].weight.kflr
    close(a, torch.diag(torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)))
    close(torch.kron(a, b), block)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_norm": 1.0}, "max_norm"), ({"scale_grad_by_freq": True}, "scale_grad_by_freq")],
)
def test_embedding_unsupported_options(kwargs, match):
    module = nn.Embedding(5, 2, **kwargs).double()
    idx = torch.tensor([[0, 1], [1, 1]])
    call, shape = make_call(module, idx)
    g = torch.randn(1, *shape, dtype=torch.float64)
    rule = get_rule(module)
    for method in (rule.per_sample, rule.batch_l2, rule.sum_squared, rule.batch_dot):
        with pytest.raises(NotImplementedError, match=match):
            method(call, g)


# --------------------------------------------------------------------------------- norms
@st.composite
def trailing_norm_cases(draw):
    n = draw(st.integers(1, 3))
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    normalized = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    seed = draw(st.integers(0, 2**16))
    return n, lead, normalized, seed


def _randomize(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return module


@SETTINGS
@given(trailing_norm_cases(), st.floats(1e-6, 1e-1), st.booleans())
def test_layernorm_rule(case, eps, bias):
    n, lead, normalized, seed = case
    module = _randomize(nn.LayerNorm(normalized, eps=eps, bias=bias).double(), seed)
    x = torch.randn(n, *lead, *normalized, generator=torch.Generator().manual_seed(seed)).double()
    check_rule(module, x, seed)


@SETTINGS
@given(trailing_norm_cases(), st.one_of(st.none(), st.floats(1e-6, 1e-1)))
def test_rmsnorm_rule(case, eps):
    n, lead, normalized, seed = case
    module = _randomize(nn.RMSNorm(normalized, eps=eps).double(), seed)
    x = torch.randn(n, *lead, *normalized, generator=torch.Generator().manual_seed(seed)).double()
    if eps is None:  # tiny inputs make finfo.eps matter
        x = x * 1e-8
    check_rule(module, x, seed)


@SETTINGS
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 2),
    st.lists(st.integers(1, 3), max_size=2),
    st.floats(1e-6, 1e-1),
    st.integers(0, 2**16),
)
def test_groupnorm_rule(n, groups, per_group, spatial, eps, seed):
    channels = groups * per_group
    if per_group == 1 and all(s == 1 for s in spatial):
        spatial = [*spatial, 2]  # PyTorch refuses a single value per group
    module = _randomize(nn.GroupNorm(groups, channels, eps=eps).double(), seed)
    x = torch.randn(n, channels, *spatial, generator=torch.Generator().manual_seed(seed)).double()
    check_rule(module, x, seed)


@SETTINGS
@given(
    st.sampled_from(
        [(nn.BatchNorm1d, 0), (nn.BatchNorm1d, 1), (nn.BatchNorm2d, 2), (nn.BatchNorm3d, 3)]
    ),
    st.integers(1, 3),
    st.integers(1, 3),
    st.floats(1e-6, 1e-1),
    st.integers(0, 2**16),
)
def test_batchnorm_eval_rule(kind, n, channels, eps, seed):
    cls, nspatial = kind
    gen = torch.Generator().manual_seed(seed)
    module = _randomize(cls(channels, eps=eps).double(), seed)
    with torch.no_grad():
        module.running_mean.copy_(torch.randn(channels, generator=gen))
        module.running_var.copy_(torch.rand(channels, generator=gen) + 0.1)
    module.eval()
    spatial = [2, 3, 2][:nspatial]
    x = torch.randn(n, channels, *spatial, generator=gen).double()
    check_rule(module, x, seed)


def test_norm_frozen_parameter_is_skipped():
    module = _randomize(nn.LayerNorm(3).double(), 0)
    module.bias.requires_grad_(False)
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    call, shape = make_call(module, x)
    call.params = {k: p for k, p in module.named_parameters() if p.requires_grad}
    g = torch.randn(M, *shape, dtype=torch.float64)
    assert set(get_rule(module).per_sample(call, g)) == {"weight"}


def test_norm_errors():
    bn = nn.BatchNorm1d(3, track_running_stats=False).double().eval()
    call, shape = make_call(bn, torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="track_running_stats"):
        get_rule(bn).per_sample(call, torch.randn(1, *shape, dtype=torch.float64))
    bn = nn.BatchNorm1d(3).double()  # train mode (KFAC-like paths reach the rule directly)
    call, shape = make_call(bn, torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="eval"):
        get_rule(bn).summed(call, torch.randn(1, *shape, dtype=torch.float64))
    ln = nn.LayerNorm([2, 3]).double()
    call, shape = make_call(ln, torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="batch axis"):
        get_rule(ln).per_sample(call, torch.randn(1, *shape, dtype=torch.float64))


# --------------------------------------------------------------------------------- end to end
FIRST_ORDER = (BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad())


class SequenceModel(nn.Module):
    """Embedding → LayerNorm → Linear, mean over positions."""

    def __init__(self, vocab: int, dim: int, classes: int, padding_idx: int | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(self.norm(self.emb(x))).mean(1)


def check_first_order(model: nn.Module, loss_fn: nn.Module, x: Tensor, y: Tensor) -> None:
    backprism.extend(model)
    backprism.extend(loss_fn)
    padded = any(getattr(m, "padding_idx", None) is not None for m in model.modules())
    ref = (per_sample_grads_loop if padded else per_sample_grads)(model, loss_fn, x, y)
    n = x.shape[0]
    with backprism.collect(*FIRST_ORDER):
        loss_fn(model(x), y).backward()
    checked = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        r = ref[name]
        close(p.grad_batch, r)
        close(p.batch_l2, r.flatten(1).square().sum(1))
        close(p.sum_grad_squared, r.square().sum(0))
        close(p.variance, r.square().mean(0) - r.mean(0).square())
        close(p.batch_dot, r.flatten(1) @ r.flatten(1).t())
        close(p.grad, r.sum(0))
        assert p.grad_batch.shape == (n, *p.shape)
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_sequence_model_end_to_end(reduction, padding_idx):
    torch.manual_seed(0)
    model = _randomize(SequenceModel(5, 3, 4, padding_idx).double(), 0)
    x = torch.tensor([[0, 2, 2, 4], [1, 1, 0, 0], [3, 2, 3, 3]])
    y = torch.tensor([0, 3, 1])
    check_first_order(model, nn.CrossEntropyLoss(reduction=reduction), x, y)


def test_sequence_model_batch_size_one():
    model = _randomize(SequenceModel(4, 2, 3, 1).double(), 1)
    x = torch.tensor([[1, 2, 2, 3, 1]])
    check_first_order(model, nn.CrossEntropyLoss(), x, torch.tensor([2]))


def _conv_model(norm: nn.Module) -> nn.Sequential:
    conv = nn.Conv2d(2, 4, 3)
    conv.requires_grad_(False)  # the Conv2d rule is tested elsewhere; here only the norms count
    return nn.Sequential(conv, norm, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 2, 3))


@pytest.mark.parametrize("kind", ["group", "batch"])
def test_conv_norm_model_end_to_end(kind):
    torch.manual_seed(0)
    norm = nn.GroupNorm(2, 4) if kind == "group" else nn.BatchNorm2d(4)
    model = _randomize(_conv_model(norm).double(), 2)
    if kind == "batch":
        with torch.no_grad():
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 1.5)
        model.eval()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    check_first_order(model, nn.CrossEntropyLoss(), x, torch.tensor([0, 2, 1]))


def test_batchnorm_train_mode_error():
    model = backprism.extend(_conv_model(nn.BatchNorm2d(4)).double())
    loss_fn = backprism.extend(nn.CrossEntropyLoss())
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="eval"), backprism.collect(BatchGrad()):
        loss_fn(model(x), torch.tensor([0, 2, 1])).backward()


def _diag_ggn_models() -> list[tuple[nn.Module, Tensor, Tensor]]:
    seq = _randomize(SequenceModel(5, 3, 4, 0).double(), 3)
    seq_x, seq_y = torch.tensor([[0, 2, 2, 4], [1, 1, 0, 3]]), torch.tensor([0, 3])
    group = _randomize(_conv_model(nn.GroupNorm(2, 4)).double(), 5)
    bn = nn.BatchNorm2d(4)
    batch = _randomize(_conv_model(bn).double(), 6).eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 1.5)
    img = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    return [(seq, seq_x, seq_y), (group, img, torch.tensor([2, 0])), (batch, img, seq_y[:2] % 3)]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["embedding-layernorm", "groupnorm", "batchnorm"])
def test_diag_ggn_end_to_end(which):
    """Second order through the engine (loss square roots from
    ``backprism.engine.loss_hessian``)."""
    pytest.importorskip("backprism.engine.loss_hessian")
    from backprism.extensions import BatchDiagGGNExact, DiagGGNExact

    torch.manual_seed(which)
    model, x, y = _diag_ggn_models()[which]
    loss_fn = nn.CrossEntropyLoss()
    batch = batch_diag_ggn_loop(model, loss_fn, x, y)
    backprism.extend(model)
    backprism.extend(loss_fn)
    with backprism.collect(DiagGGNExact(), BatchDiagGGNExact(), chunk_size=3):
        loss_fn(model(x), y).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            close(p.diag_ggn_exact_batch, batch[name])
            close(p.diag_ggn_exact, batch[name].sum(0))


def test_norm_normalizes_once_per_call(monkeypatch):
    """``x̂`` is computed once per call although several statistics need it, and the cache is
    dropped at the end of the backward pass."""
    from backprism.rules import norm

    counts: dict[int, int] = {}
    original = norm.LayerNormRule.normalized

    def counting(self, call):
        counts[id(call)] = counts.get(id(call), 0) + 1
        return original(self, call)

    monkeypatch.setattr(norm.LayerNormRule, "normalized", counting)
    model = _randomize(SequenceModel(5, 3, 4, None).double(), 7)
    x, y = torch.tensor([[0, 2], [1, 1]]), torch.tensor([0, 3])
    check_first_order(model, nn.CrossEntropyLoss(), x, y)
    assert list(counts.values()) == [1]
    assert norm._LAST is None
