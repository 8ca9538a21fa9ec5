"""Generic ``torch.func`` rule: modules without a registered rule against dense float64 references.

Covered: ``nn.MultiheadAttention`` (self/cross attention, ``need_weights``, masks as kwargs,
``is_causal``, separate k/v dims, ``add_bias_kv``), ``nn.LSTM``/``nn.GRU``/``nn.RNN``
(multi-layer, bidirectional, initial states, ``h_n`` used), ``nn.Bilinear`` and custom modules with
their own parameters used nonlinearly; the loop fallback for non-vmappable forwards; columns
``M > 1`` through the rule directly; the errors (dropout in train mode, ``batch_first=False``).

References: ``reference.per_sample_grads`` (vmap over per-sample parameter copies) where the model
is vmappable; for RNNs, whose kernels have no batching rule,
``reference.per_sample_grads_loop`` — the same definition (every sample gets its own
parameter copy ``θₙ = θ``; the real loss is evaluated on the concatenated outputs, so
``∂L/∂θₙ = ∇(ℓₙ/N)``) with a Python loop instead of ``vmap``.

End to end, second order: ``DiagGGNExact``/``BatchDiagGGNExact``/``SqrtGGNExact`` on
``layer → tanh → Linear`` for MultiheadAttention, Bilinear and a custom module under a small
``memory_budget``, against ``tests/reference.py::ggn_blocks``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from backprism import collect, extend
from backprism.engine.rule import Call, get_rule
from backprism.extensions import BatchGrad
from backprism.rules import generic
from tests.common import check_first_order, generic_model, labels, run_family
from tests.reference import per_sample_grads, per_sample_grads_loop

SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)
DT = torch.float64


def _labels(n: int, c: int, seed: int) -> Tensor:
    return torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(seed))


# -- MultiheadAttention --------------------------------------------------------------------
class AttnModel(nn.Module):
    """Self- or cross-attention with optional masks, attention weights used in the output."""

    def __init__(
        self, e: int, heads: int, kdim: int | None, bias: bool, bias_kv: bool, weights: bool,
        mask: str, causal: bool, classes: int = 3,
    ) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(
            e, heads, batch_first=True, kdim=kdim, vdim=kdim, bias=bias, add_bias_kv=bias_kv
        )
        self.head = nn.Linear(e, classes)
        self.weights, self.mask, self.causal = weights, mask, causal

    def forward(self, x: Tensor, mem: Tensor, kpm: Tensor, mask3: Tensor) -> Tensor:
        kwargs = {"need_weights": self.weights}
        length, src = x.shape[1], mem.shape[1]
        if self.mask == "causal":
            kwargs["attn_mask"] = torch.triu(
                torch.ones(length, src, dtype=torch.bool), 1
            )
            kwargs["is_causal"] = self.causal
        elif self.mask == "float2d":
            kwargs["attn_mask"] = torch.linspace(-1, 1, length * src, dtype=x.dtype).reshape(
                length, src
            )
        elif self.mask == "per_sample3d":  # [N, H, L, S] input -> [N*H, L, S]
            kwargs["attn_mask"] = mask3.reshape(-1, length, src)
        elif self.mask == "key_padding":
            kwargs["key_padding_mask"] = kpm
        out, w = self.attn(x, mem, mem, **kwargs)
        y = self.head(out.tanh().mean(1))
        if w is not None:
            y = y + w.square().sum((1, 2))[:, None]
        return y


@pytest.mark.parametrize("mask", ["none", "causal", "float2d", "per_sample3d", "key_padding"])
@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 3),
    length=st.integers(1, 3),
    src=st.integers(1, 3),
    heads=st.sampled_from([1, 2]),
    cross=st.booleans(),
    bias=st.booleans(),
    bias_kv=st.booleans(),
    weights=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_multihead_attention(mask, n, length, src, heads, cross, bias, bias_kv, weights, seed):
    torch.manual_seed(seed)
    e = 4
    if not cross or mask == "causal":
        src = length
    kdim = 3 if cross else None
    model = extend(
        AttnModel(e, heads, kdim, bias, bias_kv, weights, mask, causal=not weights).to(DT)
    )
    x = torch.randn(n, length, e, dtype=DT)
    mem = torch.randn(n, src, kdim or e, dtype=DT) if cross else x
    kpm = torch.zeros(n, src, dtype=torch.bool)
    kpm[:, src - 1] = torch.rand(n) < 0.5  # never mask every key of a sample
    mask3 = torch.randn(n, heads, length, src, dtype=DT)
    X = (x, mem, kpm, mask3)
    y = _labels(n, 3, seed)
    lossfunc = extend(nn.CrossEntropyLoss())
    ref = per_sample_grads(model, lossfunc, X, y)
    assert "attn.out_proj.weight" in ref
    check_first_order(model, lossfunc, X, y, ref)


def test_multihead_attention_batch_size_equals_length():
    """A 2-d mask [L, S] with L == N is shared, not split over samples."""
    torch.manual_seed(0)
    model = extend(AttnModel(4, 2, None, True, False, True, "float2d", False).to(DT))
    x = torch.randn(3, 3, 4, dtype=DT)
    X = (x, x, torch.zeros(3, 3, dtype=torch.bool), torch.zeros(3, 2, 3, 3, dtype=DT))
    y = _labels(3, 3, 0)
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    check_first_order(model, lossfunc, X, y, per_sample_grads(model, lossfunc, X, y))


# -- RNNs ------------------------------------------------------------------------------------
class RNNModel(nn.Module):
    """RNN with initial state(s) from the input, classifying from the last output and h_n."""

    def __init__(self, kind: type, f: int, h: int, layers: int, bidir: bool, init: bool) -> None:
        super().__init__()
        self.rnn = kind(f, h, num_layers=layers, bidirectional=bidir, batch_first=True)
        d = 2 if bidir else 1
        self.head = nn.Linear(d * h + layers * d * h, 3)
        self.init = init

    def forward(self, x: Tensor, h0: Tensor) -> Tensor:
        hx = None
        if self.init:  # h0: [N, 2, layers*dirs, H] -> [layers*dirs, N, H] (batch on axis 1)
            h, c = h0.movedim(0, 2).contiguous().unbind(0)
            hx = (h, c) if isinstance(self.rnn, nn.LSTM) else h
        out, state = self.rnn(x, hx)
        h_n = state[0] if isinstance(state, tuple) else state
        feats = torch.cat([out[:, -1], h_n.transpose(0, 1).flatten(1).sin()], 1)
        return self.head(feats)


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN], ids=["lstm", "gru", "rnn"])
@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 3),
    t=st.integers(1, 3),
    layers=st.integers(1, 2),
    bidir=st.booleans(),
    init=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rnn(kind, n, t, layers, bidir, init, seed):
    torch.manual_seed(seed)
    f, h = 3, 2
    model = extend(RNNModel(kind, f, h, layers, bidir, init).to(DT))
    x = torch.randn(n, t, f, dtype=DT)
    h0 = torch.randn(n, 2, layers * (2 if bidir else 1), h, dtype=DT)
    y = _labels(n, 3, seed)
    lossfunc = extend(nn.CrossEntropyLoss())
    ref = per_sample_grads_loop(model, lossfunc, (x, h0), y)
    check_first_order(model, lossfunc, (x, h0), y, ref)


# -- Bilinear --------------------------------------------------------------------------------
class BilinearModel(nn.Module):
    def __init__(self, a: int, b: int, o: int, bias: bool) -> None:
        super().__init__()
        self.bil = nn.Bilinear(a, b, o, bias=bias)

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        out = self.bil(x1, x2)
        return out.flatten(1, -2).mean(1) if out.dim() > 2 else out


@SETTINGS
@given(
    n=st.integers(1, 4),
    mid=st.sampled_from([(), (2,)]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bilinear(n, mid, bias, seed):
    torch.manual_seed(seed)
    model = extend(BilinearModel(3, 2, 4, bias).to(DT))
    X = (torch.randn(n, *mid, 3, dtype=DT), torch.randn(n, *mid, 2, dtype=DT))
    y = torch.randn(n, 4, dtype=DT)
    lossfunc = extend(nn.MSELoss())
    check_first_order(model, lossfunc, X, y, per_sample_grads(model, lossfunc, X, y))


# -- custom modules --------------------------------------------------------------------------
class Custom(nn.Module):
    """Own parameters used nonlinearly, a frozen one, a child used functionally and one called."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(i))
        self.W = nn.Parameter(torch.randn(i, o))
        self.frozen = nn.Parameter(torch.randn(o), requires_grad=False)
        self.proj = nn.Linear(o, o)  # used functionally: the custom call owns its parameters
        self.called = nn.Linear(i, i)  # called: has its own call and rule
        self.register_buffer("shift", torch.randn(o))

    def forward(self, x: Tensor, gain: float = 1.0, *, temperature: Tensor | None = None) -> Tensor:
        z = self.scale * self.called(x).tanh() @ self.W + self.frozen + self.shift
        z = nn.functional.linear(torch.sigmoid(z * gain), self.proj.weight, self.proj.bias)
        if temperature is not None:
            z = z / temperature
        return z


