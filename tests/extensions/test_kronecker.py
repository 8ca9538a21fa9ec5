"""KFAC / KFLR against the dense GGN in their exact limits, and MC in expectation.

Also: KFLR in its exact limit (N = 1, one output position) on ``layer → tanh → Linear`` for
Linear, Conv1d/2d/3d and Embedding (``tests.common.check_kflr_exact``); on every device (the
``device`` fixture), KFLR/KFAC factor shapes, symmetry and finiteness on seven models (layers
without Kronecker factors frozen), every factor on the device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions.kronecker import KFAC, KFLR, KFRA
from tests.common import (
    DEVICE_MODELS,
    Head,
    build_on_device,
    check_kflr_exact,
    check_stored,
    expected_kronecker_shapes,
    freeze_kronecker_unsupported,
    fresh_backward,
    labels,
    trainable,
)
from tests.reference import ggn

DT = torch.float64


def _blocks(model, G):
    out, i = {}, 0
    for name, p in model.named_parameters():
        n = p.numel()
        out[name] = G[i : i + n, i : i + n]
        i += n
    return out


def _kron(factors):
    m = factors[0]
    for f in factors[1:]:
        m = torch.kron(m, f)
    return m


@pytest.mark.parametrize("lossfunc", [nn.CrossEntropyLoss(), nn.MSELoss(reduction="sum")])
def test_kflr_exact_for_single_sample(lossfunc):
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))).double()
    lossfunc = extend(lossfunc)
    X = torch.randn(1, 4, dtype=torch.double)
    y = (
        torch.randint(0, 3, (1,))
        if isinstance(lossfunc, nn.CrossEntropyLoss)
        else torch.randn(1, 3, dtype=torch.double)
    )
    with collect(KFLR()):
        lossfunc(model(X), y).backward()
    blocks = _blocks(model, ggn(model, lossfunc, X, y))
    for name, p in model.named_parameters():
        torch.testing.assert_close(_kron(p.kflr), blocks[name])


def test_kflr_factors_definition_batch():
    """B is the exact bias GGN block; A the mean input outer product."""
    torch.manual_seed(1)
    model = extend(nn.Sequential(nn.Linear(4, 3), nn.Sigmoid(), nn.Linear(3, 2))).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(6, 4, dtype=torch.double), torch.randint(0, 2, (6,))
    with collect(KFLR(), chunk_size=1):  # chunking must not scale A
        lossfunc(model(X), y).backward()
    blocks = _blocks(model, ggn(model, lossfunc, X, y))
    h = torch.sigmoid(model[0](X)).detach()
    torch.testing.assert_close(model[2].weight.kflr[1], h.t() @ h / 6)
    torch.testing.assert_close(model[2].weight.kflr[0], blocks["2.bias"])
    torch.testing.assert_close(model[0].bias.kflr[0], blocks["0.bias"])
    torch.testing.assert_close(model[0].weight.kflr[1], X.t() @ X / 6)


def test_kfac_unbiased_for_bias_block():
    torch.manual_seed(2)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3, dtype=torch.double), torch.randint(0, 3, (5,))
    blocks = _blocks(model, ggn(model, lossfunc, X, y))
    with collect(KFAC(mc_samples=4000)):
        lossfunc(model(X), y).backward()
    # MC average over 4000 samples: relative error ~ 1/sqrt(4000) ≈ 1.6 %, allow 8 %
    for name in ("0.bias", "2.bias"):
        est = dict(model.named_parameters())[name].kfac[0]
        assert (est - blocks[name]).norm() <= 0.08 * blocks[name].norm()


def test_kfra_exact_for_single_sample_and_last_layer():
    torch.manual_seed(3)
    model = extend(
        nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3))
    ).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(1, 4, dtype=torch.double), torch.randint(0, 3, (1,))
    with collect(KFRA()):
        lossfunc(model(X), y).backward()
    blocks = _blocks(model, ggn(model, lossfunc, X, y))
    for name, p in model.named_parameters():
        torch.testing.assert_close(_kron(p.kfra), blocks[name])
    # batch: the last layer's B is the batch-averaged loss Hessian = exact bias GGN
    X, y = torch.randn(6, 4, dtype=torch.double), torch.randint(0, 3, (6,))
    with collect(KFRA(), KFLR()):
        lossfunc(model(X), y).backward()
    torch.testing.assert_close(model[4].bias.kfra[0], model[4].bias.kflr[0])
    torch.testing.assert_close(model[4].weight.kfra[1], model[4].weight.kflr[1])


def test_kfra_conv_chain_single_sample():
    torch.manual_seed(4)
    model = extend(
        nn.Sequential(nn.Conv2d(1, 2, 2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3))
    ).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(1, 1, 5, 5, dtype=torch.double), torch.randint(0, 3, (1,))
    with collect(KFRA(), KFLR()):
        lossfunc(model(X), y).backward()
    for p in model.parameters():
        for a, b in zip(p.kfra, p.kflr):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("ext", [KFLR, KFRA])
def test_grouped_conv_factors_per_group_exact_for_single_sample(ext):
    """A grouped (here also a depthwise) convolution's weight gets one Kronecker pair per
    group, ``[G, O, O]`` and ``[G, I, I]``; with one sample and one output position each
    pair is the exact GGN block of that group's rows of the weight (the groups' cross terms
    are the part the block-diagonal approximation leaves out)."""
    torch.manual_seed(5)
    model = extend(
        nn.Sequential(
            nn.Conv2d(4, 6, 2, groups=2), nn.Tanh(), nn.Conv2d(6, 6, 1, groups=6), nn.Flatten(),
            nn.Linear(6, 3),
        )
    ).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(1, 4, 2, 2, dtype=torch.double), torch.randint(0, 3, (1,))
    with collect(ext()):
        lossfunc(model(X), y).backward()
    blocks = _blocks(model, ggn(model, lossfunc, X, y))
    field = ext.__name__.lower()
    for i in (0, 2):
        conv = model[i]
        b, a = getattr(conv.weight, field)
        g, per = conv.groups, conv.weight[0].numel()
        o = conv.out_channels // g
        assert b.shape == (g, o, o) and a.shape == (g, per, per)
        block = blocks[f"{i}.weight"]
        for h in range(g):
            rows = slice(h * o * per, (h + 1) * o * per)
            torch.testing.assert_close(torch.kron(b[h], a[h]), block[rows, rows])
        torch.testing.assert_close(getattr(conv.bias, field)[0], blocks[f"{i}.bias"])


def test_kfra_rejects_non_chain():
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return x + self.lin(x)

    model = extend(Res())
    lossfunc = extend(nn.CrossEntropyLoss())
    with pytest.raises(NotImplementedError, match="KFLR"), collect(KFRA()):
        lossfunc(model(torch.randn(2, 3)), torch.tensor([0, 1])).backward()


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(["linear", "conv1d", "conv2d", "conv3d", "embedding"]),
    k=st.integers(1, 2),
    dil=st.integers(1, 2),
    stride=st.integers(1, 2),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kflr_exact_limit(kind, k, dil, stride, bias, seed):
    torch.manual_seed(seed)
    if kind == "linear":
        X: Tensor = torch.randn(1, 1, 3, dtype=DT)  # a leading axis of size 1
        layer: nn.Module = nn.Linear(3, 2, bias=bias)
    elif kind == "embedding":
        X = torch.tensor([[2]])
        layer = nn.Embedding(4, 3)
    else:
        d = int(kind[-2])
        cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[d - 1]
        X = torch.randn(1, 2, *[dil * (k - 1) + 1] * d, dtype=DT)  # one output position
        layer = cls(2, 2, k, stride=stride, dilation=dil, bias=bias)
    model = Head(layer, X).to(DT)
    check_kflr_exact(model, nn.CrossEntropyLoss(), X, labels(1, seed=seed))


# -------------------------------------------------------------------------------------- on a device
@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("ext", [KFLR, KFAC])
@pytest.mark.parametrize("name", DEVICE_MODELS)
def test_kronecker_on_device(name, ext, device):
    model, lossfunc, X, y, _ = build_on_device(name, device, seed=5)
    freeze_kronecker_unsupported(model)
    extend(model), extend(lossfunc)
    fresh_backward(model, lossfunc, X, y, ext())
    check_stored(model, device, ext.savefield)
    expected = expected_kronecker_shapes(model)
    assert expected
    for key, p in trainable(model):
        factors = getattr(p, ext.savefield)
        assert [tuple(f.shape) for f in factors] == expected[key], key
        for f in factors:
            torch.testing.assert_close(f, f.T)


def _dense_kfra(
    model: nn.Sequential, lossfunc: nn.Module, X: Tensor, y: Tensor, approx: str | None = None
) -> dict:
    """KFRA from its definition on dense matrices (``torch.func``): ``Ḡ = Σₙ ∇²_{fₙ} L`` at
    the output, ``Ḡ_in = (1/N) Σₙ Jₙᵀ Ḡ_out Jₙ`` with per-sample Jacobians of each module on the
    flattened sample, and for a Linear layer with output ``[N, *T, O]`` (a Conv2d: ``O``
    channels, ``T`` output pixels, ``x`` its input patches from ``F.unfold``):
    ``B = Σₜₛ Ḡ_out[t, s]`` (``[O, O]`` blocks), ``A = (1/N) Σₙₜ xₙₜ xₙₜᵀ``; ``"expand"``:
    ``B = Σₜ Ḡ_out[t, t]``, ``A`` divided by ``T``; ``"reduce"``: ``A = (1/N) Σₙ x̄ₙ x̄ₙᵀ`` of
    the position means."""
    from torch.func import hessian, jacrev

    n = X.shape[0]
    xs = [X]
    with torch.no_grad():
        for m in model:
            xs.append(m(xs[-1]))
    H = hessian(lambda o: lossfunc(o, y))(xs[-1]).reshape(n, -1, n, xs[-1][0].numel())
    G = sum(H[i, :, i, :] for i in range(n))
    refs = {}
    for k in reversed(range(len(model))):
        m, x = model[k], xs[k]
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            if isinstance(m, nn.Linear):
                o = m.out_features
                t = xs[k + 1][0].numel() // o
                blocks = G.reshape(t, o, t, o).permute(0, 2, 1, 3)  # [t, s, O, O]
                xt = x.reshape(n, t, x.shape[-1])  # [N, T, I]
            else:
                o = m.out_channels
                t = xs[k + 1][0].numel() // o
                blocks = G.reshape(o, t, o, t).permute(1, 3, 0, 2)
                xt = F.unfold(x, m.kernel_size, m.dilation, m.padding, m.stride).transpose(1, 2)
            if approx == "expand":
                B = torch.diagonal(blocks, dim1=0, dim2=1).sum(-1)
            else:
                B = blocks.sum((0, 1))
            if approx == "reduce":
                xm = xt.mean(1)
                A = xm.t() @ xm / n
            else:
                xf = xt.reshape(-1, xt.shape[-1])
                A = xf.t() @ xf / (n * t if approx == "expand" else n)
            refs[k] = (B, A)

        def f(v: Tensor, m: nn.Module = m, x: Tensor = x) -> Tensor:
            return m(v.reshape(1, *x.shape[1:])).reshape(-1)

        Js = [jacrev(f)(x[i].reshape(-1)) for i in range(n)]
        G = sum(J.t() @ G @ J for J in Js) / n
    return refs


@pytest.mark.parametrize(
    ("shape", "act", "lossfunc"),
    [
        ((3, 4, 5), nn.Identity, nn.MSELoss()),
        ((3, 4, 2, 5), nn.Sigmoid, nn.MSELoss(reduction="sum")),
        ((2, 3, 5), nn.Tanh, nn.CrossEntropyLoss()),
    ],
)
@pytest.mark.parametrize("approx", [None, "expand", "reduce"])
def test_kfra_linear_with_middle_axes(shape, act, lossfunc, approx):
    """Linear layers with inputs ``[N, *T, I]`` in the KFRA chain: the recursion goes through
    ``I_T ⊗ W`` and ``B`` sums ``Ḡ_out`` over the positions (previously a shape error), or
    its diagonal blocks (``"expand"``)."""
    torch.manual_seed(7)
    model = extend(nn.Sequential(nn.Linear(5, 3), act(), nn.Linear(3, 2), nn.Flatten())).to(DT)
    lossfunc = extend(lossfunc)
    X = torch.randn(*shape, dtype=DT)
    d = 2 * (X[0].numel() // 5)
    if isinstance(lossfunc, nn.CrossEntropyLoss):
        y = torch.randint(0, d, (X.shape[0],))
    else:
        y = torch.randn(X.shape[0], d, dtype=DT)
    with collect(KFRA(kfac_approx=approx), KFLR(kfac_approx=approx)):
        lossfunc(model(X), y).backward()
    for k, (B, A) in _dense_kfra(model, lossfunc, X, y, approx).items():
        torch.testing.assert_close(model[k].weight.kfra[0], B)
        torch.testing.assert_close(model[k].weight.kfra[1], A)
        torch.testing.assert_close(model[k].bias.kfra[0], B)
        # the input factor is KFLR's
        torch.testing.assert_close(model[k].weight.kfra[1], model[k].weight.kflr[1])


@pytest.mark.parametrize("approx", [None, "expand", "reduce"])
def test_kfra_conv_chain_positions(approx):
    """A batch through convolutions with several output positions (padding, stride): KFRA's
    factors in each convention against the dense recursion."""
    torch.manual_seed(9)
    model = extend(nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 2, stride=2), nn.Flatten(),
        nn.Linear(8, 3),
    )).to(DT)
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(3, 2, 4, 4, dtype=DT), torch.randint(0, 3, (3,))
    with collect(KFRA(kfac_approx=approx)):
        lossfunc(model(X), y).backward()
    refs = _dense_kfra(model, lossfunc, X, y, approx)
    assert sorted(refs) == [0, 2, 4]
    for k, (B, A) in refs.items():
        torch.testing.assert_close(model[k].weight.kfra[0], B)
        torch.testing.assert_close(model[k].weight.kfra[1], A)
        torch.testing.assert_close(model[k].bias.kfra[0], B)


def test_kfra_linear_middle_axes_last_layer_single_sample_is_kflr():
    """N = 1: the last Linear's ``B = Σₜₛ Ḡ[t, s]`` equals KFLR's ``Σₘ (Σₜ gₘₜ)(Σₜ gₘₜ)ᵀ``."""
    torch.manual_seed(8)
    model = extend(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2), nn.Flatten())).to(DT)
    lossfunc = extend(nn.MSELoss())
    X, y = torch.randn(1, 3, 4, dtype=DT), torch.randn(1, 6, dtype=DT)
    with collect(KFRA(), KFLR()):
        lossfunc(model(X), y).backward()
    for p in model[2].parameters():
        for a, b in zip(p.kfra, p.kflr):
            torch.testing.assert_close(a, b)


class _TiedLM(nn.Module):
    """One token in, logits over the vocabulary through the embedding's own weight."""

    def __init__(self, vocab: int = 30, d: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lin = nn.Linear(d, d)

    def forward(self, tokens: Tensor) -> Tensor:
        return torch.tanh(self.lin(self.emb(tokens))) @ self.emb.weight.t()


def _factor_size_case(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    n = 3
    if name == "linear":
        model: nn.Module = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 4))
        x = torch.randn(n, 6)
    elif name == "conv":
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 4))
        x = torch.randn(n, 2, 4, 4)
    elif name == "conv_transpose":  # A over C_in·K = 45 features: not the weight's first axis
        model = nn.Sequential(nn.ConvTranspose2d(5, 2, 3), nn.Flatten(), nn.Linear(32, 4))
        x = torch.randn(n, 5, 2, 2)
    else:  # tied embedding and output layer: [V, V] factors
        model = _TiedLM()
        x = torch.randint(0, 30, (n,))
    model = model.double()
    x = x if x.dtype == torch.long else x.double()
    out = model(x)
    return model, x, torch.randint(0, out.shape[-1], (n,))


