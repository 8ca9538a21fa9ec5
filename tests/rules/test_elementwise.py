"""Parameters in broadcasting arithmetic with the samples (``backprism.rules.elementwise``):
``x * γ.reshape(1, -1, 1, 1)`` (ConvNeXt's layer scale), ``x + pos[None]``, ``(x - μ) / σ``,
… against dense float64 ``torch.func`` references, for every operation with views of the
parameter and derived operands (``exp(θ)``, ``1 + θ``, ``softplus(θ)``), with first-order
statistics and the exact GGN diagonal (``M > 1`` columns); parameter rows of the batch's
size are left to the generic rule."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from backprism import collect, extend
from backprism.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, SumGradSquared, Variance
from backprism.rules import elementwise
from tests.common import assert_first_order
from tests.reference import diag_ggn, per_sample_grads

DT = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}
C, T = 3, 4

#: view → (parameter shape for channels-last ``[N, T, C]`` activations, the view)
VIEWS = {
    "plain": ((C,), lambda p: p),
    "reshape": ((C,), lambda p: p.reshape(1, 1, -1)),
    "none_index": ((C,), lambda p: p[None]),
    "transpose": ((C, T), lambda p: p.T),
    "expand": ((T, 1), lambda p: p.expand(T, C)),
    "slice": ((C + 2,), lambda p: p[2:]),
    "scalar": ((), lambda p: p),
    # not views: the rebuild's own vector-Jacobian product
    "derived": ((C,), lambda p: p.exp()),
    "affine": ((C,), lambda p: (1 + p).reshape(1, 1, -1)),
    "softplus": ((T, 1), lambda p: torch.nn.functional.softplus(p).expand(T, C)),
}
OPS = {
    "mul": lambda x, q: x * q,
    "rmul": lambda x, q: q * x,
    "add": lambda x, q: x + q,
    "sub": lambda x, q: x - q,
    "rsub": lambda x, q: q - x,
    "div": lambda x, q: x / q,
    "rdiv": lambda x, q: q / x,
    "add_alpha": lambda x, q: torch.add(x, q, alpha=0.5),
    "torch_mul": lambda x, q: torch.mul(x, q),
}


class Scaled(nn.Module):
    """``head(tanh(op(h, view(θ))))`` with ``h`` per-sample activations ``[N, T, C]``, or
    ``[N, C, T, 1]`` (channels first, the parameter reshaped to ``[1, C, 1, 1]``)."""

    def __init__(self, op: str, view: str, channels_first: bool = False) -> None:
        super().__init__()
        shape, self.view = VIEWS[view]
        self.op, self.channels_first = OPS[op], channels_first
        self.lin = nn.Linear(2, C)
        self.theta = nn.Parameter(torch.rand(shape) + 0.5)  # positive: a safe divisor
        self.head = nn.Linear(C * T, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = 1.5 + torch.tanh(self.lin(x))  # [N, T, C], away from 0 (a divisor)
        if self.channels_first:
            h = self.op(h.transpose(1, 2).unsqueeze(-1), self.theta.reshape(1, -1, 1, 1))
        else:
            h = self.op(h, self.view(self.theta))
        return self.head(torch.tanh(h).flatten(1))


def _run(
    model: nn.Module, X: Tensor, y: Tensor, *extensions, path: str = "per_sample"
) -> list:
    """One extended backward pass; for each call of ``elementwise.<path>`` whether it took
    the closed form (``False``: it returned ``None``, the generic ``vmap``)."""
    lf = nn.CrossEntropyLoss()
    extend(model), extend(lf)
    taken: list = []
    real = getattr(elementwise, path)

    def spy(*args):
        out = real(*args)
        taken.append(out is not None)
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the generic rule's notice for leaf types)
        with mock.patch.object(elementwise, path, spy), collect(*extensions):
            lf(model(X), y).backward()
    return taken


@settings(max_examples=30, deadline=None)
@given(
    op=st.sampled_from(sorted(OPS)),
    view=st.sampled_from(sorted(VIEWS)),
    n=st.integers(1, 4),
    channels_first=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_first_order(op: str, view: str, n: int, channels_first: bool, seed: int) -> None:
    torch.manual_seed(seed)
    model = Scaled(op, view, channels_first and VIEWS[view][0] == (C,)).to(DT)
    X, y = torch.randn(n, T, 2, dtype=DT), torch.randint(0, 3, (n,))
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    taken = _run(model, X, y, BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())
    assert_first_order(model, ref, **TOL)
    assert taken and all(taken), taken


@pytest.mark.parametrize("view", ["reshape", "transpose", "slice", "derived", "softplus"])
@pytest.mark.parametrize("op", ["mul", "rdiv", "sub"])
def test_diag_ggn_exact(op: str, view: str) -> None:
    """``M = 3`` exact columns: ``diag_ggn_exact`` of the parameter and of the layers around."""
    torch.manual_seed(0)
    model = Scaled(op, view).to(DT)
    X, y = torch.randn(4, T, 2, dtype=DT), torch.randint(0, 3, (4,))
    ref = diag_ggn(model, nn.CrossEntropyLoss(), X, y)
    taken = _run(model, X, y, DiagGGNExact())
    assert taken and all(taken)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref[k], **TOL)


class FoldedScaled(nn.Module):
    """Swin V2's ``attn * exp(clamp(s))`` on its windows' rows: ``op(h, view(θ))`` on the
    batch folded sample-major with ``W = 2`` windows of ``T / 2`` positions (``[2N, T/2, C]``),
    then regrouped per sample."""

    def __init__(self, op: str, view: str) -> None:
        super().__init__()
        self.inner = Scaled(op, view)

    def forward(self, x: Tensor) -> Tensor:
        m = self.inner
        h = 1.5 + torch.tanh(m.lin(x))  # [N, T, C]
        h = h.reshape(2 * x.shape[0], T // 2, C)  # (rows n·2, n·2 + 1 of sample n)
        q = m.view(m.theta)
        h = m.op(h, q[: T // 2] if q.dim() > 1 else q)  # ([T/2, C] of the [T, C] ones)
        return m.head(torch.tanh(h).reshape(x.shape[0], -1))


@pytest.mark.parametrize("view", ["plain", "derived", "affine", "softplus"])
@pytest.mark.parametrize("op", ["mul", "rdiv", "sub"])
@pytest.mark.parametrize("n", [1, 3])
def test_folded_batch(op: str, view: str, n: int) -> None:
    """The parameter meets a batch folded with windows: the closed form computes per row and
    sums each sample's rows (it went to the generic rule's ``vmap``); first order and the
    exact GGN diagonal (``M = 3`` columns) against the definitions."""
    torch.manual_seed(0)
    model = FoldedScaled(op, view).to(DT)
    X, y = torch.randn(n, T, 2, dtype=DT), torch.randint(0, 3, (n,))
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    taken = _run(model, X, y, BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())
    assert taken == [True]
    assert_first_order(model, ref, **TOL)
    model.zero_grad()
    ggn = diag_ggn(model, nn.CrossEntropyLoss(), X, y)
    assert _run(model, X, y, DiagGGNExact()) == [True]
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ggn[k], **TOL)


def test_layer_scale_of_a_convnext_block() -> None:
    """ConvNeXt's ``x.mul(self.gamma.reshape(1, -1, 1, 1))`` after a depthwise convolution, in
    a residual block: the closed form, and the depthwise convolution's own path."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv_dw = nn.Conv2d(C, C, 3, padding=1, groups=C)
            self.gamma = nn.Parameter(torch.rand(C) + 0.5)
            self.head = nn.Linear(C * 9, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = self.conv_dw(x).mul(self.gamma.reshape(1, -1, 1, 1)) + x
            return self.head(torch.tanh(h).flatten(1))

    torch.manual_seed(0)
    model = Block().to(DT)
    X, y = torch.randn(5, C, 3, 3, dtype=DT), torch.randint(0, 3, (5,))
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    taken = _run(model, X, y, BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())
    assert taken == [True]
    assert_first_order(model, ref, **TOL)


def test_parameter_rows_of_the_batch_size_take_the_generic_rule() -> None:
    """``h * θ`` with ``θ`` of shape ``[N, C]``: no broadcast over the batch (row ``n`` of
    ``θ`` meets sample ``n``, a sample's output is not a function of that sample alone), so
    the closed form steps aside and the generic rule refuses the call by name."""

    class Rows(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.lin = nn.Linear(2, C)
            self.theta = nn.Parameter(torch.rand(n, C) + 0.5)
            self.head = nn.Linear(C, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(torch.tanh(self.lin(x) * self.theta))

    torch.manual_seed(0)
    model = Rows(4).to(DT)
    X, y = torch.randn(4, 2, dtype=DT), torch.randint(0, 3, (4,))
    with pytest.raises(RuntimeError, match="cannot find the batch axis of output 0 of OpModule"):
        _run(model, X, y, BatchGrad())
    assert not hasattr(model.theta, "grad_batch")


# -- modules whose output is affine in each parameter ---------------------------------------
class LayerScale(nn.Module):
    """timm's ``LayerScale``: ``x * γ`` (trailing axis)."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(C) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class LayerScale2d(nn.Module):
    """timm's ``LayerScale2d``: ``x * γ.view(1, -1, 1, 1)`` (channel axis 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(C) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x.mul(self.gamma.view(1, -1, 1, 1))


class AffineAB(nn.Module):
    """ResMLP's ``Affine``: ``β + α ⊙ x`` with ``α, β`` of shape ``[1, 1, C]``."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.rand(1, 1, C) + 0.5)
        self.beta = nn.Parameter(torch.randn(1, 1, C))

    def forward(self, x: Tensor) -> Tensor:
        return torch.addcmul(self.beta, self.alpha, x)


class PReLUSlopes(nn.Module):
    """``F.prelu(x, w)``: affine in ``w`` with a coefficient that depends on the sign of x."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(C) * 2 - 1)

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.prelu(x.transpose(1, 2), self.w).transpose(1, 2)


class Squared(nn.Module):
    """``x * θ²``: not affine in ``θ`` (the probe refuses it; the generic ``vmap``)."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.rand(C) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.theta**2


class WithLeaf(nn.Module):
    def __init__(self, leaf: nn.Module, channels_first: bool = False) -> None:
        super().__init__()
        self.lin, self.leaf, self.head = nn.Linear(2, C), leaf, nn.Linear(C * T, 3)
        self.channels_first = channels_first

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.lin(x))  # [N, T, C]
        if self.channels_first:
            h = self.leaf(h.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)
        else:
            h = self.leaf(h)
        return self.head(torch.tanh(h).flatten(1))


LEAVES = {
    "layer_scale": (LayerScale, False, True),
    "layer_scale_2d": (LayerScale2d, True, True),
    "affine": (AffineAB, False, True),
    "prelu": (PReLUSlopes, False, True),
    "squared": (Squared, False, False),
}


def _affine_taken(model: nn.Module, X: Tensor, y: Tensor, *extensions) -> list:
    return _run(model, X, y, *extensions, path="affine_per_sample")


@pytest.mark.parametrize("n", [2, 5])
@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_affine_leaf_modules_first_order(leaf: str, n: int) -> None:
    """Leaf modules without a rule whose output is affine in each parameter take the closed
    form ``Σ_r g ⊙ A``; one that is not (``x θ²``) the generic ``vmap``; the same numbers."""
    make, channels_first, affine = LEAVES[leaf]
    torch.manual_seed(n)
    model = WithLeaf(make(), channels_first).to(DT)
    X, y = torch.randn(n, T, 2, dtype=DT), torch.randint(0, 3, (n,))
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    taken = _affine_taken(model, X, y, BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())
    assert taken and all(t == affine for t in taken), taken
    assert_first_order(model, ref, **TOL)


@pytest.mark.parametrize("leaf", ["layer_scale_2d", "affine", "prelu"])
def test_affine_leaf_modules_diag_ggn_exact(leaf: str) -> None:
    make, channels_first, _ = LEAVES[leaf]
    torch.manual_seed(0)
    model = WithLeaf(make(), channels_first).to(DT)
    X, y = torch.randn(4, T, 2, dtype=DT), torch.randint(0, 3, (4,))
    ref = diag_ggn(model, nn.CrossEntropyLoss(), X, y)
    assert all(_affine_taken(model, X, y, DiagGGNExact()))
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref[k], **TOL)


def test_affine_probe_needs_two_samples() -> None:
    """With one sample the independence of the samples cannot be checked: the ``vmap``."""
    torch.manual_seed(0)
    model = WithLeaf(LayerScale()).to(DT)
    X, y = torch.randn(1, T, 2, dtype=DT), torch.randint(0, 3, (1,))
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    assert _affine_taken(model, X, y, BatchGrad(), BatchL2Grad()) == [False]
    torch.testing.assert_close(model.leaf.gamma.grad_batch, ref["leaf.gamma"], **TOL)