class CustomModel(nn.Module):
    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.custom = Custom(i, o)
        self.head = nn.Linear(o, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.custom(x, 0.7, temperature=torch.tensor(1.5, dtype=x.dtype)).cos())


@SETTINGS
@given(n=st.integers(1, 4), mid=st.sampled_from([(), (2,)]), seed=st.integers(0, 2**16))
def test_custom_module(n, mid, seed):
    torch.manual_seed(seed)
    model = extend(CustomModel(3, 4).to(DT))
    x = torch.randn(n, *mid, 3, dtype=DT)
    y = _labels(n, 3, seed) if not mid else torch.randn(n, *mid, 3, dtype=DT)
    lossfunc = extend(nn.CrossEntropyLoss() if not mid else nn.MSELoss(reduction="sum"))
    ref = per_sample_grads(model, lossfunc, x, y)
    assert "custom.proj.weight" in ref and "custom.frozen" not in ref
    check_first_order(model, lossfunc, x, y, ref)


class Router(nn.Module):
    """A mixture-of-experts router: its outputs are the logits and what is computed from them
    inside the module (softmax weights, the top-k choice)."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d))
        self.temperature = nn.Parameter(torch.tensor(1.3))

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = nn.functional.linear(h, self.weight)
        weights = (logits / self.temperature).softmax(-1)  # a parameter of its own on the way
        top = weights.topk(2, -1)
        return logits, top.values, top.indices


class Routed(nn.Module):
    """Two experts mixed by the router's weights; ``use_logits`` also feeds the logits to the
    head (an auxiliary path from outside the router)."""

    def __init__(self, use_logits: bool) -> None:
        super().__init__()
        self.router = Router(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 3)
        self.use_logits = use_logits

    def forward(self, x: Tensor) -> Tensor:
        logits, w, idx = self.router(x)
        outs = torch.stack([e(x) for e in self.experts], 1)  # [N, 3, 4]
        picked = outs.gather(1, idx[..., None].expand(-1, -1, 4))  # [N, 2, 4]
        z = self.head((w[..., None] * picked).sum(1))
        return z + logits.tanh() if self.use_logits else z


@pytest.mark.parametrize("use_logits", [False, True])
def test_outputs_computed_from_other_outputs(use_logits: bool) -> None:
    """An output that another output was computed from inside the module gets, at its own
    node, the other's gradient too; the rule's vector-Jacobian product of the whole call
    must not count it again (it did: per-sample gradients 2× the router's). First order and
    the GGN diagonal against ``torch.func`` / the dense GGN."""
    from backprism.extensions import DiagGGNExact
    from tests.reference import diag_blocks, ggn_blocks, split

    torch.manual_seed(0)
    model = extend(Routed(use_logits).to(DT))
    x, y = torch.randn(5, 4, dtype=DT), _labels(5, 3, 0)
    lossfunc = extend(nn.CrossEntropyLoss())
    check_first_order(model, lossfunc, x, y, per_sample_grads(model, lossfunc, x, y))
    G, _, _ = ggn_blocks(model, lossfunc, x, y)
    want = split(diag_blocks(G), model, lead=1)
    with collect(DiagGGNExact()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, want[name].sum(0), msg=name)


class MaskedMix(nn.Module):
    """A leaf module (generic rule) taking a per-sample ``[N, T, d]`` input and a ``[T, T]``
    table the same for every sample (Funnel's class mask): with ``T = N`` axis 0 of the table
    has the batch's size."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d))

    def forward(self, x: Tensor, table: Tensor, ones: Tensor) -> Tensor:
        scores = torch.einsum("ntd,de,nse->nts", x, self.weight, x) * table
        return (scores.softmax(-1) @ x) * ones[:, :, None]


class WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = MaskedMix(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        n, t = x.shape[:2]
        table = nn.functional.pad(x.new_ones(t - 1, t - 1), (1, 0, 1, 0)).tril()
        ones = torch.ones(n, t, dtype=x.dtype)  # the same for every sample, with the batch
        return self.head(self.mix(x, table, ones).mean(1))


@pytest.mark.parametrize("t", [3, 4])
def test_input_the_same_for_every_sample_is_not_split(t: int) -> None:
    """An input that the forward mode finds the same for every sample and whose rows differ
    is shared even where its axis 0 has the batch's size (``T = N = 3``), also in later
    forwards run outside ``collect`` (the model keeps the forward mode that tells it); a
    batch of equal rows is split as any batch."""
    torch.manual_seed(0)
    model = extend(WithTable().to(DT))
    x, y = torch.randn(3, t, 4, dtype=DT), _labels(3, 3, 0)
    lossfunc = extend(nn.CrossEntropyLoss())
    ref = per_sample_grads(model, lossfunc, x, y)
    check_first_order(model, lossfunc, x, y, ref)
    for _ in range(2):
        model.zero_grad()
        loss = lossfunc(model(x), y)
        with collect(BatchGrad()):
            loss.backward()
        torch.testing.assert_close(model.mix.weight.grad_batch, ref["mix.weight"])


class Buffered(nn.Module):
    """A buffer from a factory (the same for every sample) into which per-sample values are
    written in place (Longformer's global-attention buffer) before a generic-rule module."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
        self.mix = Cached()  # (generic rule; an empty cache)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        buf = x.new_zeros(h.shape)
        buf[:, :] = h
        return self.head(self.mix(buf, _Cache(torch.zeros(0))).mean(1))


def test_factory_tensor_written_with_samples_is_per_sample() -> None:
    """``buf = x.new_zeros(...); buf[...] = h``: after the write it holds the samples' values,
    so the generic rule splits it (it is no longer the same for every sample)."""
    torch.manual_seed(0)
    model = extend(Buffered().to(DT))
    x, y = torch.randn(3, 3, 4, dtype=DT), _labels(3, 3, 0)
    lossfunc = extend(nn.CrossEntropyLoss())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", generic.GenericRuleWarning)
        check_first_order(model, lossfunc, x, y, per_sample_grads_loop(model, lossfunc, x, y))


class _Cache:
    """State of the whole batch in an object (a generation cache)."""

    def __init__(self, state: Tensor) -> None:
        self.state = state


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor, cache: _Cache) -> Tensor:
        if not cache.state.numel():
            return torch.tanh(x @ self.weight) * x.sum(-1, keepdim=True)
        return torch.cat([cache.state, x], -1) @ torch.cat([self.weight, self.weight]).tanh()


def test_failing_one_sample_run_is_explained() -> None:
    """A module whose run on one sample fails because an argument the rule cannot split holds
    the whole batch's state: the error names the object and the way out."""
    torch.manual_seed(0)
    model = extend(Cached().to(DT))
    x = torch.randn(3, 4, dtype=DT)
    refused = pytest.raises(RuntimeError, match=r"one sample at a time.*_Cache.*use_cache=False")
    with refused, warnings.catch_warnings(), collect(BatchGrad()):
        warnings.simplefilter("ignore", generic.GenericRuleWarning)
        model(x, _Cache(torch.randn(3, 4, dtype=DT))).sum().backward()


def test_generic_rule_is_the_fallback():
    assert isinstance(get_rule(Custom(2, 2)), generic.GenericRule)
    assert isinstance(get_rule(nn.MultiheadAttention(2, 1)), generic.GenericRule)


class Branchy(nn.Module):
    """Data-dependent control flow: ``vmap`` cannot run it, the loop fallback must."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: Tensor) -> Tensor:
        z = x @ self.w
        z = torch.stack([r.tanh() if float(r.sum()) > 0 else r for r in z])  # per sample
        return z * self.w.sum()


def test_loop_fallback_warns_once_and_is_correct():
    torch.manual_seed(1)
    model = extend(nn.Sequential(Branchy(), nn.Linear(3, 2)).to(DT))
    x = torch.randn(5, 3, dtype=DT)
    x[:2] *= -1
    y = _labels(5, 2, 1)
    lossfunc = extend(nn.CrossEntropyLoss())
    ref = per_sample_grads_loop(model, lossfunc, x, y)
    generic._WARNED.discard(Branchy)
    with pytest.warns(RuntimeWarning, match="loop over samples"):
        check_first_order(model, lossfunc, x, y, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_first_order(model, lossfunc, x, y, ref)


class _ConvBNTokens(nn.Module):
    """Convolution, eval-mode batch norm and the maps turned into tokens (HF LeViT's patch
    embedding): no closed-form rule. torch 2.13's CPU backward of that batch norm is wrong at
    batch size 1 for the transposed gradient layout, right within a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, 3, 3) * 0.5)
        self.gamma, self.beta = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("var", torch.rand(4) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = nn.functional.conv2d(x, self.w, padding=1)
        h = nn.functional.batch_norm(h, self.mean, self.var, self.gamma, self.beta, False)
        return h.flatten(2).transpose(1, 2)


class _OneSampleDiffers(nn.Module):
    """Computes differently on a batch of one sample than within a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale * (2.0 if x.shape[0] == 1 else 1.0)


def test_per_sample_gradients_are_checked_within_the_batch() -> None:
    """The generic rule checks its vmap against plain autograd on the whole batch with one
    sample's column, not on that sample alone: a kernel wrong at batch size 1 (eval batch
    norm above) does not turn a right vmap into the wrong one-sample loop (per-sample
    gradients and GGN diagonal against the rows of a batch forward); a module whose one-sample
    results do not sum to the batch's gradient is refused (during the backward, where the rule
    runs: no result is left, ``.grad`` is autograd's as in any failed backward)."""
    from backprism.extensions import DiagGGNExact
    from tests.common import assert_nothing_written
    from tests.reference import per_sample_grads_rows

    torch.manual_seed(0)
    model = nn.Sequential(_ConvBNTokens(), nn.Flatten(), nn.Linear(36, 3)).to(DT).eval()
    x, y = torch.randn(3, 3, 3, 3, dtype=DT), _labels(3, 3, 0)
    ref = per_sample_grads_rows(model, x, y)
    params = dict(model.named_parameters())
    out = model(x)
    jac = [
        torch.autograd.grad(out[n, c], list(params.values()), retain_graph=True)
        for n in range(3)
        for c in range(3)
    ]
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", generic.GenericRuleWarning)
        with collect(BatchGrad(), DiagGGNExact()):
            lossfunc(model(x), y).backward()
    for i, (k, p) in enumerate(params.items()):
        torch.testing.assert_close(p.grad_batch, ref[k], rtol=1e-8, atol=1e-12)
        want = torch.zeros_like(p)
        for n in range(3):
            prob = out[n].detach().softmax(0)
            hess = (torch.diag(prob) - torch.outer(prob, prob)) / 3
            j = torch.stack([jac[3 * n + c][i].flatten() for c in range(3)])
            want += torch.einsum("cp,cd,dp->p", j, hess, j).reshape(p.shape)
        torch.testing.assert_close(p.diag_ggn_exact, want, rtol=1e-8, atol=1e-12)
    model = extend(nn.Sequential(_OneSampleDiffers(), nn.Linear(4, 3)).to(DT))
    x = torch.randn(3, 4, dtype=DT)
    refused = pytest.raises(RuntimeError, match="do not sum to the gradient of the whole batch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with refused, collect(BatchGrad()):
            lossfunc(model(x), y).backward()
    assert_nothing_written(model)


# -- columns M > 1 through the rule directly -------------------------------------------------
@pytest.mark.parametrize("kind", ["attn", "lstm"])
def test_per_sample_columns(kind):
    """``per_sample(call, g)`` with ``M = 3`` columns and multi-output ``g`` against
    ``Vₘₙ = Jₙᵀ g[m, n]`` computed by autograd on each sample separately."""
    torch.manual_seed(2)
    n, t, e, m = 3, 2, 4, 3
    x = torch.randn(n, t, e, dtype=DT)
    if kind == "attn":
        module = nn.MultiheadAttention(e, 2, batch_first=True).to(DT)
        args, kwargs = (x, x, x), {"need_weights": True}
        axes = [0, 0]

        def one(i: int) -> tuple:
            return module(x[i : i + 1], x[i : i + 1], x[i : i + 1], need_weights=True)
    else:
        module = nn.LSTM(e, 2, num_layers=2, batch_first=True).to(DT)
        args, kwargs = (x,), {}
        axes = [0, 1, 1]

        def one(i: int) -> tuple:
            out, (h, c) = module(x[i : i + 1])
            return out, h, c

    outs = [o for o in one(0)]
    out_shapes = [
        torch.Size([*o.shape[:a], n, *o.shape[a + 1 :]]) for o, a in zip(outs, axes)
    ]
    g = tuple(torch.randn(m, *s, dtype=DT) for s in out_shapes)
    params = dict(module.named_parameters())
    call = Call(module=module, args=args, kwargs=kwargs, out_shapes=out_shapes, batch_size=n,
                training=module.training, params=params)
    result = generic.GenericRule().per_sample(call, g)
    assert set(result) == set(params)
    for i in range(n):
        outs = one(i)
        for k in range(m):
            cot = [gj[k].narrow(a, i, 1) for gj, a in zip(g, axes)]
            ref = torch.autograd.grad(outs, list(params.values()), cot, retain_graph=True)
            for (name, _), r in zip(params.items(), ref):
                torch.testing.assert_close(result[name][k, i], r, msg=f"{name}[{k},{i}]")


# -- errors ----------------------------------------------------------------------------------
def _backward(model: nn.Module, x: Tensor, classes: int = 2) -> None:
    lossfunc = extend(nn.CrossEntropyLoss())
    out = model(x)
    with collect(BatchGrad()):
        lossfunc(out, _labels(x.shape[0], classes, 0)).backward()


class Pool(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.inner, nn.MultiheadAttention):
            out = self.inner(x, x, x, need_weights=False)[0]
        else:
            out = self.inner(x)
        out = out[0] if isinstance(out, tuple) else out
        return self.head(out.mean(1))


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(x @ self.w)


class WithRandom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w + 0.1 * torch.rand(x.shape[-1])


@pytest.mark.parametrize(
    "make",
    [
        # (self-attention without bias_kv takes its dropout masks from the real backward;
        # with bias_kv, the recomputing closed forms cannot: the generic rule refuses)
        lambda: nn.MultiheadAttention(4, 2, dropout=0.2, batch_first=True, add_bias_kv=True),
        lambda: nn.LSTM(4, 4, num_layers=2, dropout=0.3, batch_first=True),
    ],
    ids=["mha", "lstm"],
)
def test_dropout_in_train_mode_is_refused_and_eval_works(make):
    torch.manual_seed(0)
    model = extend(Pool(make()).to(DT))
    x = torch.randn(3, 2, 4, dtype=DT)
    with pytest.raises(RuntimeError, match=r"dropout.*model\.eval\(\)"):
        _backward(model, x)
    model.eval()
    _backward(model, x)
    assert model.inner.parameters().__next__().grad_batch.shape[0] == 3


def test_container_with_dropout_in_train_mode_attributes_where_the_parameter_enters():
    """A container's own parameter is attributed where it enters (``x @ self.w``), so the
    dropout after it takes its mask from the real backward pass: train mode works."""
    torch.manual_seed(0)
    model = extend(Pool(WithDropout()).to(DT))
    x = torch.randn(3, 2, 4, dtype=DT)
    _backward(model, x)
    w = model.inner.w
    torch.testing.assert_close(w.grad_batch.sum(0), w.grad)
    # sample n's gradient is xₙᵀ (mask ⊙ gₙ): zero rows of xₙ give zero rows
    x[1] = 0.0
    model.zero_grad()
    _backward(model, x)
    assert w.grad_batch[1].abs().max() == 0 and w.grad_batch[0].abs().max() > 0
    torch.testing.assert_close(w.grad_batch.sum(0), w.grad)


def test_random_forward_is_refused():
    model = extend(Pool(WithRandom()).to(DT))
    with pytest.raises(RuntimeError, match="random"):
        _backward(model, torch.randn(3, 2, 4, dtype=DT))


def test_batchnorm_child_in_train_mode_is_refused():
    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))
            self.bn = nn.BatchNorm1d(2, affine=False)

        def forward(self, x: Tensor) -> Tensor:
            return self.bn(x @ self.w)

    model = extend(Pool(Norm()).to(DT))
    with pytest.raises(RuntimeError, match="BatchNorm"):
        _backward(model, torch.randn(3, 2, 4, dtype=DT))