@pytest.mark.parametrize("name", ["linear", "conv", "conv_transpose", "tied_embedding"])
@pytest.mark.parametrize("ext", [KFLR, KFAC])
def test_factor_size_limit(monkeypatch, name, ext):
    """Kronecker factors above ``KRONECKER_FACTOR_MAX_BYTES`` are refused by name before
    anything is written; the limit at the largest factor the pass builds lets it through
    (the sides known before computing, ``Rule.kronecker_sides``, are the factors' own)."""
    from backprism.engine import rule as rule_module

    model, x, y = _factor_size_case(name)
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    with collect(ext()):
        lossfunc(model(x), y).backward()
    largest = max(f.numel() * f.element_size() for p in model.parameters()
                  for f in getattr(p, ext.savefield) if f.dim() == 2)
    side = round((largest / 8) ** 0.5)
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        delattr(p, ext.savefield)
    monkeypatch.setattr(rule_module, "KRONECKER_FACTOR_MAX_BYTES", largest - 1)
    refused = rf"\[{side}, {side}\] Kronecker factor \(.*\) for the parameter '[\w.]+' of "
    with pytest.raises(NotImplementedError, match=refused), collect(ext()):
        lossfunc(model(x), y).backward()
    for p in model.parameters():  # refused before anything was written
        assert p.grad is None and not hasattr(p, ext.savefield)
    monkeypatch.setattr(rule_module, "KRONECKER_FACTOR_MAX_BYTES", largest)
    with collect(ext()):
        lossfunc(model(x), y).backward()
    assert all(hasattr(p, ext.savefield) for p in model.parameters())