@pytest.mark.parametrize(
    ("make", "error"),
    [
        # RNNs and attention take their batch from axis 1; Pool's head then averages over that
        # axis, losing the batch (tests/engine/test_forward_batch_axis.py: what works)
        (lambda: nn.LSTM(4, 4), RuntimeError),
        (lambda: nn.GRU(4, 4), RuntimeError),
        (lambda: nn.MultiheadAttention(4, 2), RuntimeError),
    ],
    ids=["lstm", "gru", "mha"],
)
def test_batch_first_false_misread_is_refused(make, error):
    model = extend(Pool(make()).to(DT))
    with pytest.raises(error, match=r"batch_first=False.*batch_first=True"):
        _backward(model, torch.randn(3, 2, 4, dtype=DT))


def test_packed_sequence_is_refused():
    class Packed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(4, 2, batch_first=True)

        def forward(self, x: Tensor) -> Tensor:
            packed = nn.utils.rnn.pack_padded_sequence(x, [2] * x.shape[0], batch_first=True)
            return self.rnn(packed)[1][0]

    model = extend(Packed().to(DT))
    with pytest.raises(NotImplementedError, match="PackedSequence"):
        _backward(model, torch.randn(3, 2, 4, dtype=DT))


# -- the generic module as the extended root; second order through the engine ---------------
def test_generic_module_is_the_root():
    """The re-run of a module that is itself the extended root must not disturb the capture."""
    torch.manual_seed(3)
    model = extend(Custom(3, 2).to(DT))
    x = torch.randn(4, 3, dtype=DT)
    y = torch.randn(4, 2, dtype=DT)
    lossfunc = extend(nn.MSELoss())
    check_first_order(model, lossfunc, x, y, per_sample_grads(model, lossfunc, x, y))
    check_first_order(model, lossfunc, x, y, per_sample_grads(model, lossfunc, x, y))


@pytest.mark.parametrize("kind", ["custom", "attn"])
def test_ggn_diagonal_through_generic_rule(kind):
    """``DiagGGNExact`` (``M = C`` columns pushed through the rule) against the dense GGN."""
    from backprism.extensions import BatchDiagGGNExact, DiagGGNExact
    from tests.reference import diag_blocks, ggn_blocks, split

    torch.manual_seed(4)
    n = 3
    if kind == "custom":
        model = extend(CustomModel(3, 2).to(DT))
        X: Tensor | tuple = torch.randn(n, 3, dtype=DT)
    else:
        model = extend(AttnModel(4, 2, None, True, False, True, "key_padding", False).to(DT))
        x = torch.randn(n, 2, 4, dtype=DT)
        X = (x, x, torch.zeros(n, 2, dtype=torch.bool), torch.zeros(n, 2, 2, 2, dtype=DT))
    y = _labels(n, 3, 4)
    lossfunc = extend(nn.CrossEntropyLoss())
    G, _, _ = ggn_blocks(model, lossfunc, X, y)
    per_n = split(diag_blocks(G), model, lead=1)
    xs = X if isinstance(X, tuple) else (X,)
    with collect(DiagGGNExact(), BatchDiagGGNExact()):
        lossfunc(model(*xs), y).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.diag_ggn_exact_batch, per_n[name], msg=name)
            torch.testing.assert_close(p.diag_ggn_exact, per_n[name].sum(0), msg=name)


N = 2  # batch of the second-order family test


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("kind", ["mha", "bilinear", "custom"])
def test_generic(kind):
    model, X = generic_model(kind, seed=4)
    run_family(model, X, labels(N, seed=4), {"memory_budget": 200})
